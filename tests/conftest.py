"""Shared test fixtures: one dataset cache per session and helpers to run real peers."""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from gossipdl.config import Config, to_toml
from gossipdl.experiments import forking
from gossipdl.experiments.forking import ForkedCommand
from gossipdl.rundir import complete_lines

# The processes the tests start (peers, commands: hundreds) compile gossipdl's modules once
# and share the bytecode, where PYTHONDONTWRITEBYTECODE (set on these machines) had each
# compile them again: 0.26 s a process.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per core. The tests that start real peers wait on sockets,
    paced steps and timeouts much of the time, and, forked from a preloaded server, no
    longer spend seconds of CPU importing torch; the spare workers fill the waits (on 2
    cores, full suites taking turns on 2026-11-29: 290 and 279 s with 4 workers, 263
    and 290 s with 3, 338 s with 2)."""
    return 2 * (os.cpu_count() or 1)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread in the test processes, as real peers (``threads = 1``) and
    ``simulate`` use: on a busy machine torch's thread pool makes tiny models' steps many
    times slower (and the suite runs one worker per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One MNIST-1D cache for the whole session (peer subprocesses inherit it), never ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GOSSIPDL_CACHE", str(tmp_path_factory.getbasetemp() / "gossipdl-cache"))
        yield


def small_config(tmp_path: Path, **changes: Any) -> Config:
    """A fast swarm: logistic regression on the synthetic blobs."""
    values: dict[str, Any] = {
        "peers": 3,
        "dataset": "synthetic",
        "model": "logistic",
        "steps": 60,
        "eval_every": 0,
        "log_every": 5,
        "lr": 0.1,
        "round_timeout": 10.0,
        "startup_timeout": 60.0,
        "threads": 1,
        "out": str(tmp_path / "run"),
        **changes,
    }
    return Config(**values)


def write_config(path: Path, config: Config) -> Path:
    """Write ``config`` as TOML and return the path."""
    path.write_text(to_toml(config))
    return path


def restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI sets up logging for the process it runs in: give the next tests theirs back."""
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    monkeypatch.setattr(logging.root, "level", logging.root.level)


def in_threads(
    work: Callable[[Any], object], items: Iterable[Any], timeout: float = 240.0
) -> list[BaseException]:
    """``work(item)`` for every item, each on a thread of its own (e.g. the ranks of one
    group in this process, over real sockets); waits for them all, ``timeout`` seconds at
    most; the errors raised, and a TimeoutError for each still running (it returned as if
    all had ended, and a test read the results of one that had not)."""
    errors: list[BaseException] = []

    def run(item: Any) -> None:
        try:
            work(item)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [
        TimeoutError(f"{t.name} still running after {timeout:g} s") for t in threads if t.is_alive()
    ]
    return errors + late


FREE_PORTS = range(10_000, 20_000)
"""Where :func:`free_addresses` picks ports: below the kernel's ephemeral range (32768 on
up), which every outgoing connection takes its source port from, so a test dialling many
addresses in parallel cannot take a port between its pick and its bind (a ring test's
``Address already in use``); and below the ports tests dial as nobody's (20000 on up)."""


def free_addresses(n: int) -> list[str]:
    """``n`` distinct loopback addresses whose ports were free a moment ago (bound together,
    then released), from :data:`FREE_PORTS`."""
    picks = random.Random()
    sockets: list[socket.socket] = []
    while len(sockets) < n:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", picks.choice(FREE_PORTS)))
        except OSError:  # taken (or picked twice): another
            s.close()
            continue
        sockets.append(s)
    addresses = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    for s in sockets:
        s.close()
    return addresses


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until truthy; fail loudly naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def gossipdl_cmd(*args: str) -> list[str]:
    """The CLI run exactly as a user would, through the installed interpreter."""
    return [sys.executable, "-m", "gossipdl", *args]


def fork_gossipdl(*args: str, log: Path) -> ForkedCommand:
    """``gossipdl ARGS`` as the launcher starts a peer: forked from the preloaded server, a
    process of its own with one torch thread, its stderr in ``log``."""
    return ForkedCommand(list(args), {**os.environ, "OMP_NUM_THREADS": "1"}, log)


def start_peer(*args: str, log: Path) -> tuple[ForkedCommand, str]:
    """Start ``gossipdl peer ARGS`` as the launcher does (:func:`fork_gossipdl`) and return
    it and its listening address."""
    proc = fork_gossipdl("peer", *args, log=log)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        pytest.fail(f"peer did not start: {line!r}\n{log.read_text()}")
    return proc, line.split()[-1]


