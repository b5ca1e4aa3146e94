"""Start a local swarm: one ``gossipdl peer`` process per peer, watched until they finish.

Peers are forked from a server that has imported gossipdl and torch once
(:mod:`gossipdl.experiments.forking`), so a swarm starts in about the time of one import.

The launcher is a spawner and observer, not a coordinator: peer 0 founds the
swarm, the others join it through its address like any remote peer would, and
all training traffic flows between peers. Progress is read from the metrics
files the peers write, so what the display shows is what the run directory holds.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from gossipdl.config import ADVERTISE_ENV, Config, ConfigError, cautions, resolved, to_toml
from gossipdl.data import DataError
from gossipdl.experiments import forking
from gossipdl.experiments.display import LiveProgress
from gossipdl.experiments.forking import ForkedCommand
from gossipdl.experiments.orphans import LAUNCHER_PID_ENV
from gossipdl.experiments.summary import summarize
from gossipdl.models import ModelError, build_model
from gossipdl.peers.device import pick_device
from gossipdl.peers.sinks import check_sinks, refuse_used_sink_dirs
from gossipdl.rundir import RUN_START_ENV, RunDir, default_run_dir
from gossipdl.sim.faults import refuse_outside_simulation
from gossipdl.training import dataset_of, last_steps, parts_of

log = logging.getLogger(__name__)

LISTENING = "listening on "
_STOP_GRACE_S = 30.0
_SERVER_EXIT_S = 5.0
Process = subprocess.Popen[str] | ForkedCommand
"""A launched peer or server: forked from the fork server, or (on an emulated host, or
where there is no fork server) a subprocess."""


class LaunchError(RuntimeError):
    """A peer process could not start or died; the message names it and its log."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM (``signum``) after saving what it measured; a
    program that ends on it exits with ``exit_code``, 128 + the signal, as shells do."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def fresh_run(config: Config, caution: bool = True) -> tuple[RunDir, Config]:
    """The run directory ``config`` names (default ``runs/<timestamp>``), created, with the
    resolved config in its ``config.toml`` (what ran); ConfigError if it, or a folder of the
    metrics sinks (csv, tensorboard), holds an earlier run's files. With
    ``caution`` its :func:`~gossipdl.config.cautions` are logged as warnings (the fault
    search draws such settings on purpose)."""
    run = RunDir(config.out or default_run_dir())
    if run.peer_ids() or run.summary.exists():
        raise ConfigError(
            f"{run.root} already holds a run (its metrics would be mixed with the new ones); "
            "choose another --out or delete it"
        )
    refuse_used_sink_dirs(config)
    run.create()
    config = resolved(config.replace(out=str(run.root)))
    run.config.write_text(to_toml(config))
    for text in cautions(config) if caution else []:
        log.warning("%s", text)
    return run, config


def preflight(config: Config) -> int:
    """Load the data, partition it and build the model once here, before any process starts.

    A partition that cannot be drawn, a device this machine lacks or a model that does not
    fit the data is reported now, and the dataset cache is warm for the peers; so is a metrics
    sink that cannot work (:func:`~gossipdl.peers.sinks.check_sinks`). Returns the parameter
    count.
    """
    check_sinks(config)
    try:
        dataset = dataset_of(config)
    except DataError as exc:
        raise ConfigError(f"dataset = {config.dataset!r}: {exc}") from None
    if config.mode != "single":
        try:
            parts_of(config, dataset)
        except DataError as exc:
            raise ConfigError(f"partition = {config.partition!r}: {exc}") from None
    try:
        pick_device(config.device)
    except RuntimeError as exc:
        raise ConfigError(f"device = {config.device!r}: {exc}; use auto or cpu") from None
    try:
        model = build_model(
            config.model, dataset.input_shape, dataset.num_classes, list(config.hidden) or None
        )
    except ModelError as exc:
        raise ConfigError(f"model = {config.model!r}: {exc}") from None
    return sum(p.numel() for p in model.parameters())


def server_args(config_path: Path, out: Path, shard: int, listen: str) -> list[str]:
    """The ``gossipdl`` arguments of one launched parameter-server shard."""
    return [
        "server",
        "--config",
        str(config_path),
        "--shard",
        str(shard),
        "--listen",
        listen,
        "--out",
        str(out),
    ]


