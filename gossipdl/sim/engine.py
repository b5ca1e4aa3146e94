"""The simulated engine: a config's swarm as virtual peers in one process, on virtual time.

Each virtual peer is the protocol core (:class:`~gossipdl.protocol.core.GossipCore`)
with a real model, optimizer and data shard. Its messages are the real wire
encoder's frames, carried by :class:`~gossipdl.sim.network.SimNetwork` over the
peers' device links; a local step takes the profile's ``step_time`` of virtual
time; with a ``slowdown`` (or without a ``step_time``) the time one step took when
measured on this host times the slowdown, at least ``step_time``, as the real runner
waits. The run directory is the real engine's contract
(``config.toml``, ``peers.json``, ``peers/<id>.jsonl``, ``summary.json``) with
virtual seconds in ``time`` and the total in ``simulated_time_s``: ``report`` and
``sweep`` read it unchanged. The same config and seed give byte-identical metrics
files, apart from fields that name wall-clock time (``unix_time``, ``swarm_start``).
A peer declared dead rejoins when it hears so, and a ``restart`` fault brings a killed
one back; both join through :mod:`gossipdl.sim.joins`.

Mode ``gossip`` runs here; modes ``ring`` (the ring all-reduce baseline) and ``ps`` (the
parameter server) are subclasses in :mod:`gossipdl.sim.ring` and :mod:`gossipdl.sim.ps`,
and :func:`simulation_for` picks the class for the mode;
:func:`gossipdl.experiments.simulated.simulate` runs one job with it.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from gossipdl.averaging import (
    Averager,
    SharedDecodes,
    check_trigger,
    parse_trigger,
)
from gossipdl.averaging.local_optimizer import LocalOptimizer, current_lr, mask_momentum
from gossipdl.conditions import DeviceProfile, Drift, device_of
from gossipdl.config import Config, to_dict
from gossipdl.data import BatchSampler, Dataset, evaluation_inputs
from gossipdl.models.parameters import FlatParameters, parameter_bytes
from gossipdl.protocol.core import GossipCore, Progress, Send, Settings
from gossipdl.protocol.joining import REJOIN_TRIES, late_steps, rejoin_retry
from gossipdl.protocol.membership import Member, MemberTable
from gossipdl.rundir import RunDir
from gossipdl.sim.clock import Scheduler
from gossipdl.sim.faults import GOSSIP_ONLY, Restart, parse_faults, schedule
from gossipdl.sim.joins import (
    Join,
    aligning,
    answered,
    cancel_join,
    dropped,
    start_join,
    yielded,
)
from gossipdl.sim.network import SimNetwork
from gossipdl.training import (
    AWAY_POLL_S,
    averager_of,
    byzantine_of,
    carried_from,
    carry_on,
    dataset_of,
    drift_of,
    drifted,
    evaluation,
    initial_model,
    json_line,
    local_gradients,
    make_optimizer,
    metrics_line,
    own_test,
    peer_sampler,
    save_atomic,
)
from gossipdl.transport.inbox import received_limit
from gossipdl.transport.shaping import MAX_QUEUED_BYTES
from gossipdl.transport.wire import WireError

log = logging.getLogger(__name__)
MEASURED_STEPS = 5  # steps timed on the host when a peer's step depends on it
SIM_MODES = ("gossip", "ring", "ps")
_SIM_HOSTS = 2**17  # addresses in 198.18.0.0/15


class SimulationError(ValueError):
    """A config the simulator cannot run; the message says what to change."""


def sim_address(peer_id: int) -> str:
    """The address a virtual peer has in ``peers.json``: an IP of 198.18.0.0/15, the
    benchmarking range (RFC 2544) no machine on a real network has, counted from the id
    (peer 7: ``tcp://198.18.0.7:5555``; past its 131,072 addresses the port counts on).
    An IP, not a name: the protocol takes only IPs from the wire
    (:mod:`gossipdl.transport.address_syntax`).

    Example:
        >>> sim_address(7), sim_address(300), sim_address(2**17 + 1)
        ('tcp://198.18.0.7:5555', 'tcp://198.18.1.44:5555', 'tcp://198.18.0.1:5556')
    """
    ip = ipaddress.IPv4Address("198.18.0.0") + peer_id % _SIM_HOSTS
    return f"tcp://{ip}:{5555 + peer_id // _SIM_HOSTS}"


def measure_step_time(config: Config, dataset: Dataset) -> float:
    """Seconds one local training step of ``config``'s model and batch takes on this host
    (the fastest of a few, after a warm-up): what a profile's slowdown multiplies."""
    model = initial_model(config, dataset)
    optimizer = make_optimizer(config, model)
    sampler = BatchSampler(
        dataset.x_train, dataset.y_train, config.batch_size, config.seed, pixels=dataset.pixels
    )
    best = float("inf")
    for _ in range(MEASURED_STEPS + 1):
        x, y = sampler.next()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        best = min(best, time.perf_counter() - started)
    return best


@dataclass
class VirtualPeer:
    """One peer of the simulated swarm: its protocol core and what it trains."""

    id: int
    core: GossipCore
    model: torch.nn.Module
    optimizer: LocalOptimizer
    sampler: BatchSampler
    device: DeviceProfile
    step_time: float
    metrics: Any  # the open peers/<id>.jsonl
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    done: bool = False
    dead: bool = False
    finished_at: float = 0.0  # virtual time of its last step
    timer_at: float | None = None  # the round deadline a timer is set for
    started: bool = True  # in the swarm (False while a restarted peer joins it again)
    life: int = 0  # one more at each death: events of an earlier life are ignored
    join: Join | None = None  # a join in progress (sim.joins)
    rejoins: int = 0  # times it was let back in after being dropped
    alone_until: int = -1  # a late start trains alone to this step, its first round's
    first_wait: float = 0.0  # the next round's wait, if longer (its first after a join)
    saved: tuple[int, dict[str, Any], dict[str, Any]] | None = None  # checkpoint: step, states
    drift: Drift | None = None  # the label drift still to come (``drift``)
    y_test: torch.Tensor | None = None  # its test labels once they drifted
    own: torch.Tensor | None = None  # its owners' test samples (a natural split)
    rate: float = 1.0  # how fast its clock runs against true time (a ``clock`` fault)
    clock_mark: tuple[float, float] = (0.0, 0.0)  # (true, local) time when the rate last changed
    leaving: bool = False  # it leaves at its next round, once its messages are out (``leave``)
    behind: bool = False  # overlap: a round runs behind the step being computed
    held: torch.Tensor | None = None  # that round's model, taken at the step's end
    stepped: bool = False  # the step's compute is done; it waits for the round behind it
    stepped_at: float = 0.0  # since when (local time): the wait counts as idle
    # a new life's counters start at 0, as a new process's: its node's counters when it
    # began (and its rejoins), and what it carries on from its last life (resumed)
    life_base: dict[str, Any] = field(default_factory=dict)
    carried: dict[str, Any] = field(default_factory=dict)

    _flat: tuple[torch.nn.Module | None, FlatParameters | None] = (None, None)

    @property
    def flat_params(self) -> FlatParameters:
        """The model's parameters as views of one vector, as a real peer's are (made once
        per model: a restart brings a new one)."""
        model, flat = self._flat
        if model is not self.model or flat is None:
            flat = FlatParameters(list(self.model.parameters()))
            self._flat = (self.model, flat)
        return flat

    @property
    def params(self) -> list[torch.Tensor]:
        """The model's parameters."""
        return self.flat_params.params

    def flat(self) -> torch.Tensor:
        """A copy of the parameters as one vector."""
        return self.flat_params.copy()


def _own(config: Config, dataset: Dataset, peer_id: int) -> torch.Tensor | None:
    """Peer ``peer_id``'s owners' test samples (:func:`~gossipdl.training.own_test`)."""
    own = own_test(config, dataset, peer_id)
    return None if own is None else torch.from_numpy(own)


class Simulation:
    """The swarm of ``config`` (mode ``gossip``) in ``run``, ready to :meth:`run`.

    Another mode's driver (:func:`simulation_for`) is a subclass that overrides the hooks:
    :meth:`_averager` and :meth:`_topology` (what each peer's core runs), ``sentences``
    (whether silence is punished), :meth:`_handler` (a message arrives) and :meth:`_step`
    (a local step ends)."""

    mode = "gossip"
    sentences = True  # a member silent past dead_after is declared dead (GossipCore.tick)
    unsimulated = ""  # why restart, leave and clock faults are refused ("": they run)

    def __init__(self, config: Config, run: RunDir, *, step_time: float | None = None) -> None:
        if config.mode not in SIM_MODES:
            raise SimulationError(
                f"mode {config.mode!r} is not simulated yet; the simulator runs gossip "
                f"(algorithms dense, choco, broadcast, gossip-learning, powergossip, beer), "
                f"ring (ring all-reduce, codecs none, fp16 and powersgd:RANK) and ps "
                f"(parameter server: sync, async, fedavg)"
            )
        if config.mode != self.mode:
            raise SimulationError(
                f"{type(self).__name__} runs mode {self.mode!r}, not {config.mode!r}; "
                f"simulation_for({config.mode!r}) gives the class that does"
            )
        self.config = config
        self.run_dir = run
        self.clock = Scheduler()
        self.network = SimNetwork(self.clock, config.seed, self._max_queued_bytes())
        self.decodes = SharedDecodes()  # a broadcast is decoded once for all its receivers
        self.dataset = dataset_of(config)
        self.x_test = evaluation_inputs(self.dataset)
        self.y_test = torch.as_tensor(self.dataset.y_test)
        self.measured = step_time if step_time is not None else None
        self.swarm_start = round(time.time(), 3)  # wall clock: names when the run began
        self.swarm_id = swarm_id(config)
        self.failures: dict[int, str] = {}  # peer -> why it stopped before its last step
        self.nonces: dict[int, random.Random] = {}  # each peer's stream of request nonces
        self._nodes = {sim_address(i): i for i in range(config.peers)}
        trigger = parse_trigger(config.trigger)
        settings = Settings(
            topology=self._topology(),
            round_timeout=config.round_timeout,
            heartbeat=config.heartbeat,
            dead_after=config.dead_after,
            forget_after=config.forget_after,
            loss=config.loss,
            evict_after=config.evict_after,
            max_message_bytes=int(config.max_message_mb * 2**20),
            seed=config.seed,
        )
        members = [Member(i, sim_address(i), 0) for i in range(config.peers)]
        template = initial_model(config, self.dataset)  # every peer starts from it
        # what a real peer holds read and not handled (a ps shard: every worker's push at
        # once, more than a ps worker's answers need)
        pushes = config.peers if self.mode == "ps" else 1
        model_bytes = parameter_bytes(template.parameters())
        self.network.max_received_bytes = received_limit(None, pushes * model_bytes)
        self.peers: list[VirtualPeer] = []
        for i in range(config.peers):
            model = copy.deepcopy(template)
            averager = self._averager_for(model, i)
            check_trigger(trigger, averager)
            flat = parameters_to_vector(model.parameters()).detach()
            table = MemberTable(members, config.max_members)
            core = GossipCore(
                i, table, averager=averager, trigger=trigger, settings=settings, model=flat
            )
            core.decodes = self.decodes
            core.sync_at_step(config.steps)
            device = device_of(i, config.peers, config.profiles, config.link, config.slowdown)
            sampler = peer_sampler(config, self.dataset, i)
            peer = VirtualPeer(
                i,
                core,
                model,
                make_optimizer(config, model),
                sampler,
                device,
                self._step_time(device),
                metrics=None,
                drift=drift_of(config, i),
                own=_own(config, self.dataset, i),
            )
            self.peers.append(peer)
            self.network.attach(i, self._handler(peer), device.link)
        faults = parse_faults(config.faults, config.peers)
        refused = sorted({f.action for f in faults if isinstance(f, GOSSIP_ONLY)})
        if refused and self.unsimulated:
            verb = "is" if len(refused) == 1 else "are"
            raise SimulationError(
                f"faults: {' and '.join(refused)} {verb} not simulated in mode {self.mode} "
                f"({self.unsimulated})"
            )
        self._restarts = Counter(i for f in faults if isinstance(f, Restart) for i in f.peers)
        schedule(faults, self)  # the config's fault events
        self.template = template

    def _averager(self, peer_id: int | None = None) -> Averager:
        """The averaging rule of one peer's protocol core (a new one per peer): a Byzantine
        peer's (``byzantine`` in its profile) sends attacked models."""
        return averager_of(self.config, byzantine_of(self.config, peer_id), peer_id)

    def _averager_for(self, model: torch.nn.Module, peer_id: int | None = None) -> Averager:
        """:meth:`_averager`, told the shapes of ``model``'s parameters."""
        averager = self._averager(peer_id)
        averager.bind_layout([tuple(p.shape) for p in model.parameters()])
        return averager

    def _max_queued_bytes(self) -> int:
        """Bytes a peer queues per destination before it drops: ``max_queued_mb`` in modes
        gossip and ring (a real ring's chunks go through the peer's transport); a real ps
        worker's transport keeps the default."""
        mb = self.config.max_queued_mb
        return MAX_QUEUED_BYTES if self.mode == "ps" else int(mb * 2**20)

    def _topology(self) -> str:
        """The topology the peers' protocol cores run."""
        return self.config.topology

    def _step_time(self, device: DeviceProfile) -> float:
        """Virtual seconds of one local step on ``device`` (:meth:`DeviceProfile.step_s`)."""
        if device.needs_host and self.measured is None:
            self.measured = measure_step_time(self.config, self.dataset)
            log.info("one local step takes %.2f ms on this host", self.measured * 1e3)
        return device.step_s(self.measured)

    # ----------------------------------------------------------------- events
    def _handler(self, peer: VirtualPeer) -> Callable[[int, list[bytes]], None]:
        def deliver(sender: int, frames: list[bytes]) -> None:
            if peer.dead:
                return
            now = self.local(peer)
            rejoining = peer.core.rejoin_via is not None
            try:
                started = peer.started and not peer.done
                sends = peer.core.receive(now, frames, started, aligning(peer))
            except WireError as exc:
                self.network.stats(peer.id).drop(exc.reason)
                return
            self._send(peer, sends)
            if rejoining and peer.core.rejoin_via is None:  # it yielded to a join
                yielded(self, peer)
            if peer.core.answers:
                answered(self, peer)
            if peer.core.rejoin_via is not None and aligning(peer):
                dropped(self, peer)
            if peer.core.waiting and not peer.done:
                self._progress(peer, peer.core.poll(now, self._online(peer)))

        return deliver

    def _send(self, peer: VirtualPeer, sends: list[Send]) -> None:
        dropped, notes = peer.core.reports()
        for error in dropped:
            self.network.stats(peer.id).drop(error.reason)
        for note in notes:
            log.debug("peer %d at %.3fs: %s", peer.id, self.clock.now, note)
        for send in sends:
            to = self.node_at(send.address) if send.address else send.to
            self.network.send(peer.id, to, send.frames)

    def address(self, peer_id: int) -> str:
        """The address of peer ``peer_id`` (its entry in ``peers.json``)."""
        return sim_address(peer_id)

    def node_at(self, address: str) -> int:
        """The network node an address names (every address here is a virtual peer's)."""
        return self._nodes[address]

    def local(self, peer: VirtualPeer) -> float:
        """The time on the peer's own clock now: true time, unless a ``clock`` fault made it
        run at another rate (what its protocol core is told; its timers run on it)."""
        true, local = peer.clock_mark
        return local + (self.clock.now - true) * peer.rate

    def _true(self, peer: VirtualPeer, local: float) -> float:
        """The true time at which the peer's clock will read ``local`` (not before now)."""
        true, mark = peer.clock_mark
        return max(self.clock.now, true + (local - mark) / peer.rate)

    def _online(self, peer: VirtualPeer) -> bool:
        """Whether the peer waits for its neighbours: not while away, nor while it must
        rejoin (the real ``Peer._away``)."""
        return self.network.online(peer.id) and peer.core.rejoin_via is None

    def _progress(self, peer: VirtualPeer, progress: Progress) -> None:
        """Carry out a poll's answer: send, and once the round is over take its model (a
        round behind the next step's compute: hold it for that step's end)."""
        self._send(peer, progress.sends)
        if progress.model is not None and peer.behind:
            peer.held = progress.model
            if peer.stepped:
                peer.stepped = False
                peer.core.counters.idle_s += self.local(peer) - peer.stepped_at
                self._stepped(peer)
        elif progress.model is not None:
            peer.flat_params.load_(progress.model)
            self._after_round(peer)
        elif peer.core.deadline is not None and peer.core.deadline != peer.timer_at:
            deadline = peer.timer_at = peer.core.deadline  # one timer per wait, not per message
            due = self._true(peer, deadline)
            self.clock.at(due, lambda: self._timeout(peer, deadline))
            away = self.network.next_offline(peer.id)
            if away < due:  # it waits for nobody once away (``Peer._away``): the round ends
                self.clock.at(away, lambda: self._timeout(peer, deadline, due=False))

    def _after(self, peer: VirtualPeer, delay: float, event: Callable[[VirtualPeer], None]) -> None:
        """``event(peer)`` in ``delay`` virtual seconds, unless the peer died meanwhile: what
        one life scheduled never runs in the next (a restart starts its own)."""
        life = peer.life
        self.clock.after(delay, lambda: event(peer) if peer.life == life else None)

    def _timeout(self, peer: VirtualPeer, deadline: float, due: bool = True) -> None:
        """The wait up to ``deadline`` is over if it is still open: timed out (``due``), or
        the peer went offline before."""
        if peer.core.waiting and peer.core.deadline == deadline and not (peer.dead or peer.done):
            now = self.local(peer)  # a slow clock's reading may round below the deadline
            now = max(now, deadline) if due else now
            self._progress(peer, peer.core.poll(now, self._online(peer)))

    def _tick(self, peer: VirtualPeer) -> None:
        """Heartbeats and death sentences every half heartbeat, while the peer runs (once let
        in: a member's silence is judged as much while we wait for a model as after)."""
        if peer.done or peer.dead:
            return
        online = self.network.online(peer.id)
        sentence = self.sentences and (peer.started or aligning(peer))
        tick = peer.core.tick(self.local(peer), online, sentence)
        for j, silent, until in tick.dead:
            log.debug(
                "peer %d at %.3fs: peer %d silent %.2f s, declared dead (out from round %d)",
                peer.id, self.clock.now, j, silent, until,
            )  # fmt: skip
        self._send(peer, tick.sends)
        self._after(peer, self.config.heartbeat / 2 / peer.rate, self._tick)

    def _computed(self, peer: VirtualPeer) -> bool:
        """One local step's compute ends now: its gradients (the optimizer has not stepped
        yet). False if the peer is dead, or away (churn: it looks again a moment later)."""
        if peer.dead or peer.done:
            return False
        if not self.network.online(peer.id):  # away: no steps, no traffic
            self._record(peer)
            self._after(peer, AWAY_POLL_S, self._step)
            return False
        self._follow_drift(peer)
        loss = local_gradients(self.config, peer.model, peer.optimizer, peer.sampler, peer.steps)
        peer.losses.append(loss.item())
        return True

    def _follow_drift(self, peer: VirtualPeer) -> None:
        """Permute the peer's labels once, at the drift step; a life that starts past it
        (restarted, a late joiner) at once, before its first line is evaluated on the old
        labels (as the real runner does)."""
        if peer.drift is not None and peer.steps >= peer.drift.step:
            peer.y_test = drifted(self.config, self.dataset, peer.sampler, self.y_test)
            peer.drift = None

    def _step(self, peer: VirtualPeer) -> None:
        """One local step's compute ends now; the step ends too unless the round behind it
        (``overlap``) is still open, then it ends with that round."""
        if not self._computed(peer):
            return
        if peer.behind and peer.held is None:
            peer.stepped, peer.stepped_at = True, self.local(peer)
            return
        self._stepped(peer)

    def _stepped(self, peer: VirtualPeer) -> None:
        """The step ends: the round behind it merged in (``Peer.settle``), the optimizer step
        with the gradients computed before, then a round if the trigger says."""
        if peer.held is not None:
            peer.flat_params.load_(peer.held)
        peer.behind, peer.held = False, None
        peer.optimizer.step()
        peer.steps += 1
        peer.core.age += 1  # gossip learning's walking model is a step older (``Peer.step``)
        if not peer.core.trigger.ends_round(peer.steps):
            self._after_round(peer)
        elif peer.core.rejoin_via is not None:  # a member says we were dropped
            self._rejoin(peer)
        else:
            self._round_or_alone(peer)

    def _round_or_alone(self, peer: VirtualPeer) -> None:
        """The step's round; for a peer let in late, short of its first round, the next step
        alone instead (``Peer._round_due``)."""
        if peer.steps <= peer.alone_until:
            self._after_round(peer)
        else:
            self._open_round(peer)

    def _open_round(self, peer: VirtualPeer) -> None:
        """The local steps of a round are done: send what the round sends, then wait."""
        averager = peer.core.averager
        flat = (  # with overlap the next step trains beside the round
            peer.flat()
            if self.config.overlap
            else peer.flat_params.round_input(averager.sends_memory_of)
        )
        wait, peer.first_wait = peer.first_wait or None, 0.0
        now = self.local(peer)
        self._send(peer, peer.core.open_round(now, flat, wait, current_lr(peer.optimizer)))
        mask_momentum(peer.optimizer, peer.params, averager.sent_mask())
        if peer.leaving:  # a graceful leave during the round's sync
            self._finish(peer)
            return
        peer.behind = peer.core.behind = self.config.overlap and not self._settles(peer)
        if peer.behind:  # the next compute starts now
            self._after_round(peer)
        self._progress(peer, peer.core.poll(now, self._online(peer)))

    def _settles(self, peer: VirtualPeer) -> bool:
        """Whether the step just taken waits for its round even with ``overlap``: the real
        runner settles before it evaluates, checkpoints or ends."""
        steps, config = peer.steps, self.config
        evaluates = config.eval_every and steps % config.eval_every == 0
        saves = config.checkpoint_every and steps % config.checkpoint_every == 0
        return bool(steps >= config.steps or evaluates or saves)

    # ----------------------------------------------------------------- joins
    def welcomed(self, peer: VirtualPeer) -> None:
        """A member let the peer in: a restarted one has an id again and starts its
        heartbeats (the real watch thread does once the peer has an id)."""
        if not peer.started:
            self._after(peer, self.config.heartbeat / 2 / peer.rate, self._tick)

    def _stop(self, peer: VirtualPeer, why: str) -> None:
        """The peer stops on an error, as a real one exits: named in ``failures``."""
        log.error("%s", why)
        self.failures[peer.id] = why
        self.kill(peer.id)

    def _rejoin(self, peer: VirtualPeer) -> None:
        """Back into the swarm through the member that said we were dropped (``Peer._rejoin``),
        keeping our model; then the round, whether or not it let us in."""
        core = peer.core
        assert core.rejoin_via is not None
        core.sent_round = -1  # our heartbeats no longer vouch for rounds counted anew

        def then() -> None:  # the welcome ended the rejoin; a table since may ask another
            self._round_or_alone(peer)

        def failed(why: str, welcomed: bool) -> None:
            if welcomed:  # in the new table, but never aligned: the real peer stops too
                self._stop(peer, why)
                return
            log.warning("peer %d could not rejoin: %s", peer.id, why)
            core.rejoin_failed(self.local(peer))
            then()

        via = [m.id for m in core.rejoin_order()]
        timeout = self.config.round_timeout  # shared by the members asked, as Peer._join does
        start_join(
            self,
            peer,
            via,
            rejoin=True,
            take_model=False,
            timeout=timeout,
            then=then,
            fail=failed,
            every=rejoin_retry(timeout, len(via)),
            each=REJOIN_TRIES,  # as Peer._join: one member a while, then the next
        )

    def start_late(
        self,
        peer: VirtualPeer,
        start: int,
        model: torch.Tensor | None,
        swarm_round: int | None = None,
    ) -> None:
        """Start at round ``start`` of the running swarm (``Peer._start_late``): a newcomer
        with ``model`` (its neighbour's), a peer back with its own; ``swarm_round``: the
        round the neighbour that answered was at (None if nobody did)."""
        if model is not None:
            peer.flat_params.load_(model)
        peer.steps, peer.alone_until = late_steps(
            peer.steps,
            model is not None,
            peer.started,
            start,
            swarm_round,
            peer.core.trigger.period,
        )
        peer.core.start_at(start, peer.flat(), model is not None, swarm_round)
        if model is not None:
            peer.core.age = peer.steps
        peer.first_wait = self.config.startup_timeout  # the swarm gets there in its own time
        if peer.started:  # back after being dropped (``Peer._start_again``)
            peer.rejoins += 1
        peer.started = True

    def _after_round(self, peer: VirtualPeer) -> None:
        """The checkpoint and metrics due at this step, then the next step (or the end). The
        checkpoint holds the model after the step's round, as the real runner saves it."""
        config = self.config
        if config.checkpoint_every and peer.steps % config.checkpoint_every == 0:
            peer.saved = (peer.steps, *_states(peer))
        if peer.steps >= config.steps:
            self._finish(peer)
            return
        due = config.eval_every and peer.steps % config.eval_every == 0
        if due:
            self._record(peer, **self._evaluation(peer))
        elif peer.steps % config.log_every == 0:
            self._record(peer)
        self._after(peer, peer.step_time, self._step)

    def _finish(self, peer: VirtualPeer) -> None:
        """The final line, the model file, then the peer leaves (:meth:`_leave`)."""
        evaluated = self._evaluation(peer)
        save_atomic(peer.model.state_dict(), self.run_dir.model(peer.id))
        self._record(
            peer,
            **evaluated,
            final=True,
            stopped_early=peer.steps < self.config.steps,
            device="sim",
        )
        peer.done, peer.finished_at = True, self.clock.now
        self._leave(peer)

    def _leave(self, peer: VirtualPeer) -> None:
        """A finished peer says goodbye to every member (``Peer.close``)."""
        self._send(peer, peer.core.leave())

    def _evaluation(self, peer: VirtualPeer) -> dict[str, float]:
        """The peer's model on the held-out set (``accuracy``, ``test_loss``)."""
        y_test = self.y_test if peer.y_test is None else peer.y_test
        return evaluation(peer.model, self.x_test, y_test, peer.own)

    def _record(self, peer: VirtualPeer, **extra: Any) -> None:
        """One metrics line, with the real runner's keys."""
        now = self.clock.now
        net, base = self.network.stats(peer.id).snapshot(), peer.life_base
        stats = {
            **{k: v - base.get(k, 0) for k, v in net.items() if k != "messages_dropped"},
            "messages_dropped": Counter(net["messages_dropped"])
            - Counter(base.get("messages_dropped", {})),
            **peer.core.metrics(),
            "rejoins": peer.rejoins - base.get("rejoins", 0),
            "online": self.network.online(peer.id),
            "sockets": len(peer.core.membership.in_swarm()) - 1,
        }
        stats = carry_on(stats, peer.carried)
        line = metrics_line(
            peer.id, peer.steps, now, self.swarm_start + now, peer.losses, stats, extra
        )
        peer.metrics.write(json_line(line))
        peer.losses.clear()

    # ----------------------------------------------------------------- faults
    def set_rate(self, peer_id: int, rate: float) -> None:
        """Peer ``peer_id``'s clock runs at ``rate`` times true time from now (1: right
        again): its heartbeats, round timeouts and death sentences come later (or sooner)."""
        peer = self.peers[peer_id]
        peer.clock_mark = (self.clock.now, self.local(peer))
        peer.rate = rate
        if peer.timer_at is not None and peer.core.waiting:  # the open wait's timer moves
            deadline = peer.timer_at
            self.clock.at(self._true(peer, deadline), lambda: self._timeout(peer, deadline))

    def leave(self, peer_id: int) -> None:
        """Peer ``peer_id`` stops gracefully at its next round, once the round's messages are
        out (a leave during a sync): its final line, its model, goodbye to every member."""
        peer = self.peers[peer_id]
        if not (peer.dead or peer.done):
            peer.leaving = True

    def kill(self, peer_id: int) -> None:
        """Peer ``peer_id`` dies now (kill -9): no more steps, messages, heartbeats; what is
        on its way to it is dropped as ``dead``."""
        peer = self.peers[peer_id]
        peer.dead, peer.finished_at = True, self.clock.now
        peer.life += 1  # what this life scheduled stays undone
        cancel_join(peer)
        self.network.kill(peer_id)

    def restart(self, peer_id: int) -> None:
        """Peer ``peer_id``, killed before, starts again now: from its last checkpoint
        (``checkpoint_every``) as ``gossipdl peer --resume`` does, rejoining with that
        model; without one as a newcomer that gets its old id back (on the same address)
        and takes a neighbour's model."""
        peer = self.peers[peer_id]
        self._restarts[peer_id] -= 1
        if not peer.dead or peer.done:
            log.warning("restart of peer %d at %.3fs: it is not dead", peer_id, self.clock.now)
            return
        down_since = peer.finished_at
        model = copy.deepcopy(self.template)
        optimizer = make_optimizer(self.config, model)
        resumed = peer.saved is not None
        if peer.saved is not None:
            steps, weights, state = peer.saved
            model.load_state_dict(weights)
            optimizer.load_state_dict(state)
        else:
            steps = 0
        net = self.network.stats(peer_id).snapshot()
        peer.life_base = {**net, "rejoins": peer.rejoins}
        peer.carried = carried_from(self.run_dir.last_record(peer_id)) if resumed else {}
        old = peer.core
        flat = parameters_to_vector(model.parameters()).detach()
        peer.core = GossipCore(
            -1,
            MemberTable([], old.membership.limit),
            averager=self._averager_for(model, peer_id),
            trigger=old.trigger,
            settings=old.settings,
            model=flat,
            stream=peer_id,
        )
        peer.core.sync_at_step(self.config.steps)
        peer.core.decodes = self.decodes
        peer.model, peer.optimizer, peer.steps = model, optimizer, steps
        peer.core.age = steps
        peer.sampler = peer_sampler(self.config, self.dataset, peer_id, steps)
        peer.drift, peer.y_test = drift_of(self.config, peer_id), None  # a new process's
        peer.dead, peer.started, peer.timer_at, peer.losses = False, False, None, []
        peer.behind, peer.held, peer.stepped, peer.alone_until = False, None, False, -1
        self.network.revive(peer_id)
        self._follow_drift(peer)
        self._record(
            peer,
            **self._evaluation(peer),
            start=True,
            swarm=self.swarm_id,
            swarm_start=self.swarm_start,
            resumed=resumed,
            down_s=round(self.clock.now - down_since, 3),
        )
        via = [p.id for p in self.peers if p.id != peer_id and not (p.dead or p.done)]

        def then() -> None:
            self._after(peer, peer.step_time, self._step)

        def failed(why: str, welcomed: bool) -> None:
            self._stop(peer, why)

        if not via:
            self._stop(peer, f"peer {peer_id}: restarted with no live member to join through")
            return
        start_join(
            self,
            peer,
            via,
            rejoin=True,  # a new life, not a join sent again (the same address either way)
            take_model=not resumed,
            timeout=self.config.startup_timeout,
            then=then,
            fail=failed,
        )

    # ----------------------------------------------------------------- the run
    def run(
        self,
        on_progress: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> float:
        """Run every peer to ``steps`` (or until ``should_stop()``); returns the simulated
        seconds it took. ``on_progress(steps done by all peers, simulated time)`` is called
        as it goes."""
        config = self.config
        self.run_dir.write_members((p.id, sim_address(p.id)) for p in self.peers)
        try:
            for peer in self.peers:
                peer.metrics = self.run_dir.metrics(peer.id).open("w", buffering=1)
                self._follow_drift(peer)
                self._record(
                    peer,
                    **self._evaluation(peer),
                    start=True,
                    swarm=self.swarm_id,
                    swarm_start=self.swarm_start,
                )
                self.network.start_link(peer.id)
                self._after(peer, peer.step_time, self._step)
                self._after(peer, config.heartbeat / 2 / peer.rate, self._tick)
            while not self.finished and not should_stop():
                if self.clock.run(max_events=2000) == 0:
                    stuck = [p.id for p in self.peers if not self._over(p)]
                    raise SimulationError(f"peers {stuck} wait for events that never come")
                if on_progress is not None:
                    on_progress(sum(p.steps for p in self.peers), self.clock.now)
        finally:
            for peer in self.peers:
                if peer.metrics is not None:
                    peer.metrics.close()
        return max(p.finished_at for p in self.peers) if self.finished else self.clock.now

    @property
    def finished(self) -> bool:
        """Whether every peer ran to its last step (or died, with no restart to come)."""
        return all(self._over(p) for p in self.peers)

    def _over(self, peer: VirtualPeer) -> bool:
        return peer.done or (peer.dead and self._restarts[peer.id] <= 0)


def swarm_id(config: Config) -> str:
    """A simulated swarm's id: a hash of its config but for where it writes (a run is a
    function of its config). Not seed and size alone: ``report`` merges the directories
    that share an id, and a sweep's variants often share both."""
    values = {k: v for k, v in to_dict(config).items() if k != "out"}
    return hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()[:16]


def _states(peer: VirtualPeer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of the peer's model and optimizer states (an in-memory checkpoint)."""
    model = {k: v.detach().clone() for k, v in peer.model.state_dict().items()}
    return model, copy.deepcopy(peer.optimizer.state_dict())


def simulation_for(mode: str) -> type[Simulation]:
    """The simulation class that runs ``mode`` (one of ``SIM_MODES``)."""
    from gossipdl.sim.ps import PsSimulation  # they build on this module
    from gossipdl.sim.ring import RingSimulation

    classes: dict[str, type[Simulation]] = {
        "gossip": Simulation,
        "ring": RingSimulation,
        "ps": PsSimulation,
    }
    return classes.get(mode, Simulation)  # Simulation refuses a mode it cannot run
