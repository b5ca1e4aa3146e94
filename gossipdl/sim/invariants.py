"""What must hold in a gossip swarm whatever goes wrong, checked while a simulation runs.

:class:`WatchedSimulation` is the gossip simulation with a judge: it checks,
during the run and after it, the invariants named in :data:`INVARIANTS`, and
keeps the first violation with the events that led to it (the log lines of the
last moments). The fault search (:mod:`gossipdl.experiments.fault_search`) runs it
on random schedules (:mod:`gossipdl.sim.random_faults`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from gossipdl.averaging.beer import Beer
from gossipdl.averaging.choco import Choco, PublicCopies
from gossipdl.config import Config, tomllib
from gossipdl.protocol.joining import MODEL_WAIT_S
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import Simulation, SimulationError, VirtualPeer
from gossipdl.sim.random_faults import Case

INVARIANTS = {
    "timeouts": "no live peer waits past its round deadline, nor goes without a step longer "
    "than its timeouts allow",
    "agreement": "once the faults heal, the live peers agree on one member table (every live "
    "peer in, every dead one out) and one symmetric topology",
    "choco": "after every CHOCO resync, s_i = W_ii x̂_i + Σ_j W_ij x̂_j, with W the weights the "
    "round used and each x̂_j the neighbour's public copy of that round (BEER: the same for "
    "its model's and its tracker's copies, h and g); a peer that learnt "
    "during the round that its weights were stale asks for another resync",
    "ledger": "every message sent is delivered, dropped with a counted reason, or lost to a "
    "fault the schedule injected",
    "run_dir": "the run directory's files parse, line by line, at every moment",
    "exception": "no exception escapes a peer",
    "finished": "no peer stops on an error, and the run ends",
    "eviction": "no peer is evicted from a swarm where nobody lies: faults, restarts and "
    "loss never make an honest peer's model look like a liar's to most of its neighbours",
}
EVENTS_KEPT = 25  # log lines a violation shows
Mixing = tuple[dict[int, float], float]  # neighbour -> weight, and the self weight
PUBLIC_ROUNDS_KEPT = 32  # rounds of each peer's public copy kept for the CHOCO check
CHOCO_TOLERANCE = 1e-4  # float sums in another order


@dataclass(frozen=True)
class Violation:
    """The first invariant a run broke: which, what exactly, when, and the events before."""

    invariant: str
    detail: str
    at: float  # virtual seconds
    events: tuple[str, ...]


class _Recent(logging.Handler):
    """The simulation's last log lines, with the virtual time they were written at."""

    def __init__(self, simulation: Simulation) -> None:
        super().__init__(logging.DEBUG)
        self.simulation = simulation
        self.lines: deque[tuple[float, logging.LogRecord]] = deque(maxlen=EVENTS_KEPT)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.simulation.clock.now, record))

    def text(self) -> tuple[str, ...]:
        return tuple(f"{at:10.3f}s  {r.levelname:<7} {r.getMessage()}" for at, r in self.lines)


PublicSum = tuple[str, torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor] | None]


def public_sums(averager: object) -> list[PublicSum]:
    """An averager's public copies, each as (name, its own copy, the sum of its neighbours'
    mixed with it, or the neighbours' copies kept apart): CHOCO's x̂ and s, BEER's model and
    tracker copies h, g and their sums s_h, s_g; none for the other averagers."""
    if isinstance(averager, Choco):
        return [("x̂", averager.x_hat, averager.s, averager.copies)]
    if isinstance(averager, Beer):
        models, trackers = averager.models, averager.trackers
        return [
            ("h", averager.h, averager.s_h, None if models is None else models.copies),
            ("g", averager.g, averager.s_g, None if trackers is None else trackers.copies),
        ]
    return []


