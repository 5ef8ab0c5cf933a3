"""Launcher tests. A package so that this folder's conftest.py is imported as
``launcher.conftest`` and does not replace ``tests/conftest.py`` as the module ``conftest``,
which other test files import from. Import this folder's modules relatively
(``from .sshd_nodes import start_ssh_nodes``)."""
