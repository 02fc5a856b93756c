"""What a process is configured with: the settings every service shares and the base of each
service's own settings class (``settings``), and where openbook's Redis is when nothing says so
(``redis_endpoint``, the record ``openbook up`` writes).

Imports :mod:`openbook.security` (secret files, the server key); torch-free.
"""