def peer_args(
    config_path: Path,
    out: Path,
    rank: int,
    listen: str,
    threads: int,
    bootstrap: str | None,
    servers: list[str] | None = None,
) -> list[str]:
    """The ``gossipdl`` arguments of one launched peer (a ps worker: with ``servers``)."""
    cmd = [
        "peer",
        "--config",
        str(config_path),
        "--rank",
        str(rank),
        "--listen",
        listen,
        "--out",
        str(out),
        "--threads",
        str(threads),
        "--local-index",
        str(rank),
        "--no-summary",
    ]
    if servers:
        cmd += ["--servers", ",".join(servers)]
    return cmd + (["--bootstrap", bootstrap] if bootstrap else [])


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _read_address(
    proc: Process,
    log_path: Path,
    timeout: float,
    who: str = "peer 0",
    stopped: Callable[[], bool] = lambda: False,
) -> str | None:
    """Wait for a process's 'listening on ADDRESS' line (the founder's, or a server's); None
    once ``stopped`` says a signal asked the launch to stop (the process may have ended on
    the same Ctrl-C), then copy the rest of its stdout to its log (:func:`_drain`)."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopped():
        if selector.select(0.2):
            line = proc.stdout.readline()
            if line.startswith(LISTENING):
                _drain(proc.stdout, log_path)
                return line[len(LISTENING) :].strip()
            if not line:
                break
        if proc.poll() is not None:
            break
    if stopped() or _signal_arrives(stopped):
        return None
    proc.kill()
    raise LaunchError(f"{who} did not start listening; its log {log_path}:\n{_log_tail(log_path)}")


def _signal_arrives(stopped: Callable[[], bool], within: float = 0.5) -> bool:
    """Whether ``stopped`` turns true within ``within`` seconds: a Ctrl-C to the process
    group may end a peer before the launcher's own handler has run."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if stopped():
            return True
        time.sleep(0.02)
    return False


def _drain(stream: IO[str], log_path: Path) -> None:
    """Copy what a launched process writes to stdout into its log, on a thread of its own
    until the process ends: a pipe nobody reads fills at 64 KB, and then the process (a
    plug-in's or a metrics hook's print) blocked for good, and the whole swarm with it."""

    def copy() -> None:
        with log_path.open("a") as log:
            for line in stream:
                log.write(line)
                log.flush()

    threading.Thread(target=copy, name=f"drain {log_path.name}", daemon=True).start()


