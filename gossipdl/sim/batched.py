"""The batched simulator: a swarm of peers that share one model as one computation.

The event-driven engine (:mod:`gossipdl.sim.engine`) runs each peer's protocol core and
model on its own: exact for faults and churn, but N times the interpreter's overhead per
step. Here, for the common experiment (mode ``gossip``, dense gossip or CHOCO with top-k,
a static topology, every peer on the same clock, no faults), the swarm is
:class:`~gossipdl.sim.stacked.StackedModels`: every local step is one batched
forward/backward and one optimizer update for all peers, every round one sparse matrix
product over the stacked parameters (for CHOCO, each peer's k values added into its
neighbours' rows). It is the same synchronous algorithm the cores run when no message
is late, so results equal the per-peer engine's up to float reordering. All of it runs
on the config's ``device`` (``auto``: a GPU where there is one).

Dense gossip and CHOCO with a defence or Byzantine peers (issue 26) run here too: the
training stays stacked, and every round each peer's own averaging rule (the per-peer
engine's :class:`~gossipdl.averaging.DenseGossip`, :class:`~gossipdl.averaging.Choco`
or their Byzantine forms in :mod:`gossipdl.averaging.byzantine`) sends, attacks and
judges, one peer after another; CHOCO's first round is a vouch for the model every peer
starts from, as the protocol core sends it. A message that is not finite stops the run (a
receiver would drop it, ``non_finite``, which only the per-peer engine models).

A heterogeneous swarm (``profiles`` with their own ``step_time`` or links, ``slowdown``)
runs here too: each peer keeps its own virtual clock, and a round ends for a peer when the
last of its neighbours' messages is in. Rounds are synchronous, so when a step happens in
virtual time changes no peer's computation: every peer's k-th step still runs in one
batch with the others' (a fast peer waits for its slow neighbours, as the per-peer
engine's do, and the time it waits is its ``idle_s``). A wait past ``round_timeout``
would be a missed neighbour in the per-peer engine; the batched one stops there and says so.

Every peer draws its batches from the same :class:`~gossipdl.data.IndexStream` the
per-peer engine gives it (the data set is held once), and every message it would send
is counted from its payload's layout (each array's dtype and length, its meta: for
top-k, Golomb's parameter and stream lengths of every row at once) with the real wire
encoder's header, so each one's bytes are those of a real swarm without building the
payloads (messages a fault-free run also sends, heartbeats and goodbyes, are not
simulated and not counted). Time is virtual: a local step takes the peer's ``step_time``,
and a message arrives after its sender's copies to every neighbour in turn on the
sender's uplink, the sender's latency and the receiver's downlink, each link carrying
one message at a time as the per-peer engine's do (:meth:`BatchedSimulation._queued_arrivals`).
The run directory is the per-peer engine's contract.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from gossipdl.averaging import Averager, auto_gamma, parse_trigger
from gossipdl.averaging.attacks import Attack, flip_labels
from gossipdl.averaging.base import (
    VOUCH,
    Arrival,
    Round,
    SharedDecodes,
    codec_seed,
    model_digest,
)
from gossipdl.averaging.choco import WARMUP_ROUNDS, check_choco_codec
from gossipdl.compression import Codec, build_codec
from gossipdl.compression.base import Layout, Payload
from gossipdl.compression.floating import Identity
from gossipdl.compression.quantization import QSGD, Sign
from gossipdl.compression.sparse import SparseCodec, Threshold, TopK
from gossipdl.conditions import DeviceProfile, device_of
from gossipdl.config import Config, resolved
from gossipdl.data import (
    IndexStream,
    augment_draws,
    crop_flip,
    evaluation_inputs,
    standardise,
    to_tensors,
)
from gossipdl.peers.device import pick_device
from gossipdl.protocol.core import addressed
from gossipdl.protocol.kinds import COMPRESSED_KINDS, TABLE, TABLE_KINDS
from gossipdl.protocol.membership import Member, MemberTable
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import SimulationError, measure_step_time, sim_address, swarm_id
from gossipdl.sim.stacked import StackedModels, StackedSGD, unstackable
from gossipdl.topologies import Topology, build_topology
from gossipdl.training import (
    attacks_of,
    averager_of,
    dataset_of,
    initial_model,
    json_line,
    lr_at,
    metrics_line,
    own_test,
    parts_of,
    sampler_seed,
    save_atomic,
)
from gossipdl.transport.stats import TransportStats
from gossipdl.transport.wire import all_finite, message_size

log = logging.getLogger(__name__)
BATCHED_ALGORITHMS = ("dense", "choco")


def check_batchable(
    config: Config, topology: Topology | None = None, template: nn.Module | None = None
) -> None:
    """SimulationError, naming what to change, for a config the batched engine cannot run
    (the per-peer engine, ``batched = false``, runs every simulated config); ``topology``
    and ``template`` (the initial model): the config's, where the caller built them already."""
    config = resolved(config)  # the algorithm ``auto`` stands for
    problems = []
    if config.mode != "gossip":
        problems.append(f"mode {config.mode!r} (batched runs mode gossip)")
    if config.algorithm not in BATCHED_ALGORITHMS:
        problems.append(f"algorithm {config.algorithm!r} (batched runs dense and choco)")
    elif config.algorithm == "choco" and not _batchable(build_codec(config.codec)):
        problems.append(
            f"codec {config.codec!r} (batched CHOCO runs topk:RATIO[+sign|+qsgd:LEVELS], "
            "threshold:TAU|auto, sign[:BLOCK] and qsgd:LEVELS, with any index coder; "
            "not qsgd's trits coding)"
        )
    elif config.algorithm == "dense" and config.codec != "none":
        problems.append(f"codec {config.codec!r} (batched dense gossip sends models uncompressed)")
    if parse_trigger(config.trigger).dynamic:
        problems.append(f"trigger {config.trigger!r} (batched runs always and periodic:H)")
    devices = devices_of(config)
    if config.optimizer != "sgd":
        problems.append(f"optimizer {config.optimizer!r} (batched steps sgd)")
    for name in ("drift", "faults"):
        if getattr(config, name):
            problems.append(f"{name} (batched peers learn one task and nothing fails)")
    if config.loss:
        problems.append("loss (batched loses no message)")
    if config.evict_after:
        problems.append("evict_after (batched peers keep one graph: nobody leaves)")
    if config.overlap:
        problems.append("overlap (batched peers take each round before the next step)")
    links = [device.link for device in devices]
    if any(link.jitter_s or link.loss or link.offline for link in links):
        problems.append("a link with jitter, loss or offline windows")
    if topology is None:
        topology = build_topology(config.topology, config.peers, config.seed)
    if not topology.is_static:
        problems.append(f"topology {config.topology!r} (batched needs a static one)")
    if template is None:
        template = initial_model(config, dataset_of(config))
    model = unstackable(template)
    if model is not None:
        problems.append(f"model {config.model!r} (it {model})")
    if problems:
        raise SimulationError(
            "the batched simulator cannot run this config: "
            + "; ".join(problems)
            + ". Set batched = false (the per-peer simulator runs it)"
        )


