"""CHOCO-SGD gossip (Koloskova, Stich and Jaggi, ICML 2019): converges under any compression.

Each peer keeps three model-sized buffers: its parameters x_i, its public copy
x̂_i (what its neighbours believe x_i is) and s_i = Σ_j W_ij x̂_j over its
neighbours and itself. Per round, after the local step (Algorithm 1, in the
memory-efficient form that stores s_i instead of every x̂_j):

1. q_i = Q(x_i − x̂_i)                      compress the difference to the public copy
2. x̂_i ← x̂_i + q_i,  s_i ← s_i + W_ii q_i   update the own public copy
3. send q_i to the neighbours; for each q_j received, s_i ← s_i + W_ij q_j
4. x_i ← x_i + γ (s_i − x̂_i)                gossip step of size γ

s_i is a sum, so a q_j that arrives after its round is still added when it
comes. A q_j that is lost makes s_i wrong for good; the peer then resyncs: its
neighbours send their dense x̂_j once and s_i is rebuilt from them. The first
round of every peer is such a resync, and x̂ starts at the model the peer started
from (nobody sends the initial weights through the compressor). In the swarm's first
round a founding peer sends the sha256 of its x̂ instead of x̂ (``Averager.vouch``):
neighbours that start from the same model (one seed) take their own copy for it and
nothing dense is sent; a neighbour whose model differs asks for the dense copy, and
mixes only once it has every copy. A peer mixes only with sums rebuilt for its current
row of weights (:meth:`PublicCopies.can_mix`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from gossipdl.averaging.base import (
    Arrival,
    Averager,
    Round,
    after_rebuild,
    checked_gamma,
    dense_payload,
)
from gossipdl.averaging.judging import Judge
from gossipdl.averaging.replicas import Replicas
from gossipdl.averaging.robust import Defence
from gossipdl.compression import Codec, Payload, stage_names
from gossipdl.compression._kernels import empty_on, native_kernels
from gossipdl.compression.sparse import RandomK, SparseCodec, SparseVector


def auto_gamma(codec: Codec, numel: int, self_weight: float) -> float:
    """CHOCO's consensus step for ``codec`` on a vector of ``numel``, for a peer whose row of
    the mixing matrix keeps ``self_weight`` for itself: ``min(√δ/2, δ^0.85 / (1 − W_ii))``
    with δ the contraction of the codec's biased part (``codec.contraction`` times
    ``1 + codec.omega``); 1 for a (near-)lossless codec.

    The theory's step (Koloskova et al. 2019, Theorem 2: of order ρ²δ for a spectral gap
    ρ) is hundreds of times smaller than what trains well, and gets the graph backwards.
    CHOCO's consensus alone (``benchmarks/stability.py``: no training, gossipdl's own
    CHOCO and codecs, the largest γ whose consensus distance does not grow over 1,500
    rounds) bears up to γ* = 0.051 for top-1% on a ring of 8 but only 0.037 on the
    exponential graph of 16, where each peer adds more compressed copies into s; γ*
    grows like δ^0.85 with the kept share (top-10%: 0.36 and 0.23), and γ*(1 − W_ii)
    varies far less across graphs than γ* does. So the step is δ^0.85 / (1 − W_ii)
    (0.030 and 0.023 for top-1% on those graphs, about 0.6 γ*), and no more than √δ/2,
    the steps published for dense quantizers (sign: 0.40 against γ* 0.95 and 0.76). A
    step just above γ* does not blow up at once: training's pull hides the slow growth
    until the learning rate anneals, then the models drift apart (top-1% at
    γ 0.05 on the exponential graph of 16, README *Accuracy against bytes*). On a graph
    whose peers keep different W_ii, their steps differ, so the swarm's average moves by
    a term that vanishes as the public copies agree (on regular graphs it is kept exactly).

    An unbiased stage (QSGD, ternary values) does not shrink δ: the ``1/(1 + ω)`` that
    makes it contractive already shrinks every message, and γ* grows with ω instead
    (ring of 8: top-1% 0.051, with QSGD-16 values 0.092, with QSGD-4 0.128; QSGD-16
    alone 0.95). On the convergence job (572k values, where QSGD-16 on top-1% has
    ω 1.41) BEER top-1% + QSGD-16 on the ring ends at 0.680 with the sparsifier's
    step 0.030, 0.700 at 0.045, 0.703 at 0.06, and still 0.685 at 0.12. So the graph's
    bound is multiplied by ``(1 + ω)^OMEGA_EXPONENT`` (1.94 there; ring 0.050, capped by
    √δ/2; exponential graph of 16 0.044), and √δ/2 stays the cap (QSGD alone: 1/2).

    Top-k's δ = k/n is a floor: a real vector's largest entries hold more of ``‖x‖²``
    than their share, the more so the smaller k, which the exponent 0.85 absorbs.
    Random-k's is what every message keeps, and its γ* is about δ / (1 − W_ii)
    (ring of 8 and exponential graph of 16: γ*(1 − W_ii)/δ from 0.97 at 1% to 1.26 at
    20%): δ^0.85 gave it 1.4–2.1 γ*, and BEER with ``randomk:0.02:noscale+qsgd:16``
    diverged on the convergence job. Its step is :data:`RANDOM_K_STEP` of that, with no
    boost for an unbiased stage: QSGD-16 values raise its γ* less than top-k's (1.18x at
    ω 0.49, where ``(1 + ω)^0.75`` says 1.35), and BEER, whose tracker a random subset
    follows slowly, bears less than CHOCO's consensus: on the convergence job (ω 1.41)
    BEER with random-2% + QSGD-16 ends at 0.657 with γ 0.01, 0.683 with 0.02, 0.658
    with 0.025 and at chance with 0.035 (the boosted step); the rule gives 0.018.
    """
    delta = codec.contraction(numel)
    if delta >= 1.0:
        return 1.0
    unbiased = 1.0 + codec.omega(numel)
    delta = min(1.0, delta * unbiased)  # the biased part's
    share = 1.0 - self_weight  # the row's weight on the neighbours
    if share <= 0:
        bound = 1.0
    elif codec.contraction_is_exact():
        bound = RANDOM_K_STEP * delta / share  # what every message keeps: γ* ≈ δ / (1 − W_ii)
    else:
        bound = unbiased**OMEGA_EXPONENT * delta**GAMMA_EXPONENT / share
    return max(1e-4, min(math.sqrt(delta) / 2, bound))


def round_gamma(given: float | None, codec: Codec, numel: int, rnd: Round) -> float:
    """The step of round ``rnd``: ``given`` (``--gamma``), or :func:`auto_gamma` for that
    round's row of the mixing matrix (it changes with the topology). CHOCO's and BEER's."""
    return given if given is not None else auto_gamma(codec, numel, rnd.self_weight)


