"""Local peers forked from a server that has imported gossipdl and torch once.

A fresh ``python -m gossipdl peer`` spends about 2.5 s of CPU importing torch before it
does anything; a swarm of eight pays that eight times over, on the same cores the
founder is already training on. Here a local launch asks multiprocessing's fork server
(one process, started once per launcher, that imports :mod:`gossipdl.cli` and so torch,
and runs no torch operation, so it has no thread pool to break by forking) for each
peer: the child is a copy of an interpreter that has done its imports, and runs the
same ``gossipdl`` command line a subprocess would. :class:`ForkedCommand` looks like
the ``subprocess.Popen`` the launcher used (pid, stdout, poll, wait, kill, signals,
return codes as negative signal numbers), so the launcher treats both alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from gossipdl.numerals import is_decimal

PRELOAD = ["gossipdl.experiments.fork_preload"]
"""What the fork server imports before it forks anybody: gossipdl's CLI, torch with it,
and SIGINT blocked (see :mod:`gossipdl.experiments.fork_preload`)."""


def available() -> bool:
    """Whether a command can be forked from here: the platform has a fork server (POSIX;
    not Windows) and this is not a daemonic multiprocessing worker (those may not start
    processes of their own, e.g. a launch inside a user's ``Pool``)."""
    daemonic = multiprocessing.current_process().daemon
    return "forkserver" in multiprocessing.get_all_start_methods() and not daemonic


def context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose processes are forked from the preloaded server:
    a worker starts without importing torch, with SIGINT blocked for its life (its
    parent stops it), and with memory of its own (its peak RSS starts at the imports')."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def warm_up() -> None:
    """Start the fork server now, so its imports overlap the caller's own start-up."""
    if available():
        context()
        _ensure_server()


def _ensure_server() -> None:
    """Start the fork server if it is not running, born with SIGINT blocked: a Ctrl-C to the
    process group before its preload blocks it printed the server's traceback (ours is
    delivered once we unblock it). Its resource tracker first: starting, that unblocks
    SIGINT in the caller (multiprocessing blocks it around its own start)."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


LAUNCH_COMMANDS = ("run", "experiment", "sweep")
"""The ``gossipdl`` commands that start local peers."""


def warm_up_for(argv: list[str]) -> None:
    """:func:`warm_up` when ``argv`` is a ``gossipdl`` command that starts local peers (one
    of :data:`LAUNCH_COMMANDS`): the CLI calls it before its own imports, so the server's
    (torch, about 3.5 s of CPU) run beside the command's (2.3 s) on another core instead
    of after them."""
    command = Path(argv[0]).name in ("gossipdl", "__main__.py") and argv[1:2]
    if command and argv[1] in LAUNCH_COMMANDS:
        warm_up()


def redirect(fd: int, path: str, mode: str = "w") -> None:
    """Point a forked child's file descriptor ``fd`` (1: stdout, 2: stderr, where an
    uncaught exception's traceback goes) at the file ``path``: what the child writes
    lands in its own file, not in the fork server's streams."""
    with open(path, mode) as stream:
        os.dup2(stream.fileno(), fd)


def as_a_fresh_interpreter() -> None:
    """What a forked child needs to behave as ``python ...`` would: SIGINT unblocked (the
    server blocks it for its children) and Python's streams writing through (a fresh
    interpreter's would flush before it is stopped)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]


def _run(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    out: multiprocessing.connection.Connection,
    log_path: str,
    log_mode: str,
) -> None:
    """The child: stdout into ``out``, stderr into the log, ``env`` (its ``PYTHONPATH``
    on ``sys.path`` too, its ``OMP_NUM_THREADS`` as torch's threads), ``cwd`` and SIGINT
    as a fresh interpreter would have them, then ``gossipdl ARGS``."""
    os.dup2(out.fileno(), 1)
    out.close()
    redirect(2, log_path, log_mode)
    as_a_fresh_interpreter()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra  # where a fresh interpreter would put them
    if is_decimal(env.get("OMP_NUM_THREADS", "")):  # read when torch loaded, in the server
        import torch

        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    sys.argv = ["gossipdl", *args]
    from gossipdl.cli import main

    main()


class ForkedCommand:
    """``gossipdl ARGS`` in a process forked from the fork server, its stdout readable as
    ``stdout`` (text), its stderr written to ``log_path``."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, mode: str = "w"):
        reader, writer = multiprocessing.Pipe(duplex=False)
        self._process = context().Process(
            target=_run,
            args=(args, env, os.getcwd(), writer, str(log_path), mode),
            name=f"gossipdl {' '.join(args[:1])}",
            daemon=True,  # a caller that exits stops it (SIGTERM) rather than waiting on it
        )
        _ensure_server()
        self._process.start()
        writer.close()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.stdout: IO[str] | None = os.fdopen(os.dup(reader.fileno()), "r")
        reader.close()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (a signal's as minus its number), or None while it runs."""
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` unless it has ended (the fork server may have reaped it before
        its exit code reached us: then there is nothing to signal)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL (Popen's ``kill``)."""
        self.send_signal(signal.SIGKILL)
