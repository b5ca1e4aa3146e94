"""The averaging strategy seam: what a peer sends each round and how it merges what arrived.

The peer loop is fixed; an Averager decides the payload and the merge rule. It
receives what arrived, what arrived late, and which neighbours did not make it,
so a partial round is a designed case rather than an exception path.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from gossipdl.compression import Codec, CodecError, Payload, build_codec
from gossipdl.compression._kernels import empty_on
from gossipdl.compression.sparse import SparseCodec

if TYPE_CHECKING:  # judging builds on this module
    from gossipdl.averaging.judging import Judge


@dataclass(frozen=True)
class Round:
    """One round as a peer sees it: its number and its row of the mixing matrix.

    ``resync`` marks a round in which this peer rebuilds its view of every
    neighbour from their dense public copies (the first round, and the round a
    topology changes or a lost message was detected). ``mix`` is False in a
    round this peer sat out (dynamic trigger): take in what arrived, but keep
    the model. ``lr`` is the learning rate of the local step just taken (1.0 where the
    engine has none): gradient tracking tracks the update per unit of it. ``reshaped``
    marks the round at which the swarm's members changed, the same round for every peer
    (each resyncs there). ``period`` is the local steps a round spans (the trigger's):
    honest models drift apart with the steps between their mixings.
    """

    index: int
    weights: Mapping[int, float]
    self_weight: float
    resync: bool = False
    mix: bool = True
    lr: float = 1.0
    reshaped: bool = False
    period: int = 1


Step = TypeVar("Step", bound=float | None)


def check_graph(averager: Averager, topology: str, static: bool) -> None:
    """ValueError for an algorithm that keeps state per edge on a time-varying ``topology``
    (``static`` False): CHOCO's and BEER's sums hold a neighbour's updates under the weight
    of the round they came in and copies of peers no longer neighbours (8 peers on
    one-peer-exponential: consensus distance 5.3 for CHOCO, 346 for BEER, against 0.2 and
    0.09 on the exponential graph), and PowerGossip restarts an edge's projector whenever
    it comes back, mixing along one direction (18.4)."""
    if averager.needs_static_graph and not static:
        raise ValueError(
            f"algorithm {averager.name!r} keeps state per neighbour, which topology "
            f"{topology!r} changes every round; use a static topology (exponential has the "
            "same neighbours every round) or algorithm dense"
        )


def checked_gamma(gamma: Step, method: str) -> Step:
    """``gamma``, a consensus step (``None``: chosen automatically), once it is in (0, 1];
    ValueError naming ``method`` otherwise. CHOCO's, BEER's and PowerGossip's.

    >>> checked_gamma(0.5, "CHOCO"), checked_gamma(None, "CHOCO")
    (0.5, None)
    """
    if gamma is not None and not 0 < gamma <= 1:
        raise ValueError(f"gamma = {gamma}; {method} needs 0 < gamma <= 1")
    return gamma


def codec_seed(seed: int, peer: int) -> int:
    """The seed of peer ``peer``'s codec in a swarm seeded ``seed``.

    Each peer draws its own random numbers (QSGD's and ternary's rounding, random-k's
    subsets), so their compression errors are independent and averaging shrinks them;
    with one seed for all, every peer rounded the same coordinates the same way, an
    error the swarm's mean kept.

    >>> codec_seed(0, 1) != codec_seed(0, 2) and codec_seed(0, 1) == codec_seed(0, 1)
    True
    """
    digest = hashlib.sha256(f"codec:{seed}:{peer}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


VOUCH = "sha256"
"""Payload meta key of a vouch: the hex sha256 of the sender's dense public copy."""


@dataclass(frozen=True)
class Vouch:
    """A neighbour's word, in its first round, that its public copy is the model whose
    sha256 is ``digest``: peers that start from the same model need not send it."""

    digest: str


@dataclass(frozen=True)
class Arrival:
    """One neighbour's decoded contribution: its weight, the round it was for, dense or not."""

    weight: float
    value: torch.Tensor
    round: int
    dense: bool = False


_HEX64 = re.compile(r"[0-9a-f]{64}")


def model_digest(values: np.ndarray) -> str:
    """The hex sha256 of a float32 vector's bytes: what a peer vouches for (:class:`Vouch`)."""
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float32).tobytes()).hexdigest()