GAMMA_EXPONENT = 0.85
"""How CHOCO's largest stable step grows with the codec's contraction δ (measured, see
:func:`auto_gamma`)."""

OMEGA_EXPONENT = 0.75
"""How much larger a step an unbiased stage of variance ω lets CHOCO take: ``(1 + ω)`` to
this power (measured, see :func:`auto_gamma`)."""


RANDOM_K_STEP = 0.6
"""Random-k's graph bound as a share of its measured γ* ≈ δ / (1 − W_ii) (see
:func:`auto_gamma`), as top-k's δ^0.85 is about 0.6 of its own."""


WARMUP_ROUNDS = 20
"""With a lossy codec, γ ramps linearly from γ/WARMUP_ROUNDS to γ over a peer's first
rounds: early updates are the largest and the public copies lag them most."""


def check_choco_codec(codec: Codec) -> None:
    """Refuse what CHOCO cannot use, saying why: error feedback on top (the public copy
    x̂ already keeps what was not sent: CHOCO is error feedback on the model) and scaled
    random-k (unbiased but not contractive even after 1/(1+ω): use its noscale form)."""
    stages = stage_names(codec.spec)
    if "ef" in stages:
        raise ValueError(
            f"codec {codec.spec!r}: CHOCO needs no '+ef': its public copy x̂ already carries "
            f"what was not sent (x − x̂ is the error memory); use {codec.spec[:-3]!r}"
        )
    sparsifier = getattr(codec, "sparsifier", None)
    if isinstance(sparsifier, RandomK) and sparsifier.scaled:
        raise ValueError(
            f"codec {codec.spec!r}: scaled random-k is not contractive (its error can exceed "
            f"the vector), which CHOCO needs; use "
            f"{codec.spec.replace(sparsifier.spec, sparsifier.spec + ':noscale')!r}, "
            "the same rand-k scaled by 1/(1+ω)"
        )


