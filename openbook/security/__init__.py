"""Credentials and trust: bearer tokens checked one way (``auth``), the deployment's secret
files (``secrets``) and the MACs that seal what openbook keeps in Redis (``sealing``).

Imports only the top-level leaves (``openbook.errors``, ``openbook.types``); torch-free.
"""