def devices_of(config: Config) -> list[DeviceProfile]:
    """Every peer's device: its profile, or the swarm-wide link and slowdown."""
    return [
        device_of(i, config.peers, config.profiles, config.link, config.slowdown)
        for i in range(config.peers)
    ]


def _batchable(codec: Codec) -> bool:
    """Whether batched CHOCO runs ``codec``: top-k with its values as they are, signed or
    QSGD-rounded, threshold with its values as they are (either with any index coder), or
    the sign or QSGD of the whole model; not a coding whose size depends on its codes
    (``qsgd:LEVELS:trits``): batched peers count their messages without encoding them."""
    if isinstance(codec, SparseCodec):
        if isinstance(codec.sparsifier, TopK):
            values = codec.values
            return isinstance(values, (Identity, *ROW_CODECS)) and values.fixed_layout
        return isinstance(codec.sparsifier, Threshold) and isinstance(codec.values, Identity)
    return isinstance(codec, ROW_CODECS) and codec.fixed_layout


def _draws(codec: Codec) -> bool:
    """Whether a batched codec draws random numbers: QSGD's rounding (of the whole model or
    of top-k's values) or an automatic threshold's sample."""
    if isinstance(codec, SparseCodec):
        sparsifier = codec.sparsifier
        return isinstance(codec.values, QSGD) or (
            isinstance(sparsifier, Threshold) and sparsifier.tau is None
        )
    return isinstance(codec, QSGD)


