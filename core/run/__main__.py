"""``python -m torsh.run [torchrun options] script [args]``: see :mod:`torsh.run`."""

from torsh.run import main

main()