STOPPED_CODES = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Exit codes of a peer that ended in order: finished, or stopped by a signal."""


def carries_on(config: Config) -> bool:
    """Whether the run goes on when a peer dies: a gossip swarm declares it dead and repairs
    its topology, an asynchronous or FedAvg parameter server drops it; a ring and a
    synchronous server need every member, so the launcher stops them all."""
    return config.mode == "gossip" or (config.mode == "ps" and config.ps in ("async", "fedavg"))


@dataclass(frozen=True)
class Placement:
    """Where a launched peer runs: a command prefix (e.g. ``ip netns exec HOST``) and the
    address it listens on (None: the config's ``host``)."""

    prefix: tuple[str, ...] = ()
    host: str | None = None


class StopOnSignal:
    """While active (in the main thread): SIGINT and SIGTERM set ``signum`` instead of raising
    at whatever line the launcher is on, so a Ctrl-C always ends in an orderly stop.

    ``at_once``: the first of them raises :class:`Interrupted` where the program is instead
    (later ones are ignored), for work whose ``finally`` clauses are its orderly stop, such
    as a download that removes its temporary files: SIGTERM then cleans up as Ctrl-C does,
    rather than killing the process with its files left behind."""

    def __init__(self, *, at_once: bool = False) -> None:
        self.signum: int | None = None
        self.at_once = at_once
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._ask)
        return self

    def _ask(self, signum: int, frame: object) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and self.at_once:
            raise Interrupted(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Swarm:
    """The peer processes of one local run; ``place`` puts peer k on an emulated host.

    Every process it starts (restarts too) is told the swarm's start, as unix time in
    ``RUN_START_ENV``, so all peers' metrics count ``time`` from the same instant.
    """

    def __init__(
        self,
        config: Config,
        run: RunDir,
        place: Callable[[int], Placement] | None = None,
    ) -> None:
        self.config = config
        self.run = run
        self.procs: dict[int, Process] = {}
        self.servers: dict[int, Process] = {}
        self._logs: list[IO[str]] = []
        self._place = place or (lambda rank: Placement())
        self._threads = config.threads or max(1, (os.cpu_count() or 1) // config.processes)
        self._env = {
            **{k: v for k, v in os.environ.items() if k != ADVERTISE_ENV},  # one machine's
            "OMP_NUM_THREADS": str(self._threads),
            "PYTHONUNBUFFERED": "1",
            RUN_START_ENV: f"{time.time():.6f}",
            LAUNCHER_PID_ENV: str(os.getpid()),
        }

    def start(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """Spawn peer 0, learn its address, then spawn the others pointing at it; no more
        once ``stopped`` (a signal asked the launch to stop).

        In ps mode the server shards start first and every worker gets their addresses.
        """
        n = self.config.processes
        listen = f"tcp://{self.config.host}:0"
        servers = None
        if self.config.mode == "ps":
            self.run.server_log(0).parent.mkdir(exist_ok=True)
            for k in range(self.config.ps_shards):
                args = server_args(self.run.config, self.run.root, k, listen)
                self.servers[k] = self._spawn(args, self.run.server_log(k))
            shards = [
                _read_address(
                    p, self.run.server_log(k), self.config.startup_timeout, f"shard {k}", stopped
                )
                for k, p in self.servers.items()
            ]
            if stopped():
                return
            servers = [a for a in shards if a is not None]
        address = None
        for rank in range(n):
            if stopped():
                return
            args = peer_args(
                self.run.config, self.run.root, rank, self._listen(rank), self._threads, address,
                servers,
            )  # fmt: skip
            prefix = self._place(rank).prefix
            self.procs[rank] = proc = self._spawn(args, self.run.log(rank), prefix=prefix)
            if address is None and servers is None:
                timeout = self.config.startup_timeout
                address = _read_address(proc, self.run.log(0), timeout, "peer 0", stopped)
            else:
                assert proc.stdout is not None
                _drain(proc.stdout, self.run.log(rank))

    def _listen(self, rank: int) -> str:
        return f"tcp://{self._place(rank).host or self.config.host}:0"

    def kill(self, rank: int) -> None:
        """kill -9 one peer (fault injection)."""
        self.procs[rank].kill()
        self.procs[rank].wait()

    def restart(self, rank: int) -> None:
        """Start a killed peer again from its checkpoint (``gossipdl peer --resume``)."""
        args = [
            *peer_args(self.run.config, self.run.root, rank, self._listen(rank),
                       self._threads, None),
            "--resume", str(self.run.root),
        ]  # fmt: skip
        self.procs[rank] = proc = self._spawn(
            args, self.run.log(rank), prefix=self._place(rank).prefix, mode="a"
        )
        assert proc.stdout is not None
        _drain(proc.stdout, self.run.log(rank))

    def _spawn(
        self, args: list[str], log_path: Path, prefix: tuple[str, ...] = (), mode: str = "w"
    ) -> Process:
        """``gossipdl ARGS``, stderr into ``log_path``: forked from the fork server, or run
        as ``PREFIX python -m gossipdl ARGS`` on an emulated host (``prefix``)."""
        if not prefix and forking.available():
            return ForkedCommand(args, self._env, log_path, mode)
        log_file = log_path.open(mode)
        self._logs.append(log_file)
        cmd = [*prefix, sys.executable, "-m", "gossipdl", *args]
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log_file, text=True, env=self._env
        )

    def failed(self) -> dict[int, int]:
        """Peers that exited with an error: id -> exit code (not one a signal stopped in
        order, as Ctrl-C does: 130, or 143 for SIGTERM)."""
        codes = {i: p.poll() for i, p in self.procs.items()}
        return {i: code for i, code in codes.items() if code not in (None, *STOPPED_CODES)}

    def servers_failed(self) -> dict[int, int]:
        """Server shards that exited with an error: shard -> exit code. Every worker needs
        every shard, whatever the rule."""
        codes = {k: p.poll() for k, p in self.servers.items()}
        return {k: code for k, code in codes.items() if code is not None and code != 0}

    def running(self) -> bool:
        """Whether any peer process is still alive."""
        return any(p.poll() is None for p in self.procs.values())

    def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """Ask every live peer to stop (SIGINT: finish the step, save, report), then the
        servers, then kill what is left after ``grace`` seconds. Servers go last: a sync ps
        worker finishing its step waits for their answer."""
        deadline = time.monotonic() + grace
        for procs in (list(self.procs.values()), list(self.servers.values())):
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def close(self) -> None:
        """Kill anything left (servers get a moment to see the workers leave) and close the
        log files."""
        for proc in self.servers.values():
            try:
                proc.wait(_SERVER_EXIT_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
        for proc in [*self.procs.values(), *self.servers.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for f in self._logs:
            f.close()


def launch(
    config: Config,
    *,
    progress: bool = True,
    console: Console | None = None,
    until: Callable[[RunDir], bool] | None = None,
) -> dict[str, Any]:
    """Run ``config`` as a local swarm; returns the summary (also in ``summary.json``).

    ``until``, asked about four times a second with the run directory, ends
    the run early when it returns True (e.g. a target accuracy reached, or a
    time budget spent): every peer finishes its step and reports, as on Ctrl-C. A peer
    that dies stops the swarm and raises LaunchError naming it, after the summary is
    written, except where the run ``carries_on`` without it and some peer finished (then
    a warning names it); a server shard that dies always does.
    SIGINT (Ctrl-C) or SIGTERM stops every peer cleanly, writes what was measured, then
    raises :class:`Interrupted` (a KeyboardInterrupt), so a caller running several swarms
    stops too.
    """
    refuse_outside_simulation(config)
    if config.advertise:
        raise ConfigError(
            f"advertise = {config.advertise!r} names one peer's address, and a launch starts "
            f"{config.processes} on this machine; give it to `gossipdl peer` or `join`, one "
            "per machine (here, `host` sets the address peers listen on)"
        )
    forking.warm_up()  # its imports overlap the checks below
    preflight(config)  # first: a run that cannot start leaves no run directory behind
    run, config = fresh_run(config)
    swarm = Swarm(config, run)
    started = time.monotonic()
    ended_early = False
    failed: dict[int, int] = {}
    shards_failed: dict[int, int] = {}
    stop = StopOnSignal()
    targets = last_steps(config) if progress else {}
    display = LiveProgress(run, config.steps, console=console, enabled=progress, targets=targets)
    with stop, display:
        try:
            swarm.start(lambda: stop.signum is not None)
            while swarm.running() and stop.signum is None:
                time.sleep(0.25)
                display.refresh()
                if until is not None and until(run):
                    ended_early = True
                    swarm.stop()
                    break
                shards_failed = swarm.servers_failed()
                if shards_failed:
                    log.error("server shard(s) %s died; stopping the swarm", sorted(shards_failed))
                    swarm.stop()
                    break
                failed = swarm.failed()
                display.dead(failed)
                formed = bool(run.peer_ids())  # a metrics file: training began; before it,
                # the others wait for the dead one until startup_timeout
                if failed and not (carries_on(config) and formed):
                    before = "" if formed else " before the swarm formed"
                    log.error("peer(s) %s died%s; stopping the swarm", sorted(failed), before)
                    swarm.stop()
                    break
        except KeyboardInterrupt:
            stop.signum = stop.signum or signal.SIGINT
        finally:
            if stop.signum is not None:
                swarm.stop()
            display.dead(swarm.failed())  # before the display's last frame
            swarm.close()
    summary = summarize(run, time.monotonic() - started)
    summary_failed = failed or swarm.failed()
    if stop.signum is not None:
        log.warning(
            "interrupted: the swarm was stopped early; %s holds what was measured",
            run.root,
        )
        raise Interrupted(stop.signum)
    if shards_failed:
        raise LaunchError(
            "\n".join(
                f"server shard {k} exited with code {code}; its log {run.server_log(k)} ends:\n"
                f"{_log_tail(run.server_log(k))}"
                for k, code in sorted(shards_failed.items())
            )
        )
    if ended_early:  # peers stopped mid-round may have failed on the way out
        log.info("%s: ended early, as asked", run.root)
    elif summary_failed and carries_on(config) and summary["peers_finished"]:
        log.warning(
            "%s %s died; the others carried on (%d of %d finished)",
            "worker(s)" if config.mode == "ps" else "peer(s)",
            sorted(summary_failed),
            summary["peers_finished"],
            config.processes,
        )
    elif summary_failed:
        details = "\n".join(
            f"peer {i} exited with code {code}; its log {run.log(i)} ends:\n{_log_tail(run.log(i))}"
            for i, code in sorted(summary_failed.items())
        )
        raise LaunchError(details)
    return summary
