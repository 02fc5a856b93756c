"""Offline demo assets: the shipped data, the default generator and the demo indexes.

``openbook demo prepare`` (see :mod:`openbook_trainer.demo.cli`) turns them into what the
services load.
"""