def choco_step(x: torch.Tensor, s: torch.Tensor, x_hat: torch.Tensor, gamma: float) -> torch.Tensor:
    """``x + γ(s − x̂)``, CHOCO's step, in recycled memory. On a CPU one C pass reads the three
    vectors and writes the result once (10.7M values on one thread: 9 ms, against 15 ms for
    torch's three passes); elsewhere torch's passes. Every operation is rounded on its own,
    in that order: the same bits either way.

    Example:
        >>> choco_step(torch.ones(3), torch.full((3,), 3.0), torch.ones(3), 0.5).tolist()
        [2.0, 2.0, 2.0]
    """
    out = empty_on(x.device, x.numel())
    native = native_kernels(x)
    if native is not None and all(t.dtype == torch.float32 for t in (x, s, x_hat)):
        parts = (t.detach().contiguous().numpy() for t in (x, s, x_hat))
        native.choco_step(*parts, gamma, out.numpy())
        return out
    return torch.sub(s, x_hat, out=out).mul_(gamma).add_(x)


class PublicCopies(Averager):
    """What CHOCO and BEER share: a contractive codec (:func:`check_choco_codec`), a step γ
    (given, or :func:`auto_gamma` each round), the scale ``1/(1 + ω)`` of an unbiased
    stage, the rounds of the last dense rebuild, and with a ``defence`` a judge of the
    neighbours' public copies, which are then kept apart (as with ``keep_copies``)."""

    uses_public_copies = True
    takes_gamma = True
    needs_static_graph = True  # s_i sums W_ij q_j under each round's weights
    arrivals_read_only = True  # the sums add what arrived, reading it
    accepts_late = True  # a late update is still added: a sum does not care about order

    def __init__(
        self,
        codec: Codec | str = "topk:0.01",
        seed: int = 0,
        gamma: float | None = None,
        defence: Defence | None = None,
        keep_copies: bool = False,
    ):
        super().__init__(codec, seed)
        check_choco_codec(self.codec)
        # None: auto_gamma, every round (the row can change)
        self.given_gamma = checked_gamma(gamma, self.name.upper())
        self.gamma: float | None = gamma  # the step of the latest round
        self.scale = 1.0  # 1/(1+ω), set when the vector's length is known
        self._synced_at: dict[int, int] = {}  # neighbour -> the round of its last dense copy
        self.resynced: int | None = None  # the round the sums were last rebuilt from dense copies
        self._row: tuple[dict[int, float], float] | None = None  # the weights of that rebuild
        self._owed = False  # the members changed and the rebuild there failed: none since
        self.judge = None if defence is None else Judge(defence, copies=True)
        self.keeps_copies = defence is not None or keep_copies

    def complete(self, rnd: Round, dense: Mapping[int, Arrival]) -> bool:
        """Whether the dense copies of resync round ``rnd`` hold every neighbour, so the sums
        can be rebuilt; if not, a resync is asked for (``needs_resync``), and after the
        members changed nothing is mixed until one succeeds (:meth:`can_mix`)."""
        self.needs_resync = set(dense) != set(rnd.weights)
        self._owed = self._owed or (self.needs_resync and rnd.reshaped)
        return not self.needs_resync

    def rebuilt(self, rnd: Round, copies: Iterable[int]) -> None:
        """Record that the sums (or the copies kept apart) were rebuilt in ``rnd`` from the
        dense public copies of ``copies``, for ``rnd``'s row of weights."""
        self._synced_at.update(dict.fromkeys(copies, rnd.index))
        self.resynced = rnd.index
        self._row = (dict(rnd.weights), rnd.self_weight)
        self._owed = False

    def can_mix(self, rnd: Round) -> bool:
        """Whether the sums hold this round's members: rebuilt once, since they last changed
        (in ``rnd`` itself when it is the change), for ``rnd``'s weights. Until then they hold
        a departed neighbour's copy, a new life's previous one, or lack a new neighbour's:
        mixing with them moved the swarm's average (0.2 a round in a ring of 4 whose peer
        came back with a new life) and left BEER's trackers off the mean direction for good
        (0.38 against a direction of 1.6)."""
        if self.resynced is None or self._owed or (rnd.reshaped and self.resynced != rnd.index):
            return False
        return self._row == (dict(rnd.weights), rnd.self_weight)


