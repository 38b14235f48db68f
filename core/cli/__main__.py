"""``python -m torsh.cli`` runs torsh-migrate."""

from torsh.cli import entry

entry()
