"""Run one job on the simulated engine (``gossipdl simulate``): the run directory and summary
``gossipdl run`` writes, from virtual peers on virtual time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gossipdl.config import Config, ConfigError, to_dict
from gossipdl.experiments.launcher import Interrupted, StopOnSignal, fresh_run, preflight
from gossipdl.experiments.summary import summarize
from gossipdl.rundir import RunDir, write_json_atomic
from gossipdl.sim.batched import BatchedSimulation, check_batchable
from gossipdl.sim.engine import Simulation, simulation_for

log = logging.getLogger(__name__)
UNTIL_EVERY_S = 1.0  # how often, in simulated seconds, ``until`` is asked


class _Reached(Exception):
    """``until`` said the run may end: unwinds the simulation from between two events."""


def _ask(simulation: Simulation, run: RunDir, until: Callable[[RunDir], bool]) -> None:
    """Ask ``until`` every ``UNTIL_EVERY_S`` simulated seconds, while other events are queued
    (a swarm left with nothing to happen still ends as stuck)."""

    def probe() -> None:
        if until(run):
            raise _Reached
        if simulation.clock.pending:
            simulation.clock.after(UNTIL_EVERY_S, probe)

    simulation.clock.after(UNTIL_EVERY_S, probe)


def _stop_batched(
    simulation: BatchedSimulation,
    run: RunDir,
    stop: StopOnSignal,
    until: Callable[[RunDir], bool] | None,
) -> Callable[[], bool]:
    """The batched engine's ``should_stop``: a signal came, or ``until`` (asked every
    ``UNTIL_EVERY_S`` simulated seconds) says the run may end."""
    asked = [0.0]

    def should_stop() -> bool:
        if stop.signum is not None:
            return True
        if until is None or simulation.now - asked[0] < UNTIL_EVERY_S:
            return False
        asked[0] = simulation.now
        return until(run)

    return should_stop


def refuse_outside_real(config: Config) -> None:
    """ConfigError for the metrics sinks of a real peer (``csv``, ``tensorboard``,
    ``metrics_hook``): the simulator writes the run directory only, and taking them in
    silence wrote nothing where the user looked."""
    sinks = [k for k in ("csv", "tensorboard", "metrics_hook") if getattr(config, k)]
    if sinks:
        raise ConfigError(
            f"{' and '.join(sinks)}: these feed a real peer's metrics lines; the simulator writes "
            "peers/<id>.jsonl in its run directory only: drop them, or use gossipdl run"
        )


def simulate(
    config: Config,
    *,
    step_time: float | None = None,
    on_progress: Callable[[int, float], None] | None = None,
    until: Callable[[RunDir], bool] | None = None,
) -> dict[str, Any]:
    """Simulate ``config``'s swarm into its run directory and summarise it: the summary of
    ``gossipdl run``, plus ``engine`` "sim" (or "batched"), ``simulated_time_s`` and
    ``host_time_s``.

    ``until``, asked with the run directory every ``UNTIL_EVERY_S`` simulated seconds, ends
    the run early when it returns True (a target accuracy reached, a budget spent, as
    ``launch``'s): the peers stop where they are, without final lines (batched: with final
    lines that say ``stopped_early``)."""
    refuse_outside_real(config)
    preflight(config)  # missing data or an impossible split: a clear error, no run directory
    if config.batched:
        check_batchable(config)  # so is a swarm the batched engine cannot run
    run, config = fresh_run(config)
    started = time.perf_counter()
    torch_threads = torch.get_num_threads()
    # per peer, one thread: the same sums in the same order every run; batched, the
    # machine's (or ``threads``): its products are large enough to share
    torch.set_num_threads(1 if not config.batched else config.threads or torch_threads)
    try:
        with StopOnSignal() as stop:
            simulation: Simulation | BatchedSimulation
            if config.batched:
                batched = simulation = BatchedSimulation(config, run, step_time=step_time)
                simulated = batched.run(on_progress, _stop_batched(batched, run, stop, until))
                ledger, failures = batched.ledger, {}
            else:
                simulation = simulation_for(config.mode)(config, run, step_time=step_time)
                if until is not None:
                    _ask(simulation, run, until)
                try:
                    simulated = simulation.run(on_progress, lambda: stop.signum is not None)
                except _Reached:
                    simulated = simulation.clock.now
                ledger, failures = simulation.network.ledger, simulation.failures
    finally:
        torch.set_num_threads(torch_threads)
    summary = summarize(run)
    summary.update(
        engine="batched" if config.batched else "sim",
        simulated_time_s=round(simulated, 4),
        host_time_s=round(time.perf_counter() - started, 3),
        step_time_s=simulation.measured,
        network=dict(sorted(ledger.items())),
    )
    if failures:  # a ring stops when a member dies; its peers say why
        summary["failed"] = {str(i): why for i, why in sorted(failures.items())}
    summary["config"] = to_dict(config)
    write_json_atomic(run.summary, summary)
    if stop.signum is not None:
        log.warning(
            "interrupted: the simulation stopped early; %s holds what it measured", run.root
        )
        raise Interrupted(stop.signum)
    return summary
