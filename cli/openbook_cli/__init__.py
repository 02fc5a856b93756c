"""The ``openbook`` command (see :mod:`openbook_cli.app`) and ``openbook up``'s launcher."""