class Averager(ABC):
    """Strategy for one gossip round over a flat parameter vector ``x``.

    ``codec`` compresses what is sent; ``decode`` runs on the receive thread
    and must raise ``CodecError`` for anything it cannot use.
    """

    name: str = "averager"
    # True when neighbours keep a view of this peer's public copy that a lost
    # message or a topology change breaks, so the peer loop must run resyncs.
    uses_public_copies: bool = False
    # Set by ``incoming`` when the peer's view of its neighbours is broken.
    needs_resync: bool = False
    # True when a message that arrives after its round still counts (a sum of updates).
    accepts_late: bool = False
    # True when a peer may skip a round while its neighbours sync (the dynamic trigger).
    supports_dynamic: bool = True
    # True for gossip learning: no rounds to wait for, models walk and are merged on arrival.
    asynchronous: bool = False
    # True when a consensus step γ scales the pull towards the neighbours (``gamma``).
    takes_gamma: bool = False
    # True when a resync is the whole swarm's: a peer asked for one resyncs in that round too
    # (compressed broadcast: every peer must end the round on one model).
    resyncs_together: bool = False
    # True when the state kept per edge (sums of a neighbour's updates, projectors) needs
    # the same neighbours every round: refused on a time-varying graph (:func:`check_graph`).
    needs_static_graph: bool = False
    # True when ``incoming`` only reads the arrivals' values, never changes them in place, so
    # peers in one process may be handed one shared decoded tensor (:class:`SharedDecodes`).
    # False by default: an averager of one's own opts in once it is known not to write them.
    arrivals_read_only: bool = False

    # True when ``incoming`` takes a sparse codec's messages as they came (a
    # :class:`~gossipdl.compression.sparse.SparseVector`) and adds them in place: no
    # full-size copy of each neighbour's update.
    sparse_arrivals: bool = False
    # The model the peer started from (:meth:`begin`).
    origin: torch.Tensor | None = None
    # A defended averager's judge of its neighbours (dense gossip's, CHOCO's and BEER's, with
    # a defence): what :meth:`metrics` and :meth:`suspects` report.
    judge: Judge | None = None

    def __init__(self, codec: Codec | str = "none", seed: int = 0) -> None:
        self.seed = seed  # the swarm's: what every peer draws alike derives from it
        self.codec = build_codec(codec, seed) if isinstance(codec, str) else codec
        self._dense = build_codec("none")  # resync copies and model replies travel uncompressed

    def catch_up(self, arrived: Mapping[int, Arrival]) -> torch.Tensor | None:
        """The model a newcomer, or a peer resumed from a checkpoint, starts its first round
        from, given what its neighbours sent for that round (None: its own). It trained
        alone for a join margin before the round at least (a checkpoint's model is older
        still), so its own lacks that many rounds of the swarm's averaging."""
        return None

    def own_draws(self, peer: int) -> None:
        """Give this peer's codec random draws of its own (:func:`codec_seed`), before the
        first round; what the swarm draws alike (PowerGossip's projectors) keeps ``seed``."""
        self.codec = build_codec(self.codec.spec, codec_seed(self.seed, peer))

    def bind_layout(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the model's parameters, in the flat vector's order (peers call it
        once, before the first round): for codecs and averagers that work layer by layer."""
        self.codec.bind_layout(shapes)

    @abstractmethod
    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload | Mapping[int, Payload]:
        """The payload every neighbour gets this round, or one per neighbour (by id).
        A payload may share ``x``'s memory only where :meth:`sends_memory_of` says so."""

    def sends_memory_of(self, x: torch.Tensor) -> bool:
        """Whether :meth:`outgoing` sends ``x``'s own memory, without a copy: the caller
        must then hand it a round's model that nothing writes afterwards, not the live
        parameters (no averager keeps ``x`` past its round otherwise)."""
        return False

    def metrics(self) -> dict[str, Any]:
        """The averager's own part of a metrics line: a defended one's statistics per
        neighbour (:meth:`~gossipdl.averaging.judging.Judge.metrics`), else nothing."""
        return {} if self.judge is None else self.judge.metrics()

    def suspects(self, rounds: int) -> list[int]:
        """Neighbours whose models this peer set aside in each of their last ``rounds``
        judged rounds (the protocol accuses them, ``evict_after``): none, but for a defended
        averager."""
        return [] if self.judge is None else self.judge.suspects(rounds)

    def sent_mask(self) -> torch.Tensor | None:
        """The coordinates the last :meth:`outgoing` sent, for DGC's momentum factor masking
        (the peer zeroes its optimizer's momentum there), or None where masking does not
        apply (the default: every averager but a sparsifying broadcast)."""
        return None

    def public_copy(self) -> Payload:
        """The dense payload a resyncing neighbour gets instead (averagers with public copies)."""
        raise NotImplementedError

    def begin(self, model: torch.Tensor) -> None:
        """The model this peer starts from, before any local step (the protocol core says so
        before the first round): public copies start there, so peers that start from one
        model (one seed) hold the same copies without sending them."""
        if self.uses_public_copies:
            self.origin = model.clone()

    def start_copy(self, x: torch.Tensor) -> torch.Tensor:
        """A new copy of where a public copy starts: the model the peer started from
        (:meth:`begin`), or ``x`` when it was not told."""
        return (x if self.origin is None else self.origin).clone()

    def vouch(self) -> Payload:
        """What a founding peer sends in the swarm's first round instead of
        :meth:`public_copy`: the copy's sha256 alone. A neighbour whose own copy has that
        digest (peers that start from the same model) takes its own as this one; any other
        asks for the dense copy."""
        (copy,) = self.public_copy().arrays
        return Payload((), {VOUCH: model_digest(copy)})

    @staticmethod
    def vouched(dense: Mapping[int, Arrival], own: torch.Tensor) -> dict[int, Arrival]:
        """The dense arrivals with every :class:`Vouch` for a copy equal to ``own`` (the
        same sha256) replaced by ``own``; a vouch for another model is left out (the round
        lacks it, and the peer asks for a dense resync)."""
        out, mine = {}, None
        for j, arrival in dense.items():
            if not isinstance(arrival.value, Vouch):
                out[j] = arrival
                continue
            mine = mine or model_digest(own.detach().cpu().numpy())
            if arrival.value.digest == mine:
                out[j] = replace(arrival, value=own)
        return out

    def decode(self, payload: Payload, dense: bool, numel: int, device: torch.device) -> Any:
        """Decode a received payload (codec-compressed, a dense fp32 vector, or a vouch)."""
        if dense and VOUCH in payload.meta:
            digest = payload.meta[VOUCH]
            if payload.arrays or len(payload.meta) != 1 or not _HEX64.fullmatch(str(digest)):
                raise CodecError(f"a vouch is one {VOUCH!r} of 64 hex digits and no arrays")
            return Vouch(str(digest))
        codec = self._dense if dense else self.codec
        if self.sparse_arrivals and isinstance(codec, SparseCodec):
            return codec.decode_sparse(payload, numel, device)
        return codec.decode(payload, numel, device)

    @abstractmethod
    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """The new parameter vector from ``x`` and what the neighbours sent (with
        ``arrivals_read_only``, the arrivals' values must not be changed in place)."""


class SharedDecodes:
    """Decoded payloads shared by the peers of one process: a simulated swarm's broadcast is
    decoded once, not once per neighbour.

    A peer sends one payload to each of its d neighbours, and each would decode it to a
    full-size tensor; in the simulator, where all of them live in one process, that is d
    decodes of the same bytes. :meth:`decode` gives every receiver of the same payload
    (the same arrays, bytes, dtypes and shapes, the same meta, for the same codec, size and
    device) the same tensor, decoded the first time: decoding is a function of those alone
    (the codec contract), so each receiver gets what its own decode would give. Only
    averagers with ``arrivals_read_only`` share; the others decode as before.

    Entries are keyed by content, never by object identity, and live while some receiver
    holds the tensor (weak references) or while they are among the last ``keep`` decoded
    (at most ``keep_bytes`` of them), so the cache holds little beyond what the receivers'
    mailboxes hold anyway.

    Example:
        >>> from gossipdl.averaging import Choco
        >>> shared, a, b = SharedDecodes(), Choco("topk:0.5"), Choco("topk:0.5")
        >>> payload, _ = a.codec.encode(torch.tensor([0.0, 3.0, -1.0, 0.5]))
        >>> x = shared.decode(a, payload, False, 4, torch.device("cpu"))
        >>> y = shared.decode(b, payload, False, 4, torch.device("cpu"))
        >>> x is y, x.indices.tolist(), x.values.tolist(), shared.hits
        (True, [1, 2], [3.0, -1.0], 1)
    """

    def __init__(self, keep: int = 256, keep_bytes: int = 64 * 2**20) -> None:
        self.keep = keep
        self.keep_bytes = keep_bytes
        self.hits = 0
        self.misses = 0
        self._held: weakref.WeakValueDictionary[Hashable, Any] = weakref.WeakValueDictionary()
        self._recent: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._recent_bytes = 0

    def decode(
        self, averager: Averager, payload: Payload, dense: bool, numel: int, device: torch.device
    ) -> Any:
        """``averager.decode(payload, dense, numel, device)``, shared with every other receiver
        of the same payload; the result must be treated as read-only."""
        if not averager.arrivals_read_only or type(averager).decode is not Averager.decode:
            return averager.decode(payload, dense, numel, device)
        codec = averager._dense if dense else averager.codec
        # repr keeps 1, 1.0, -0.0 and 0.0 apart (the same meta in another order only misses)
        key: tuple[Any, ...] = (type(codec), codec.spec, numel, device, repr(payload.meta))
        for a in payload.arrays:
            key += (a.dtype.str, a.shape, a.tobytes())
        recent = self._recent.get(key)
        value = recent[0] if recent is not None else self._held.get(key)
        if value is not None:
            self.hits += 1
            return value
        self.misses += 1
        value = averager.decode(payload, dense, numel, device)
        with contextlib.suppress(TypeError):  # not weakly referenceable: kept while recent
            self._held[key] = value
        size = int(getattr(value, "nbytes", 0))  # a tensor's, a sparse vector's; a vouch: 0
        self._recent[key] = (value, size)
        self._recent_bytes += size
        while self._recent and (
            len(self._recent) > self.keep or self._recent_bytes > self.keep_bytes
        ):
            _, (_, dropped) = self._recent.popitem(last=False)
            self._recent_bytes -= dropped
        return value


def mix(x: torch.Tensor, rnd: Round, arrived: Sequence[Arrival]) -> torch.Tensor:
    """``W_ii x + Σ_j W_ij v_j`` over the ``arrived``, the weight of every neighbour that sent
    nothing left on ``x``: the one missing-neighbour rule of every averager.

    With a symmetric W this is ``x + Σ_j W_ij (v_j − x)``, pairwise exchanges that cancel in
    the sum, so an edge lost both ways (a neighbour gone, a link down, a peer that sat out a
    dynamic round) leaves the swarm's average exactly where it was. Renormalising the
    arrived weights to one instead scales the peer's row and moves the average.
    """
    kept = rnd.self_weight + sum(rnd.weights.values()) - sum(a.weight for a in arrived)
    out = torch.mul(x, kept, out=empty_on(x.device, x.numel()))  # no fresh pages to fault
    for arrival in arrived:
        out.add_(arrival.value, alpha=arrival.weight)
    return out


def after_rebuild(
    sender: int, round: int, synced_at: Mapping[int, int], rebuilt: int | None
) -> bool:
    """Whether an update of ``sender`` for ``round`` still belongs in a sum of public copies:
    not when a later dense resync already included it (or, from a neighbour of an earlier
    topology, left it out: the sum was rebuilt after it)."""
    return round > max(synced_at.get(sender, -1), -1 if rebuilt is None else rebuilt)


def dense_payload(t: torch.Tensor) -> Payload:
    """A dense float32 copy of ``t`` on the host, as sent for a resync."""
    return Payload((t.detach().cpu().numpy().copy(),), {})
