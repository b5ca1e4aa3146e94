"""What the fork server of :mod:`gossipdl.experiments.forking` imports, and only it.

It imports :mod:`gossipdl.cli` (and so torch, numpy and zmq) once for all the children,
with what a peer imports only when it runs: typer's adapters (pydantic: 0.1 s, when typer
first parses a command line) and the peer's own modules. Not ``torch._dynamo`` (1.1–1.6 s,
more than torch itself, on the path to every peer's first round): ``torch.optim``'s steps
import it, and peers step with gossipdl's own SGD; a peer configured with Adam imports it
itself. It blocks SIGINT in the
server, so every child is born with it blocked: a Ctrl-C that a terminal sends to the
whole process group stays pending in a benchmark's worker (its script stops it), and a
forked ``gossipdl`` command unblocks it first thing, as a fresh interpreter has it. The
server itself ignores SIGINT anyway.
"""

import contextlib
import importlib
import signal

# First, so that a Ctrl-C during the imports (a second of them) leaves the server alone too:
# it printed a KeyboardInterrupt traceback beside the command's one line.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
for name in ("gossipdl.cli", "gossipdl.experiments.summary", "gossipdl.peers.launch_env",
             "gossipdl.peers.runner"):  # fmt: skip
    importlib.import_module(name)  # the imports are the point

with contextlib.suppress(ImportError):  # a private module: a typer without it still works
    import typer._adapters  # noqa: F401