def run_forked(*args: str, log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``gossipdl ARGS`` forked (:func:`fork_gossipdl`) and run to its end: like
    ``subprocess.run`` with captured output (stderr is also kept in ``log``), without a
    fresh interpreter importing torch. For commands that start no local peers: a forked
    command is daemonic, so a launch from it would start its peers as subprocesses."""
    proc = fork_gossipdl(*args, log=log)
    assert proc.stdout is not None
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()  # a full pipe must not block it while we wait
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    return subprocess.CompletedProcess(list(args), code, "".join(chunks), log.read_text())


def run_script(
    script: Path, *args: str, cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` in ``cwd``, as ``subprocess.run`` with captured output would
    run it, but forked from this worker's preloaded fork server: torch is imported once per
    worker, not once per script (about 2.5 s of CPU each). Not daemonic, so the script may
    fork peers of its own as it does when a user runs it."""
    out, err = (Path(cwd) / f".{script.stem}.{name}" for name in ("stdout", "stderr"))
    process = forking.context().Process(
        target=_script_main, args=(str(script), list(args), str(cwd), str(out), str(err))
    )
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired([str(script), *args], timeout)
    stdout, stderr = out.read_text(), err.read_text()
    return subprocess.CompletedProcess([str(script), *args], process.exitcode, stdout, stderr)


def _script_main(script: str, args: list[str], cwd: str, out: str, err: str) -> None:
    """The child of :func:`run_script`: its streams into files, ``sys.argv``, ``sys.path``,
    the working directory and SIGINT as ``python SCRIPT`` has them, then the script."""
    import runpy

    forking.redirect(1, out)
    forking.redirect(2, err)
    forking.as_a_fresh_interpreter()
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


class ForkedRanks:
    """The processes of one real-process test (ranks, shards, workers), forked from this
    worker's preloaded server rather than spawned (a spawned one imports torch: 2.5-4 s of
    CPU each), with one result queue. Each child's stderr goes to a file of its own in
    ``logs``, and a result that never comes fails the test with every child's exit code and
    log, at once if they have all ended (a forked child's traceback would otherwise land in
    the fork server's stderr, in no test's report)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self._context = forking.context()
        self.results: Any = self._context.Queue()
        self._processes: list[Any] = []

    def start(self, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(*args)`` in a new child (``results`` may be among ``args``)."""
        log = self.logs / f"process-{len(self._processes)}.log"
        process = self._context.Process(target=_logged, args=(str(log), target, args))
        process.start()
        self._processes.append(process)

    def get(self, timeout: float) -> Any:
        """The next result; fails naming every child after ``timeout`` seconds, or as soon as
        all of them have ended without one."""
        deadline = time.monotonic() + timeout
        while True:
            ended = all(p.exitcode is not None for p in self._processes)
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                if ended or time.monotonic() > deadline:
                    why = "every process ended" if ended else f"none in {timeout}s"
                    pytest.fail(f"a result was missing ({why}):\n{self.report()}")

    def join(self, timeout: float) -> list[int | None]:
        """Wait for every child (``timeout`` seconds each); their exit codes, killing any
        left running (None)."""
        codes = []
        for process in self._processes:
            process.join(timeout)
            codes.append(process.exitcode)
            if process.exitcode is None:
                process.kill()
                process.join()
        return codes

    def report(self) -> str:
        """Every child's exit code and stderr, for a failure message."""
        logs = [(self.logs / f"process-{k}.log").read_text() for k in range(len(self._processes))]
        return "\n".join(
            f"--- process {k} (exit code {p.exitcode}):\n{log}"
            for k, (p, log) in enumerate(zip(self._processes, logs, strict=True))
        )


def _logged(log: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """A :class:`ForkedRanks` child: its stderr (where an uncaught exception's traceback
    goes) into ``log``, then the target."""
    forking.redirect(2, log)
    target(*args)


@pytest.fixture
def forked_ranks(tmp_path: Path) -> Iterator[ForkedRanks]:
    """A :class:`ForkedRanks` whose children are killed if the test leaves any running."""
    ranks = ForkedRanks(tmp_path)
    yield ranks
    ranks.join(0)


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete metrics line of a peer, or None: a line still being written (no
    newline yet) is not complete."""
    if not path.is_file():
        return None
    lines = [ln for ln in complete_lines(path) if ln.strip()]
    return json.loads(lines[-1]) if lines else None


def with_header(message: list[Any], **changes: Any) -> list[Any]:
    """``message`` with header fields replaced: a hand-made malformed message."""
    header = {**msgpack.unpackb(bytes(message[0])), **changes}
    return [msgpack.packb(header), *message[1:]]


def live_processes() -> dict[int, tuple[int, bytes]]:
    """Every live (not zombie) process: pid -> (parent pid, command line)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # not a process, or one that just ended
        if state != "Z":
            found[int(proc.name)] = (int(parent), cmdline)
    return found


def peer_pids(run_dir: Path) -> dict[int, int]:
    """Live peer processes of a launched run, from the ``pid`` of each peer's latest life
    (its last ``start`` line): rank -> pid."""
    live = live_processes()
    pids = {}
    for path in (run_dir / "peers").glob("*.jsonl"):
        starts = [line for line in complete_lines(path) if b'"start":true' in line]
        pid = json.loads(starts[-1])["pid"] if starts else None
        if pid in live:
            pids[int(path.stem)] = pid
    return pids


WALL_CLOCK = re.compile(rb'"(unix_time|swarm_start)":[0-9.e+-]+')  # the fields that may differ


def run_files(run: Path) -> dict[str, bytes]:
    """A simulated run's metrics files and summary, with the fields that name wall-clock time
    (or this host) masked: what must be byte-identical for the same config and seed."""
    found = {p.name: p.read_bytes() for p in sorted((run / "peers").glob("*.jsonl"))}
    summary = json.loads((run / "summary.json").read_text())
    for key in ("provenance", "host_time_s", "step_time_s"):
        summary.pop(key)
    summary["config"].pop("out")
    found["summary.json"] = json.dumps(summary, sort_keys=True).encode()
    return {name: WALL_CLOCK.sub(rb'"\1":0', data) for name, data in found.items()}
