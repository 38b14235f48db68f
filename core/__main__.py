"""``python -m torsh`` runs torsh-migrate (the same as the console script)."""

from torsh.cli import entry

entry()
