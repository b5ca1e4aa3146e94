"""What the fork server of :mod:`gossipdl.experiments.forking` imports, and only it.

It imports :mod:`gossipdl.cli` (and so torch, numpy and zmq) once for all the children,
and blocks SIGINT in the server, so every child is born with it blocked: a Ctrl-C that
a terminal sends to the whole process group stays pending in a benchmark's worker (its
script stops it), and a forked ``gossipdl`` command unblocks it first thing, as a fresh
interpreter has it. The server itself ignores SIGINT anyway.
"""

import signal

import gossipdl.cli  # noqa: F401  (the import is the point)

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