class WatchedSimulation(Simulation):
    """A gossip simulation of ``case`` that checks :data:`INVARIANTS` as it runs; after
    :meth:`watch` returns, :attr:`violation` holds the first one broken (or None)."""

    def __init__(self, case: Case, config: Config, run: RunDir) -> None:
        super().__init__(config, run, step_time=None)
        self.case = case
        self.violation: Violation | None = None
        self._recent = _Recent(self)
        # peer -> round -> its public copies (CHOCO: x̂; BEER: h, g)
        self._public: dict[int, dict[int, list[torch.Tensor]]] = {}
        # peer -> the weights of the round it has open, and its resyncs asked before it
        self._used: dict[int, tuple[Mixing, int]] = {}
        self._stale: dict[int, int] = {}  # peer -> its resyncs before a round with stale weights
        self._progressed = [0.0] * len(self.peers)  # when each peer last finished a step
        slowest = min([f["clock"]["rate"] for f in config.faults if "clock" in f], default=1.0)
        self.stall_s = (
            config.startup_timeout + 2 * config.round_timeout + MODEL_WAIT_S * config.peers
        ) / slowest + max(p.step_time for p in self.peers)
        self.clock.at(case.settled_at, self._check_agreement)
        self._after_probe()

    # ----------------------------------------------------------------- running
    def watch(self) -> Violation | None:
        """Run the swarm to its end (or its first violation) and check what holds after."""
        gossipdl = logging.getLogger("gossipdl")
        level, propagate = gossipdl.level, gossipdl.propagate
        gossipdl.addHandler(self._recent)
        gossipdl.setLevel(logging.DEBUG)
        gossipdl.propagate = False  # the lines are the violation's to show, not the console's
        try:
            self.run()
        except _Broken:
            pass
        except SimulationError as exc:  # peers left waiting for events that never come
            self._record_violation("finished", str(exc), raise_=False)
        except Exception as exc:  # an invariant of its own: nothing escapes a peer
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._record_violation(
                "exception",
                f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
                raise_=False,
            )
        finally:
            gossipdl.removeHandler(self._recent)
            gossipdl.setLevel(level)
            gossipdl.propagate = propagate
        if self.violation is None:
            self._check_end()
        return self.violation

    def _record_violation(self, invariant: str, detail: str, raise_: bool = True) -> None:
        if self.violation is None:
            self.violation = Violation(invariant, detail, self.clock.now, self._recent.text())
        if raise_:
            raise _Broken

    # ----------------------------------------------------------------- hooks
    def _open_round(self, peer: VirtualPeer) -> None:
        """Keep the public copy each CHOCO peer has once it sent a round's update, and the
        weights the round uses; a peer whose last resync used stale weights asks again."""
        core = peer.core
        index = core.round
        # (recorded first: a round with no one to wait for ends inside ``_open_round``)
        self._used[peer.id] = (core.mixing(index), core.counters.resyncs)
        super()._open_round(peer)
        publics = public_sums(core.averager)
        if publics and all(own is not None for _, own, _, _ in publics):
            kept = self._public.setdefault(peer.id, {})
            kept[index] = [own.clone() for _, own, _, _ in publics if own is not None]
            kept.pop(index - PUBLIC_ROUNDS_KEPT, None)
            resyncs = self._stale.pop(peer.id, None)
            if resyncs is not None and core.counters.resyncs == resyncs:
                self._record_violation(
                    "choco",
                    f"peer {peer.id} resynced at round {index - 1} with weights it then learnt "
                    f"were stale, and asked for no new resync by round {index}",
                )

    def _progress(self, peer: VirtualPeer, progress: Any) -> None:
        averager = peer.core.averager
        ended = peer.core.round - 1  # the poll that made ``progress`` closed it, if it did
        resynced = isinstance(averager, PublicCopies) and averager.resynced == ended
        if progress.model is not None and resynced:
            self._check_public_sums(peer, ended)
        super()._progress(peer, progress)

    def _stepped(self, peer: VirtualPeer) -> None:
        super()._stepped(peer)  # (with overlap, a step ends with the round behind it)
        self._progressed[peer.id] = self.clock.now

    def restart(self, peer_id: int) -> None:
        self._progressed[peer_id] = self.clock.now  # (its last life's copies stay: in flight)
        super().restart(peer_id)
        self._check_run_dir()

    def kill(self, peer_id: int) -> None:
        super().kill(peer_id)
        self._check_run_dir()

    # ----------------------------------------------------------------- checks
    def _live(self) -> list[VirtualPeer]:
        return [p for p in self.peers if not (p.dead or p.done)]

    def _after_probe(self) -> None:
        self.clock.after(self.config.heartbeat / 2, self._probe)

    def _probe(self) -> None:
        """Every half heartbeat: timeouts kept, progress made, messages accounted for."""
        now = self.clock.now
        for peer in self._live():
            core = peer.core
            if core.waiting:
                local = self.local(peer)
                if core.deadline is None or local > core.deadline + 1e-6:
                    self._record_violation(
                        "timeouts",
                        f"peer {peer.id} waits in round {core.round} past its deadline "
                        f"{core.deadline} (its clock reads {local:.3f})",
                    )
            if now - self._progressed[peer.id] > self.stall_s:
                self._record_violation(
                    "timeouts",
                    f"peer {peer.id} made no step for {now - self._progressed[peer.id]:.1f} s "
                    f"(the bound is {self.stall_s:.1f} s; it is at step {peer.steps}, round "
                    f"{core.round}, {'waiting' if core.waiting else 'not waiting'}, "
                    f"{'joining' if peer.join else 'not joining'})",
                )
        if not self.network.balanced():
            self._record_violation("ledger", f"network ledger {dict(self.network.ledger)}")
        for peer in self.peers:  # nobody lies in a fault search's swarm
            if peer.core.counters.evicted:
                self._record_violation(
                    "eviction",
                    f"peer {peer.id} evicted {peer.core.counters.evicted} member(s) of a swarm "
                    "where nobody lies",
                )
        if self.failures:
            peer_id, why = next(iter(self.failures.items()))
            self._record_violation("finished", f"peer {peer_id} stopped: {why}")
        if not self.finished:
            self._after_probe()

    def _check_agreement(self) -> None:
        """Once the faults healed and the swarm had time to settle: one table, every live
        peer in it, every dead or departed one out of it, and a symmetric topology."""
        live = self._live()
        if len(live) < 2 or any(p.done and not p.leaving for p in self.peers):
            return  # a peer finishing its steps changes the tables: nothing to compare
        tables = {p.id: p.core.membership.wire() for p in live}
        first = live[0]
        for peer in live[1:]:
            if tables[peer.id] != tables[first.id]:
                self._record_violation(
                    "agreement",
                    f"{self.case.settle_s:.1f} s after the last fault, peer {first.id}'s "
                    f"table is {tables[first.id]} and peer {peer.id}'s is {tables[peer.id]}",
                )
        live_ids = {p.id for p in live}
        table = first.core.membership
        # a member let in dies before its first round: it is out once that round came
        # (the protocol gives a newcomer until then to show up)
        members = {m.id: m for m in table.members() if m.until is None}
        unborn = {i for i, m in members.items() if m.since > first.core.round}
        in_swarm = set(members) - (unborn - live_ids)
        if in_swarm != live_ids:
            self._record_violation(
                "agreement",
                f"the table has members {sorted(in_swarm)} in the swarm, but the live peers "
                f"are {sorted(live_ids)}",
            )
        future = max(p.core.round for p in live) + 1
        for peer in live:
            for j in peer.core.neighbours(future):
                other = self.peers[j].core
                own = other.membership.get(j)
                if own is not None and own.since > future:
                    continue  # a peer back whose new life starts later: the others count the
                    # rounds of its last life (ended) in their topology, it knows none of them
                if j in live_ids and peer.id not in other.neighbours(future):
                    self._record_violation(
                        "agreement",
                        f"in round {future} peer {peer.id} has neighbour {j}, but {j}'s "
                        f"neighbours are {other.neighbours(future)}",
                    )

    def _check_public_sums(self, peer: VirtualPeer, index: int) -> None:
        """Each sum rebuilt at round ``index`` (CHOCO's s; BEER's s_h, s_g) equals the mix of
        the public copies of that round with the weights the round used (if the peer learnt
        better while it waited, it must resync again); a peer that keeps the copies apart (a
        defence) must hold each one."""
        (weights, self_weight), resyncs = self._used[peer.id]
        if peer.core.mixing(index) != (weights, self_weight):
            self._stale[peer.id] = resyncs  # a resync asked since the round opened fixes it
        for n, (name, own, total, copies) in enumerate(public_sums(peer.core.averager)):
            assert own is not None
            if copies is not None:
                if set(copies) != set(weights):
                    self._record_violation(
                        "choco",
                        f"peer {peer.id} resynced at round {index} with neighbours "
                        f"{sorted(weights)}, but holds copies of {name} of {sorted(copies)}",
                    )
                total = own * self_weight
                for j, weight in weights.items():
                    total = total + weight * copies[j]
            assert total is not None
            expected = own * self_weight
            for j, weight in weights.items():
                copy = self._public.get(j, {}).get(index)
                if copy is None:
                    self._record_violation(
                        "choco",
                        f"peer {peer.id} resynced at round {index} with neighbour {j}, which "
                        "never sent that round's update",
                    )
                    return
                expected = expected + weight * copy[n]
            error = float((total - expected).abs().max())
            if not error <= CHOCO_TOLERANCE:
                self._record_violation(
                    "choco",
                    f"peer {peer.id} resynced at round {index} (neighbours {sorted(weights)}): "
                    f"its sum of {name} is {error:.3g} from W_ii {name}_i + Σ W_ij {name}_j",
                )

    def _check_run_dir(self) -> None:
        """Every file of the run directory parses, every metrics line whole."""
        run = self.run_dir
        try:
            tomllib.loads(run.config.read_text())
            json.loads(run.peers_json.read_text())
            for peer_id in run.peer_ids():
                text = run.metrics(peer_id).read_text()
                if text and not text.endswith("\n"):
                    raise ValueError(f"peers/{peer_id}.jsonl ends in a partial line")
                for n, line in enumerate(text.splitlines(), 1):
                    if not isinstance(json.loads(line), dict):
                        raise ValueError(f"peers/{peer_id}.jsonl line {n} is not an object")
        except (OSError, ValueError) as exc:
            self._record_violation("run_dir", str(exc))

    def _check_end(self) -> None:
        """After the run: no failures, every message accounted for, files whole."""
        if self.failures:
            peer_id, why = next(iter(self.failures.items()))
            self._record_violation("finished", f"peer {peer_id} stopped: {why}", raise_=False)
        elif not self.network.balanced():
            self._record_violation(
                "ledger", f"network ledger {dict(self.network.ledger)}", raise_=False
            )
        else:
            with contextlib.suppress(_Broken):
                self._check_run_dir()
        short = [p.id for p in self.peers if p.steps < self.config.steps]
        short = [i for i in short if not (self.peers[i].dead or self.peers[i].leaving)]
        if short:
            self._record_violation(
                "finished", f"peers {short} are alive but ended short of their steps", raise_=False
            )


class _Broken(Exception):
    """An invariant broke: unwinds the simulation from the event that broke it."""