class Choco(PublicCopies):
    """CHOCO-SGD with codec ``codec`` and consensus step ``gamma`` (default: :func:`auto_gamma`).

    An unbiased codec (QSGD, ternary values) is made contractive as the theory needs:
    what it sends is scaled by ``1/(1 + ω)`` (``codec.omega``) on the sender's x̂ and
    in every receiver's s, a function of the spec and the vector's length alone, so
    both ends agree. γ ramps up over the first :data:`WARMUP_ROUNDS` rounds.

    With a ``defence`` (:mod:`gossipdl.averaging.robust`) the peer keeps every neighbour's
    public copy x̂_j apart (Algorithm 1's own form: one model-sized copy per neighbour, in
    place of s_i) and its gossip step pulls by the rule's combination of them instead of
    their weighted sum: ``x_i + γ (R(x̂_i; x̂_j) − x̂_i)``, with ``R`` the rule centred at
    the own public copy (:class:`~gossipdl.averaging.judging.Judge`; clipping, for one,
    gives ``Σ_j W_ij clip(x̂_j − x̂_i, τ)``). A Byzantine neighbour steers only its copy,
    whatever updates it sends, so the rule bounds it as it bounds a model in dense
    gossip. Costs k copies of the model (s_i's one) and a pass over them each round; a
    stale neighbour is one whose updates stopped moving its copy
    (:class:`~gossipdl.averaging.replicas.Replicas`).
    """

    name = "choco"
    sparse_arrivals = True  # a sparse q_j is added at its indices alone

    def __init__(
        self,
        codec: Codec | str = "topk:0.01",
        seed: int = 0,
        gamma: float | None = None,
        defence: Defence | None = None,
        keep_copies: bool = False,
    ):
        super().__init__(codec, seed, gamma, defence, keep_copies)
        self.x_hat: torch.Tensor | None = None
        self.s: torch.Tensor | None = None  # Σ_j W_ij x̂_j, when the copies are not kept apart
        # each neighbour's public copy x̂_j, kept apart instead of s
        self.replicas = Replicas(self.judge) if self.keeps_copies else None
        self._first: int | None = None  # the round of the first outgoing (the warm-up's start)

    def step_size(self, rnd: Round) -> float:
        """γ in round ``rnd``: the warm-up's share of it in a peer's first rounds (a lossless
        codec needs none: its x̂ is x)."""
        assert self.gamma is not None, "step_size before the first outgoing"
        if not self.codec.lossy:
            return self.gamma
        done = rnd.index - (rnd.index if self._first is None else self._first) + 1
        return self.gamma * min(1.0, done / WARMUP_ROUNDS)

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """Steps 1–2: q_i = Q(x_i − x̂_i); x̂_i += q_i; s_i += W_ii q_i."""
        self.gamma = round_gamma(self.given_gamma, self.codec, x.numel(), rnd)
        if self.x_hat is None:  # first round: the public copy starts at the starting model
            self.x_hat = self.start_copy(x)
            self.s = None if self.replicas is not None else self.x_hat * rnd.self_weight
            self.scale = 1.0 / (1.0 + self.codec.omega(x.numel()))
            self._first = rnd.index
            payload, _ = self.codec.encode(torch.zeros_like(x))
            return payload
        d = torch.sub(x, self.x_hat, out=empty_on(x.device, x.numel()))
        own = [(self.x_hat, self.scale)]
        if self.s is not None:
            own.append((self.s, rnd.self_weight * self.scale))
        if isinstance(self.codec, SparseCodec):  # add the kept values alone, in place
            payload, chosen, values = self.codec.encode_sparse(d)
            del d
            for into, alpha in own:
                into.index_add_(0, chosen, values, alpha=alpha)
        else:
            payload, values = self.codec.encode(d)
            for into, alpha in own:
                into.add_(values, alpha=alpha)
        if self.replicas is not None:
            self.replicas.own_update(values)
        return payload

    @property
    def copies(self) -> dict[int, torch.Tensor] | None:
        """Each neighbour's public copy x̂_j by id, when they are kept apart (else None)."""
        return None if self.replicas is None else self.replicas.copies

    def public_copy(self) -> Payload:
        """The dense x̂_i, for a neighbour that is rebuilding its s."""
        assert self.x_hat is not None, "public_copy before the first outgoing"
        return dense_payload(self.x_hat)

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Steps 3–4, or a rebuild of s_i (or of the copies) from dense public copies in a
        resync round."""
        assert self.x_hat is not None
        dense = self.vouched({j: a for j, a in arrived.items() if a.dense}, self.x_hat)
        if rnd.resync and self.complete(rnd, dense):
            if self.replicas is not None:
                self.replicas.rebuild({j: a.value for j, a in dense.items()})
            else:
                self.s = self.x_hat * rnd.self_weight
                for arrival in dense.values():
                    self.s.add_(arrival.value, alpha=arrival.weight)
            self.rebuilt(rnd, dense)
        if self.replicas is not None:
            self.replicas.new_round()
        for j, arrival in arrived.items():
            if not arrival.dense:
                self._add(j, arrival)
        for j, arrival in late:
            if not arrival.dense:
                self._add(j, arrival)
        if not rnd.mix or not self.can_mix(rnd):
            return x
        return self.gossip_step(x, rnd)

    def gossip_step(self, x: torch.Tensor, rnd: Round) -> torch.Tensor:
        """Step 4, ``x_i + γ (s_i − x̂_i)``; with the copies kept apart s_i is their weighted
        sum, or the defence's combination of them."""
        assert self.x_hat is not None
        return choco_step(x, self.neighbourhood(self.x_hat, rnd), self.x_hat, self.step_size(rnd))

    def neighbourhood(self, centre: torch.Tensor, rnd: Round) -> torch.Tensor:
        """s_i, or from the copies kept apart, the mix of ``centre`` with the copies of this
        round's neighbours (a defence's, when there is one)."""
        if self.replicas is None:
            assert self.s is not None
            return self.s
        return self.replicas.combine(centre, rnd)

    def _add(self, sender: int, arrival: Arrival) -> None:
        """s_i += W_ij q_j / (1+ω) (or x̂_j += q_j / (1+ω) in the copy kept apart), unless a
        later dense resync already includes q_j (or, from a neighbour of an earlier topology,
        left it out: s_i was rebuilt after it)."""
        if not after_rebuild(sender, arrival.round, self._synced_at, self.resynced):
            return
        if self.replicas is not None:
            self.replicas.add(sender, arrival.value, self.scale)
            return
        assert self.s is not None
        q = arrival.value
        alpha = arrival.weight * self.scale
        if isinstance(q, SparseVector):
            self.s.index_add_(0, q.indices, q.values, alpha=alpha)
        else:
            self.s.add_(q, alpha=alpha)