def _rounding(codec: Codec) -> Sign | QSGD:
    """The stage that rounds a row: the codec itself, or a sparse codec's values' codec."""
    stage = codec.values if isinstance(codec, SparseCodec) else codec
    assert isinstance(stage, ROW_CODECS)
    return stage


def _threshold(codec: Codec) -> Threshold:
    """A sparse codec's threshold sparsifier (batched CHOCO's other sparsifier)."""
    assert isinstance(codec, SparseCodec) and isinstance(codec.sparsifier, Threshold)
    return codec.sparsifier


def _diverged(peer: int, index: int) -> SimulationError:
    """The error that stops a batched run whose peer ``peer`` sent a non-finite message."""
    return SimulationError(
        f"peer {peer}'s message of round {index} holds NaN or Inf (the swarm diverged): "
        "the per-peer simulator models its neighbours dropping it (non_finite). Set "
        "batched = false, or lower lr"
    )


def _check_finite(values: torch.Tensor, index: int, rows: SparseRows | None = None) -> None:
    """SimulationError naming the first peer whose message (``values``: a row per peer, or
    the entries of sparse ``rows``) is not finite: a receiver would drop it, which the
    batched engine does not model."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    if rows is not None:
        raise _diverged(int(rows.peer[bad.nonzero()[0, 0]]), index)
    raise _diverged(int(bad.any(dim=1).nonzero()[0, 0]), index)


def _payloads(sent: Payload | Mapping[int, Payload]) -> list[Payload]:
    """Every payload of one ``outgoing``: the one for all, or each neighbour's own."""
    return list(sent.values()) if isinstance(sent, Mapping) else [sent]


ROW_CODECS = (Sign, QSGD)
"""Value codecs that quantize every peer's row at once (``estimate_rows``)."""


@dataclass
class Messages:
    """What every peer sent in one round: its message's kind and one payload layout per
    peer (each neighbour gets the same message)."""

    kind: str
    layouts: list[Layout]


@dataclass
class SparseRows:
    """Every peer's kept entries, by peer and then by index: ``peer``, ``index`` and the
    receiver's ``value`` of each, and where each peer's entries start (``count + 1``)."""

    peer: torch.Tensor
    index: torch.Tensor
    value: torch.Tensor
    starts: torch.Tensor


