"""``python -m gossipdl`` and the ``gossipdl`` command. Ctrl-C while it starts (its imports
take a second) exits 130 with one line, as it does later, not with a traceback."""

import os
import sys


def run() -> None:
    """The ``gossipdl`` command, imports included."""
    try:
        from gossipdl.cli import main

        main()
    except KeyboardInterrupt:
        print("interrupted while gossipdl started; nothing ran", file=sys.stderr, flush=True)
        os._exit(130)  # at once: the interpreter's exit, amid imports, could die of the signal


if __name__ == "__main__":
    run()
