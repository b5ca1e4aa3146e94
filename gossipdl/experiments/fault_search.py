"""The seeded fault search (``gossipdl simulate --faults random --seeds A:B``).

Each seed is one small swarm under one random fault schedule
(:func:`gossipdl.sim.random_faults.random_case`), run on the simulator with the
invariants checked as it goes (:class:`gossipdl.sim.invariants.WatchedSimulation`).
The same seed always runs the same way, so a violation is replayed by running
its seed again; :func:`report` prints what broke, the events before it, and
that command. Seeds run in parallel worker processes (``jobs``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from gossipdl.experiments import forking
from gossipdl.experiments.launcher import fresh_run
from gossipdl.sim.invariants import INVARIANTS, Violation, WatchedSimulation
from gossipdl.sim.random_faults import random_case

SEEDS_EXAMPLE = "0:200"


class SearchError(ValueError):
    """A seed range or job count the search cannot use; the message says the fix."""


@dataclass(frozen=True)
class Outcome:
    """One seed's run: the first invariant it broke (None: all held), its faults, and the
    host seconds it took; a broken seed keeps its run directory."""

    seed: int
    violation: Violation | None
    faults: int
    host_s: float
    run_dir: str
    latency: bool = True  # :func:`random_case`'s


def parse_seeds(text: str) -> range:
    """``"A:B"`` (seeds A to B-1) or ``"N"`` (seed N alone).

    Example:
        >>> parse_seeds("10:13"), parse_seeds("7")
        (range(10, 13), range(7, 8))
    """
    first, colon, last = text.partition(":")
    try:
        seeds = range(int(first), int(last) if colon else int(first) + 1)
    except ValueError:
        seeds = range(0)
    if not seeds or seeds.start < 0:
        raise SearchError(
            f"--seeds {text!r}; give a range A:B of seeds A to B-1 (e.g. {SEEDS_EXAMPLE}) or "
            "one seed N, with 0 <= A < B"
        )
    return seeds


def check_seed(seed: int, root: str, latency: bool = True) -> Outcome:
    """Run seed ``seed``'s case in a run directory under ``root`` and judge it; the
    directory is removed when every invariant held (``latency``: :func:`random_case`'s)."""
    started = time.perf_counter()
    case = random_case(seed, out=str(Path(root) / f"seed-{seed}"), latency=latency)
    run, config = fresh_run(case.config, caution=False)
    violation = WatchedSimulation(case, config, run).watch()
    if violation is None:
        shutil.rmtree(run.root, ignore_errors=True)
    took = time.perf_counter() - started
    return Outcome(seed, violation, len(config.faults), took, config.out, latency)


def _worker_setup() -> None:
    """A search worker: one torch thread (the sums the same every run), quiet logs."""
    torch.set_num_threads(1)
    logging.getLogger("gossipdl").setLevel(logging.CRITICAL)
    logging.getLogger("gossipdl").propagate = False


def _check(args: tuple[int, str]) -> Outcome:
    return check_seed(*args)


def search(
    seeds: Iterable[int],
    root: str,
    jobs: int = 1,
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    stopped: Callable[[], bool] = lambda: False,
) -> list[Outcome]:
    """Run every seed (in ``jobs`` worker processes), calling ``on_outcome`` as each ends;
    returns the outcomes in seed order. Once ``stopped()`` says so (a signal), the seeds
    still running are stopped and their run directories removed: what is left under
    ``root`` is the broken seeds', as after a whole search."""
    if jobs < 1:
        raise SearchError(f"--jobs {jobs}; use 1 or more worker processes")
    work = [(seed, root) for seed in seeds]
    kept = [f"seed-{seed}" for seed, _ in work if (Path(root) / f"seed-{seed}").exists()]
    if kept:  # an earlier search's broken seeds: neither run into nor removed
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        raise SearchError(
            f"{root} already holds {shown} from an earlier search; choose another --out, or "
            "move them away to search these seeds again"
        )
    outcomes = []
    with contextlib.closing(_outcomes(work, jobs)) as running:  # closed: the workers stopped
        for outcome in running:
            on_outcome(outcome)
            outcomes.append(outcome)
            if stopped():
                break
    done = {o.seed for o in outcomes}
    for seed, _ in work:
        if seed not in done:
            shutil.rmtree(Path(root) / f"seed-{seed}", ignore_errors=True)
    return sorted(outcomes, key=lambda o: o.seed)


def _outcomes(work: list[tuple[int, str]], jobs: int) -> Generator[Outcome, None, None]:
    if jobs == 1 or len(work) == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield from map(_check, work)
        finally:
            torch.set_num_threads(threads)
        return
    context = forking.context()  # forked from a server that never ran torch: no thread pools
    with context.Pool(jobs, initializer=_worker_setup) as pool:
        yield from pool.imap_unordered(_check, work, chunksize=4)


def replay_command(seed: int) -> str:
    """The command that runs ``seed`` again, the same way."""
    return f"gossipdl simulate --faults random --seeds {seed}"


def report(outcome: Outcome) -> str:
    """What a broken seed shows: the invariant, the detail, the swarm and its faults, the
    last events, the replay command and the kept run directory."""
    violation = outcome.violation
    assert violation is not None
    c = random_case(outcome.seed, latency=outcome.latency).config
    replay = replay_command(outcome.seed)
    if not outcome.latency:
        replay = f"gossipdl.experiments.fault_search.check_seed({outcome.seed}, DIR, latency=False)"
    faults = "\n".join(f"    {fault}" for fault in c.faults) or "    (none)"
    events = "\n".join(f"    {line}" for line in violation.events) or "    (none logged)"
    return (
        f"seed {outcome.seed} broke {violation.invariant!r} "
        f"({INVARIANTS[violation.invariant]})\n"
        f"  at {violation.at:.3f} s of virtual time: {violation.detail}\n"
        f"  swarm: {c.peers} peers, {c.topology}, {c.algorithm} {c.codec}, trigger {c.trigger}, "
        f"{c.steps} steps, heartbeat {c.heartbeat} s, dead_after {c.dead_after} s, "
        f"round_timeout {c.round_timeout} s, checkpoint_every {c.checkpoint_every}\n"
        f"  devices: {c.profiles}\n"
        f"  faults:\n{faults}\n"
        f"  last events:\n{events}\n"
        f"  replay: {replay}\n"
        f"  run directory: {outcome.run_dir}"
    )


def summary_line(seeds: range, outcomes: list[Outcome], host_s: float) -> str:
    """One line for a seed range: how many swarms and faults, how many broke, how long."""
    broken = sum(o.violation is not None for o in outcomes)
    faults = sum(o.faults for o in outcomes)
    verdict = "no invariant broken" if not broken else f"{broken} broke an invariant"
    return (
        f"seeds {seeds.start}:{seeds.stop}: {len(outcomes)} swarms, {faults:,} fault events, "
        f"{verdict} ({host_s:.1f} s)"
    )