class StackedGossip:
    """The averaging round of every peer at once: dense gossip (``X ← W X``) or CHOCO
    (Koloskova et al. 2019, the per-peer :class:`~gossipdl.averaging.Choco`'s steps on the
    rows of ``X``: ``Q = C(X − X̂)``, ``X̂ += Q``, ``S += W Q``, ``X += γ(S − X̂)``, with its
    automatic γ, warm-up and the 1/(1+ω) of an unbiased codec). For a sparsifier, ``W Q``
    adds each peer's kept values into its neighbours' rows of ``S``: its cost grows with
    the edges times the entries kept, not with the model.

    Each peer's codec draws its own random numbers (QSGD's rounding, an automatic
    threshold's sample), as the per-peer engine's do (:func:`~gossipdl.averaging.base.
    codec_seed`): those rows are encoded one by one, by the peer's own codec."""

    def __init__(
        self,
        config: Config,
        mixing: np.ndarray,
        start: torch.Tensor,
        attacks: Mapping[int, Attack] | None = None,
    ) -> None:
        self.algorithm = config.algorithm
        self.codec = build_codec(config.codec, config.seed)
        count, numel = mixing.shape[0], start.numel()
        self.own: list[Codec] | None = None  # each peer's codec, where codecs draw
        if _draws(self.codec):
            self.own = [build_codec(config.codec, codec_seed(config.seed, i)) for i in range(count)]
        device = start.device
        rows, cols = np.nonzero(mixing)  # row-major: a CSR's order
        weights = torch.tensor(mixing[rows, cols], dtype=torch.float32, device=device)
        self.rows = torch.from_numpy(rows).to(device)
        self.cols = torch.from_numpy(cols).to(device)
        self.weights = weights
        starts = np.searchsorted(rows, np.arange(count + 1))
        with warnings.catch_warnings():  # "sparse CSR support is in beta": it is used alone
            warnings.simplefilter("ignore", UserWarning)
            self.w = torch.sparse_csr_tensor(
                torch.from_numpy(starts).to(device), self.cols, weights, (count, count)
            )
        self.gamma = None
        self.digest = ""
        self.rules: list[Averager] = []  # each peer's own, with a defence or liars (attacks)
        attacks = attacks or {}
        if config.defence != "none" or attacks:
            self.rules = [averager_of(config, attacks.get(i), i) for i in range(count)]
            for rule in self.rules:  # CHOCO's public copies start at the shared start
                rule.begin(start)
            self.decodes = SharedDecodes()
            period = parse_trigger(config.trigger).period
            self.neighbourhoods = [
                Round(0, {int(j): float(mixing[i, j]) for j in np.flatnonzero(mixing[i]) if j != i},
                      float(mixing[i, i]), period=period)
                for i in range(count)
            ]  # fmt: skip
        if self.algorithm == "choco":
            check_choco_codec(self.codec)
            self_weight = np.diag(mixing)
            gammas = [config.gamma or auto_gamma(self.codec, numel, float(w)) for w in self_weight]
            self.gamma = torch.tensor(gammas, device=device).unsqueeze(1)
            self.scale = 1.0 / (1.0 + self.codec.omega(numel))  # an unbiased codec's
            self.x_hat = start.repeat(count, 1)  # public copies start at the starting model
            self.s = self.x_hat.clone()  # Σ_j W_ij x̂_j: rows of W sum to 1
            self.digest = model_digest(start.cpu().numpy())

    def round(self, x: torch.Tensor, index: int) -> Messages:
        """Round ``index`` on the stacked models ``x`` (in place); what every peer sent (for
        its bytes)."""
        count, numel = x.shape
        if self.rules:
            return self._round_each(x, index)
        if self.algorithm == "dense":
            _check_finite(x, index)
            x.copy_(torch.sparse.mm(self.w, x))
            return Messages("params", [Layout((("float32", numel),), {})] * count)
        if index == 0:  # everybody vouches for the same start: nothing to mix yet
            # the per-peer codecs encode an all-zero first message: draw what they draw
            self._compress(x.new_zeros(count if self.own else 1, numel))
            return Messages("public", [Layout((), {VOUCH: self.digest})] * count)
        assert self.gamma is not None
        q = self._compress(x - self.x_hat)
        if isinstance(q, SparseRows):
            _check_finite(q.value, index, q)
        else:
            _check_finite(q, index)
        if isinstance(q, SparseRows):
            self._mix_sparse(q, numel)
        else:
            self.x_hat.add_(q, alpha=self.scale)
            self.s.add_(torch.sparse.mm(self.w, q), alpha=self.scale)
        step = self.gamma * min(1.0, (index + 1) / WARMUP_ROUNDS)
        x += step * (self.s - self.x_hat)
        return Messages("params", self._layouts(q, count, numel))

    def metrics(self, peer: int) -> dict[str, Any]:
        """Peer ``peer``'s averaging rule's part of its metrics line (a defence's per-neighbour
        statistics), as the per-peer engine's core adds it."""
        return self.rules[peer].metrics() if self.rules else {}

    def _round_each(self, x: torch.Tensor, index: int) -> Messages:
        """A defence or Byzantine peers: every peer's own averaging rule (the per-peer
        engine's objects) sends its message and judges its neighbours', one peer after
        another; the stacked models are written once all have read them. CHOCO's first
        round is the protocol core's: a resync in which every peer vouches for its public
        copy (the shared start) instead of sending it."""
        numel = x.shape[1]
        decode = self.decodes.decode  # a payload all neighbours get is decoded once
        first = index == 0 and self.rules[0].uses_public_copies
        rounds = [replace(rnd, index=index, resync=first) for rnd in self.neighbourhoods]
        sent = [rule.outgoing(x[i], rounds[i]) for i, rule in enumerate(self.rules)]
        if first:  # what was encoded is dropped, as the core drops it
            sent = [rule.vouch() for rule in self.rules]
        for i, payload in enumerate(sent):
            if not all(all_finite(a) for p in _payloads(payload) for a in p.arrays):
                raise _diverged(i, index)
        new = torch.empty_like(x)
        for i, (rule, rnd) in enumerate(zip(self.rules, rounds, strict=True)):
            arrived = {
                j: Arrival(
                    w, decode(rule, addressed(sent[j], i), first, numel, x.device), index, first
                )
                for j, w in rnd.weights.items()
            }
            new[i] = rule.incoming(x[i], rnd, arrived, [])
        if first:  # only a resync round can find a vouch for another start
            assert not any(rule.needs_resync for rule in self.rules), "a vouch for another start"
        x.copy_(new)
        # dissensus sends each neighbour its own model, all of one layout
        layouts = [
            addressed(sent[i], next(iter(rnd.weights))).layout() for i, rnd in enumerate(rounds)
        ]
        return Messages("public" if first else "params", layouts)

    def _compress(self, d: torch.Tensor) -> torch.Tensor | SparseRows:
        """What every row of ``d`` sends: its kept entries, or its dense estimate."""
        codec = self.codec
        if not isinstance(codec, SparseCodec):
            return self._rounded(d)
        count, numel = d.shape
        sparsifier = codec.sparsifier
        if isinstance(sparsifier, TopK):
            kept = sparsifier.count(numel)
            chosen = torch.topk(d.abs(), kept, dim=1, sorted=False).indices.sort(dim=1).values
            values = d.gather(1, chosen)
            if isinstance(codec.values, ROW_CODECS):
                values = self._rounded(values)
            peer = torch.arange(count, device=d.device).repeat_interleave(kept)
            starts = torch.arange(count + 1, device=d.device) * kept
            return SparseRows(peer, chosen.reshape(-1), values.reshape(-1), starts)
        assert isinstance(sparsifier, Threshold)
        taus = self._by_row(d, lambda c, rows: _threshold(c).thresholds(rows))
        peer, index = torch.nonzero(d.abs() > taus.unsqueeze(1), as_tuple=True)
        starts = torch.searchsorted(peer, torch.arange(count + 1, device=d.device))
        return SparseRows(peer, index, d[peer, index], starts)

    def _by_row(
        self, rows: torch.Tensor, stage: Callable[[Codec, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``stage(codec, rows)`` for all rows at once, or, where codecs draw, each row by
        its own peer's codec."""
        if self.own is None:
            return stage(self.codec, rows)
        return torch.cat([stage(c, rows[i : i + 1]) for i, c in enumerate(self.own)])

    def _rounded(self, rows: torch.Tensor) -> torch.Tensor:
        """What each row's receivers read of it after sign or QSGD rounding."""
        return self._by_row(rows, lambda codec, row: _rounding(codec).estimate_rows(row))

    def _mix_sparse(self, q: SparseRows, numel: int) -> None:
        """``X̂ += Q`` and ``S += W Q`` for sparse rows: each edge adds its sender's entries."""
        self.x_hat.view(-1).index_add_(0, q.peer * numel + q.index, q.value, alpha=self.scale)
        per_edge = (q.starts[1:] - q.starts[:-1])[self.cols]
        edge = torch.repeat_interleave(per_edge)  # the edge of each entry carried
        shift = q.starts[self.cols] - (torch.cumsum(per_edge, 0) - per_edge)
        entry = shift[edge] + torch.arange(len(edge), device=edge.device)
        into = self.rows[edge] * numel + q.index[entry]
        self.s.view(-1).index_add_(0, into, self.weights[edge] * q.value[entry], alpha=self.scale)

    def _layouts(self, q: torch.Tensor | SparseRows, count: int, numel: int) -> list[Layout]:
        """Each peer's message layout for what it sent, ``q``."""
        codec = self.codec
        if not isinstance(q, SparseRows):
            assert isinstance(codec, ROW_CODECS)
            return [codec.layout(numel)] * count
        assert isinstance(codec, SparseCodec)
        indices = q.index.cpu().numpy()
        return codec.layouts(np.split(indices, q.starts[1:-1].cpu().numpy()), numel)


def _seconds_per_bit(rates: list[float]) -> np.ndarray:
    """1/rate of each link direction (0 for an unshaped one: it takes no time)."""
    bps = np.array(rates, dtype=np.float64)
    return np.divide(1.0, bps, out=np.zeros_like(bps), where=bps > 0)


class BatchedSimulation:
    """``config``'s swarm (see :func:`check_batchable`) as stacked peers, writing ``run``."""

    def __init__(self, config: Config, run: RunDir, *, step_time: float | None = None) -> None:
        topology = build_topology(config.topology, config.peers, config.seed)
        self.dataset = dataset_of(config)
        template = initial_model(config, self.dataset)
        check_batchable(config, topology, template)
        self.config = config
        self.run_dir = run
        self.device = pick_device(config.device)  # auto: the GPU where there is one
        device = self.device
        self.pixels = self.dataset.pixels  # images stay uint8; batches are standardised
        self.x_train, self.y_train = to_tensors(
            self.dataset.x_train, self.dataset.y_train, device, self.pixels
        )
        self.x_test = evaluation_inputs(self.dataset, device)
        self.y_test = torch.as_tensor(self.dataset.y_test, dtype=torch.int64).to(device)
        count = config.peers
        self.models = StackedModels(template, count).to(device)
        self.optimizer = StackedSGD(config.momentum, config.weight_decay)
        parts = parts_of(config, self.dataset)
        self.shards = [torch.from_numpy(np.asarray(p, dtype=np.int64)) for p in parts]
        self.streams = [  # the per-peer engine's seeds (``peer_sampler``)
            IndexStream(len(p), config.batch_size, sampler_seed(config, i))
            for i, p in enumerate(parts)
        ]
        self.draws = (  # CIFAR's crops and mirrors, drawn as each peer's ``BatchSampler`` does
            [augment_draws(sampler_seed(config, i), device) for i in range(count)]
            if self.dataset.augment
            else None
        )
        owned = [own_test(config, self.dataset, i) for i in range(count)]
        self.own = None  # each peer's own owners' test samples, as a mask (natural splits)
        if all(o is not None for o in owned):
            self.own = torch.zeros(count, len(self.dataset.y_test), dtype=torch.bool)
            for i, o in enumerate(owned):
                self.own[i, o] = True
            self.own = self.own.to(device)
        attacks = attacks_of(config)
        flipped = [i in attacks and attacks[i].name == "label-flip" for i in range(count)]
        self.flipped = torch.tensor(flipped, device=device).unsqueeze(1) if any(flipped) else None
        self.gossip = StackedGossip(
            config, topology.mixing_matrix(), self.models.flat[0].clone(), attacks
        )
        self.trigger = parse_trigger(config.trigger)
        devices = devices_of(config)
        if step_time is None and any(device.needs_host for device in devices):
            threads = torch.get_num_threads()  # one peer's step on one thread, as per-peer
            torch.set_num_threads(1)
            try:
                step_time = measure_step_time(config, self.dataset)
            finally:
                torch.set_num_threads(threads)
        self.measured = step_time  # the host's step (None where no peer's step needs it)
        self.step_times = np.array(  # the per-peer engine's ``_step_time``
            [device.step_s(step_time) for device in devices]
        )
        self.latency = np.array([device.link.latency_s for device in devices])
        self.up = _seconds_per_bit([device.link.uplink_bps for device in devices])
        self.down = _seconds_per_bit([device.link.downlink_bps for device in devices])
        self.queued = bool(self.up.any() or self.down.any())  # a message takes time on a link
        self.up_free = np.zeros(count)  # when each uplink has sent what it was given
        self.down_free = np.zeros(count)  # when each downlink has read what came
        members = [Member(i, sim_address(i), 0) for i in range(count)]
        self.table = MemberTable(members, config.max_members).digest()
        self.swarm_start = round(time.time(), 3)
        self.swarm_id = swarm_id(config)
        self.clock = np.zeros(count)  # each peer's virtual time
        self.idle = np.zeros(count)  # each peer's time spent waiting for its neighbours
        self.steps = 0
        self.rounds = 0
        self.bytes_sent = np.zeros(count, dtype=np.int64)
        self.header_bytes = np.zeros(count, dtype=np.int64)
        self.bytes_received = np.zeros(count, dtype=np.int64)
        self.messages = np.zeros(count, dtype=np.int64)
        self.losses: list[torch.Tensor] = []
        self.ledger = {"sent": 0, "delivered": 0, "duplicated": 0}  # the per-peer engine's keys
        adjacency = topology.adjacency()
        self.edges = np.nonzero(adjacency)  # (sender, receiver) of every message
        self.fan = adjacency.sum(axis=1).astype(np.int64)

    @property
    def now(self) -> float:
        """The simulated time: the furthest peer's clock."""
        return float(self.clock.max())

    # --------------------------------------------------------------------- steps
    def _step(self) -> None:
        """One local step of every peer: its batch, gradients and SGD update."""
        x, labels = self.batches()
        losses, grads = self.models.gradients(x, labels)
        self.optimizer.step(self.models.flat, grads, lr_at(self.config, self.steps))
        self.losses.append(losses.detach())
        self.steps += 1
        self.clock += self.step_times

    def batches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every peer's next batch, ``[peers, batch, ...]`` inputs and labels: what each
        peer's ``peer_sampler`` gives it in the per-peer engine."""
        rows = torch.stack(
            [shard[s.next()] for shard, s in zip(self.shards, self.streams, strict=True)]
        )
        rows = rows.to(self.device, non_blocking=True)
        labels = self.y_train[rows]
        if self.flipped is not None:  # label-flipping peers train on lies (``peer_sampler``)
            labels = torch.where(
                self.flipped, flip_labels(labels, self.dataset.num_classes), labels
            )
        x = self.x_train[rows]
        if self.draws is not None:
            x = torch.stack([crop_flip(xi, g) for xi, g in zip(x, self.draws, strict=True)])
        return standardise(x, self.pixels), labels

    def _round(self) -> None:
        """A gossip round of every peer: the averaging, then what its messages cost."""
        sent = self.gossip.round(self.models.flat, self.rounds)
        kind = sent.kind
        codec = self.gossip.codec.spec if kind in COMPRESSED_KINDS else "none"
        sizes = np.empty((len(sent.layouts), 2), dtype=np.int64)
        for i, layout in enumerate(sent.layouts):
            meta = {**layout.meta, TABLE: self.table} if kind in TABLE_KINDS else layout.meta
            # one message per neighbour, alike but for nothing the header's size depends on
            # (each neighbour has had as many messages from i: the same seq)
            sizes[i] = message_size(
                kind, i, self.rounds + 1, self.rounds, layout.arrays, meta, codec
            )
        size = sizes[:, 0]
        over = np.flatnonzero(size > self.config.max_message_mb * 2**20)
        if over.size:
            raise SimulationError(
                f"peer {int(over[0])}'s message of round {self.rounds} is {int(size[over[0]]):,} "
                f"bytes, over max_message_mb = {self.config.max_message_mb:g}: its neighbours "
                "would refuse it (oversize), which the per-peer simulator models. Set batched = "
                "false, or raise max_message_mb"
            )
        self.bytes_sent += size * self.fan
        self.header_bytes += sizes[:, 1] * self.fan
        self.messages += self.fan
        self.bytes_received += np.bincount(self.edges[1], size[self.edges[0]], len(size)).astype(
            np.int64
        )
        sent_in_all = int(self.messages.sum())  # nothing is lost, nothing duplicated
        self.ledger.update(sent=sent_in_all, delivered=sent_in_all)
        self.rounds += 1
        self._wait(size)

    def _queued_arrivals(self, bits_of: np.ndarray) -> np.ndarray:
        """When each peer has the last of its neighbours' messages (of ``bits_of`` its
        sender's size) in, through bandwidth-limited links as
        :class:`~gossipdl.transport.shaping.Link` carries them: a sender's copies leave
        its uplink one after another, in its edges' order, behind whatever it still sends
        from the round before; a receiver's downlink reads arrivals one after another, in
        the order they come."""
        sender, receiver = self.edges
        bits = bits_of[sender]
        start = np.maximum(self.clock, self.up_free)  # edges are sorted by sender
        copy = np.arange(len(sender)) - np.searchsorted(sender, sender)  # its place in line
        arrival = start[sender] + (copy + 1) * bits * self.up[sender] + self.latency[sender]
        self.up_free = start + self.fan * bits_of * self.up
        order = np.lexsort((arrival, receiver))
        by_receiver, arrived = receiver[order], arrival[order]
        reading = bits[order] * self.down[by_receiver]
        first = np.searchsorted(by_receiver, np.arange(len(start)))
        last = np.searchsorted(by_receiver, np.arange(len(start)), side="right")
        done = self.down_free.copy()
        for place in range(int((last - first).max(initial=0))):  # the k-th arrival of each
            at = first + place
            peers = np.flatnonzero(at < last)
            done[peers] = np.maximum(done[peers], arrived[at[peers]]) + reading[at[peers]]
        self.down_free = done
        return np.maximum(self.clock, done)

    def _wait(self, size: np.ndarray) -> None:
        """Move each peer's clock to when the last of its neighbours' ``size``-byte messages
        (one size per sender) is in; SimulationError where the per-peer engine would have
        given up on one (``round_timeout``)."""
        sender, receiver = self.edges
        if self.queued:  # the links carry one message at a time, as the per-peer engine's do
            done = self._queued_arrivals(8 * size)
        else:
            done = self.clock.copy()
            np.maximum.at(done, receiver, self.clock[sender] + self.latency[sender])
        wait = done - self.clock
        late = np.flatnonzero(wait >= self.config.round_timeout)
        if late.size:
            i = int(late[np.argmax(wait[late])])
            raise SimulationError(
                f"peer {i} would wait {wait[i]:.3g} s for its neighbours in round "
                f"{self.rounds}, past round_timeout = {self.config.round_timeout} s: the "
                "per-peer simulator models the missed messages. Set batched = false, or "
                "raise round_timeout"
            )
        self.idle += wait
        self.clock = done

    # ------------------------------------------------------------------- records
    def _record(self, files: list[Any], evaluate: bool, **extra: Any) -> None:
        """One metrics line per peer, with the per-peer engine's keys."""
        if evaluate:
            accuracy, test_loss, own_accuracy = self.models.evaluate(
                self.x_test, self.y_test, self.own
            )
        losses = torch.stack(self.losses).mean(0).tolist() if self.losses else None
        for i, file in enumerate(files):
            transport = TransportStats(
                bytes_sent=int(self.bytes_sent[i]),
                header_bytes_sent=int(self.header_bytes[i]),
                bytes_received=int(self.bytes_received[i]),
                messages_sent=int(self.messages[i]),
                messages_received=int(self.messages[i]),  # the graphs are undirected
            )
            stats = {  # the per-peer engine's keys: its network's, its core's, its own
                **transport.snapshot(),
                "round": self.rounds,
                "model_messages_sent": int(self.messages[i]),
                "syncs": self.rounds,
                "neighbour_misses": 0,
                "resyncs": 0,
                "idle_s": round(float(self.idle[i]), 4),
                "members": self.config.peers,
                "declared_dead": 0,
                "rejoins": 0,
                "online": True,
                "sockets": self.config.peers - 1,
                **self.gossip.metrics(i),
            }
            if evaluate:
                extra = {
                    **extra,
                    "accuracy": round(float(accuracy[i]), 6),
                    "test_loss": round(float(test_loss[i]), 6),
                }
                if own_accuracy is not None and self.own is not None and bool(self.own[i].any()):
                    extra["own_accuracy"] = round(float(own_accuracy[i]), 6)
            own = [losses[i]] if losses is not None else []
            now = float(self.clock[i])
            line = metrics_line(i, self.steps, now, self.swarm_start + now, own, stats, extra)
            file.write(json_line(line))
        self.losses.clear()

    # ----------------------------------------------------------------------- run
    def run(
        self,
        on_progress: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> float:
        """Run every peer to ``steps`` (or until ``should_stop()``); the simulated seconds
        it took. ``on_progress(steps done by all peers, simulated time)`` as it goes."""
        config = self.config
        count = config.peers
        self.run_dir.write_members((i, sim_address(i)) for i in range(count))
        files = [self.run_dir.metrics(i).open("w", buffering=1 << 16) for i in range(count)]
        try:
            self._record(files, True, start=True, swarm=self.swarm_id, swarm_start=self.swarm_start)
            while self.steps < config.steps and not should_stop():
                self._step()
                if self.trigger.ends_round(self.steps):
                    self._round()
                if self.steps < config.steps:
                    due = config.eval_every and self.steps % config.eval_every == 0
                    if due or self.steps % config.log_every == 0:
                        self._record(files, bool(due))
                if on_progress is not None:
                    on_progress(self.steps * count, self.now)
            stopped = self.steps < config.steps
            for i in range(count):
                save_atomic(self.models.model(i).state_dict(), self.run_dir.model(i))
            self._record(
                files,
                True,
                final=True,
                stopped_early=stopped,
                device="sim",
                compute_device=str(self.device),
            )
        finally:
            for file in files:
                file.close()
        return self.now
