"""``python -m gossipdl`` is the ``gossipdl`` command."""

from gossipdl.cli import main

main()
