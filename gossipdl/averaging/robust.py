"""Byzantine-robust ways to combine a peer's model with its neighbours': pure functions.

Plain gossip averaging (:func:`~gossipdl.averaging.base.mix`) lets one neighbour that sends
a scaled or sign-flipped model drag every model it touches. Each rule here bounds what
one bad neighbour can do, at a stated price; all take the peer's own model ``x`` (``[n]``)
and its neighbours' models stacked as ``neighbours`` (``[k, n]``), and return a new
tensor. What a rule assumes is in its docstring: how many bad neighbours a peer may have
(``bad``), and on which graphs the guarantee holds.

- :func:`clipped_mix`: self-centred clipping (He, Karimireddy & Jaggi 2022, "Byzantine-
  robust decentralized learning via ClippedGossip"), with :func:`auto_radius`.
- :func:`trimmed_mean` and :func:`coordinate_median`: coordinate-wise, over the peer and
  its neighbours.
- :func:`balance`: BALANCE's distance filter (Fang et al. 2024).
- :func:`descent_scores`: whether moving towards a neighbour follows the peer's own
  descent (a first-order form of the loss test of Zeno and UBAR), which any rule can put
  in front of it (``+descent``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from gossipdl.compression._kernels import beside


def distances(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Each neighbour's Euclidean distance to ``x`` (``[k]``, float64 sums): what the rules
    below judge by, and what a peer records per neighbour to tell which one looks wrong."""
    return torch.linalg.vector_norm((neighbours - x).double(), dim=1)


def auto_radius(gaps: torch.Tensor, bad: int = 1) -> float:
    """The clipping radius that clips the ``bad`` farthest neighbours to the distance of the
    next one: the ``(bad + 1)``-th largest of ``gaps`` (the reference implementation's
    choice for one bad neighbour: the second largest distance). With at most ``bad`` bad
    neighbours, the radius lies between honest neighbours' distances (at most the largest
    of them, at least the smallest: it may be a bad one's that sits among them), whatever
    the bad ones send; 0 when there are no more neighbours than bad ones (nobody is
    trusted)."""
    if bad < 0:
        raise ValueError(f"bad = {bad}; the number of bad neighbours is at least 0")
    if gaps.numel() <= bad:
        return 0.0
    return float(torch.topk(gaps, bad + 1).values[-1])


def clipped_mix(
    x: torch.Tensor,
    neighbours: torch.Tensor,
    weights: torch.Tensor,
    self_weight: float,
    radius: float | None = None,
    bad: int = 1,
    gaps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-centred clipping: ``W_ii x + Σ_j W_ij (x + clip(x_j − x, τ))``, where
    ``clip(z, τ) = z · min(1, τ/‖z‖)``; ``τ`` is ``radius``, or :func:`auto_radius` of the
    neighbours' distances for ``bad`` bad neighbours.

    Assumes: each peer has at most ``bad`` bad neighbours, and those carry a small share of
    its row of W (the paper's bound needs the bad weight well below the graph's spectral
    gap). A bad neighbour j then moves x by at most ``W_ij τ``, and ``τ`` is an honest
    neighbour's distance: as the honest models agree, τ shrinks and so does what a bad
    neighbour can do. Cost: the k distances (one pass over the neighbours' models) and a
    sort of k numbers; with no attack and ``τ`` at least the largest distance it is plain
    gossip (an honest far neighbour is slowed, not cut off). ``gaps``: the neighbours'
    :func:`distances`, where the caller has them already.
    """
    gaps = distances(x, neighbours) if gaps is None else gaps
    if radius is None:
        radius = auto_radius(gaps, bad)
    scale = beside(torch.where(gaps > radius, radius / gaps.clamp_min(1e-30), 1.0), x)
    pull = ((neighbours - x) * (beside(weights, x) * scale).unsqueeze(1)).sum(0)
    kept = self_weight + float(weights.sum())
    return x * kept + pull


def trimmed_mean(x: torch.Tensor, neighbours: torch.Tensor, trim: int = 1) -> torch.Tensor:
    """Coordinate-wise trimmed mean over the peer and its neighbours: in every coordinate
    the ``trim`` largest and ``trim`` smallest values are dropped and the rest averaged.

    Assumes: at most ``trim`` bad neighbours, and at least ``2·trim + 1`` values in all;
    each output coordinate then lies between honest values of that coordinate. Ignores
    the mixing weights (each kept value counts alike), so on irregular graphs it does not
    keep the swarm's average. Cost: a sort of k + 1 values per coordinate."""
    stacked = torch.cat([x.unsqueeze(0), neighbours])
    count = stacked.shape[0]
    if trim < 0 or count <= 2 * trim:
        raise ValueError(
            f"trim = {trim} of {count} values leaves none; a trimmed mean needs "
            f"more than 2·trim values (the peer and its neighbours)"
        )
    return _kept_mean(torch.sort(stacked, dim=0).values, trim)


def _kept_mean(ordered: torch.Tensor, trim: int) -> torch.Tensor:
    """The mean of each coordinate's sorted values (``ordered``, ``[count, n]``) without the
    ``trim`` smallest and largest: a trimmed mean, and the median at ``(count − 1) // 2``."""
    return ordered[trim : ordered.shape[0] - trim].mean(0)


def coordinate_median(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the peer and its neighbours (the mean of the two middle
    values when there is an even number).

    Assumes: fewer than half of the values are bad; each output coordinate then lies
    between honest values. Like :func:`trimmed_mean` it ignores the mixing weights, and
    on non-IID data the median of honest models is biased towards the majority. Cost: a
    sort of k + 1 values per coordinate."""
    stacked = torch.cat([x.unsqueeze(0), neighbours])
    return _kept_mean(torch.sort(stacked, dim=0).values, (stacked.shape[0] - 1) // 2)


ACCEPT_RATIO = 2.0
"""BALANCE also accepts a neighbour within this many times the neighbourhood's median
distance, while it hears most of its neighbours: see :func:`balance`."""


def balance(
    x: torch.Tensor,
    neighbours: torch.Tensor,
    weights: torch.Tensor,
    progress: float,
    gamma: float = 0.5,
    kappa: float = 1.0,
    gaps: torch.Tensor | None = None,
    limit: float = math.inf,
    x_norm: float | None = None,
    majority: bool = True,
    middle: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BALANCE's distance filter (Fang, Zhang, Yuan, Li and Gong 2024): a neighbour's model
    is accepted when ``‖x − x_j‖ ≤ γ · exp(−κ · progress) · ‖x‖`` (``progress`` runs from
    0 at the start of training to 1 at its end, so the filter tightens as the models
    settle). The accepted ones are mixed with their gossip ``weights``, scaled so that
    they carry the rejected ones' weight too: ``x + c Σ_accepted W_ij (x_j − x)``,
    ``c = Σ_j W_ij / Σ_accepted W_ij`` over the neighbours that sent. Returns the new
    model and the accepted mask.

    The paper mixes ``α x + (1 − α) · mean(accepted)`` with α = 1/2. Keeping the row's
    weights makes the filter cost nothing when it accepts everyone (it is then plain
    gossip); α = 1/2 cost 1.3 points with no attack on the exponential graph of 16.
    Like the paper's mean over the accepted, a rejected neighbour's weight goes to the
    others: left on the peer (as a missing neighbour's is, to keep the average), two
    rejected liars slowed the mixing of their neighbours, 1 point lost on that graph
    and 8 on a 4-regular one with Dirichlet shards. The rows then no longer sum the
    pairs alike, so the honest peers' average may move a little.

    With ``majority`` (the models are more than half of the peer's neighbours', two at
    least, and none was set aside before the rule saw them), a neighbour within
    :data:`ACCEPT_RATIO` times the median distance of the neighbourhood (the peer's own 0
    among it) is accepted too, however far that is against γ‖x‖. On label-skewed shards
    honest models sit beyond γ‖x‖ of each other, and the paper's bound alone split a swarm
    into camps that rejected each other to the end, a peer holding one or two classes
    training alone: 8 peers, synthetic blobs, Dirichlet(0.1) shards, 150 steps, no
    attack, the ring, exponential and 4-regular graphs, seeds 0–2: mean accuracy 0.50–0.89
    (0.50–0.60 on the ring) against 0.88–0.89 with this test, what plain averaging gets.
    The peer whose own model is the odd one (an honest outlier, or one back from a
    restart with a stale model, far from every neighbour) accepts them all and moves most
    of the way to them in one round. Before, it took the model of the neighbour nearest
    the rest once they agreed, and one other outlier among its neighbours stopped that:
    it drifted further each round and was evicted (fault seeds 82581, 82598).

    Assumes: fewer than half of a peer's neighbours bad, and honest neighbours within γ‖x‖
    or twice the median neighbour's distance of the peer; a bad one beyond both has no
    influence at all, an accepted one moves ``x`` by at most ``c W_ij`` times the bound.
    Without ``majority`` (liars may be most of what arrived) only γ‖x‖ counts. Cost: the
    k distances (``gaps``, where the caller has them) and one norm.

    ``limit`` caps the threshold (``Defence``'s RHO times the median neighbour's distance);
    ``x_norm`` is ``‖x‖`` and ``middle`` the neighbourhood's median distance (the peer's
    0 among it), where the caller has them."""
    factor = gamma * math.exp(-kappa * progress)
    if x_norm is None:
        x_norm = float(torch.linalg.vector_norm(x.double()))
    gaps = distances(x, neighbours) if gaps is None else gaps
    near = 0.0
    if majority and gaps.numel() >= 2:
        near = ACCEPT_RATIO * (median_gap([0.0, *gaps.tolist()]) if middle is None else middle)
    accepted = gaps <= min(limit, max(factor * x_norm, near))
    if not bool(accepted.any()):
        return x.clone(), accepted
    share = beside(weights, x) * beside(accepted, x)
    share *= weights.sum() / share.sum()
    return x + share @ (neighbours - x), accepted


def descent_scores(
    update: torch.Tensor, before: torch.Tensor, neighbours: torch.Tensor
) -> torch.Tensor:
    """For each neighbour (``[k]``, float64), the cosine between the peer's own update since
    its last mix (``update``: its model now minus ``before``, the model that mix left) and
    the neighbour's model's offset from ``before``: positive where moving towards the
    neighbour goes the way the peer's own data took it, negative where it undoes that.

    A first-order loss test (Zeno, Xie et al. 2019; UBAR's performance stage, Guo et al.
    2021) that needs no evaluation: moving x by ``t·(x_j − x)`` changes the peer's loss by
    about ``t·⟨∇f, x_j − x⟩``, and the own update is a smoothed ``−∇f``. A model trained
    on flipped labels went the other way round after round, and sits behind the peer
    along its descent however close it stays. It is a noisy signal: 16 peers, 4-regular,
    iid shards, two label flippers, mean scores over 150-step windows of the first 600
    steps: a liar's −0.68 to −0.13 (below −0.4 in 23 of 32 windows), an honest
    neighbour's −0.77 to +0.52 (below −0.4 in 52 of 224). Hence ``+descent`` sets aside
    only neighbours that are also farther than the median one. Cost: one pass over the
    neighbours' models and the peer's last mixed model (kept by the caller)."""
    offsets = (neighbours - before).double()
    own = update.double()
    lengths = torch.linalg.vector_norm(offsets, dim=1) * torch.linalg.vector_norm(own)
    return (offsets @ own) / lengths.clamp_min(1e-30)


def median_gap(gaps: torch.Tensor | Sequence[float]) -> float:
    """The median neighbour's distance, the mean of the two middle ones for an even count:
    what RHO and ``+descent`` measure a neighbour against. The lower middle one instead let
    two neighbours whose models had become the peer's own (distance 0) reject every other
    under RHO: on a 4-regular graph with Dirichlet(0.3) shards, three honest peers shut
    themselves in for good.

    Worked out on the host, to the bit what ``torch.quantile(gaps, 0.5)`` gives (its
    interpolation, ``hi − (hi − lo)·0.5``; NaN if any is): a handful of values, where
    ``quantile`` took a tenth of a defended batched round (0.2 ms a call).

    Example:
        >>> median_gap([3.0, 1.0, 2.0, 10.0]), median_gap(torch.tensor([4.0, 1.0, 9.0]))
        (2.5, 4.0)
    """
    values = gaps.tolist() if isinstance(gaps, torch.Tensor) else list(gaps)
    if any(math.isnan(v) for v in values):
        return math.nan
    values.sort()
    low, high = values[(len(values) - 1) // 2], values[len(values) // 2]
    return high - (high - low) * 0.5


EVICT_RATIO = 6.0
"""How many times as far as the neighbourhood's median distance a neighbour the defence
set aside must sit for that round to count against it (eviction, :func:`outlying`)."""


def outlying(gaps: torch.Tensor, middle: float | None = None) -> torch.Tensor:
    """Which neighbours sit more than :data:`EVICT_RATIO` times as far from the peer as the
    median of the neighbourhood, the peer itself (distance 0) among it (``middle``, where
    the caller has it): only those may be evidence for eviction. Counting the peer keeps
    the test alive with two neighbours.

    An absolute bound is not enough: on Dirichlet(0.1) shards honest peers holding one or
    two classes sit beyond BALANCE's γ‖x‖ and clipping's radius round after round, and
    every neighbour agrees (8 peers, synthetic blobs, no attack, ``evict_after`` 5: 8 of 9
    swarms evicted honest peers with BALANCE, 1 of 9 with clipping; none with this test).
    The attacks eviction is for sit 13x the median or more (sign flip, scaled, Gaussian,
    IPM; 16 peers, means over 1500 steps; honest neighbours 3.7x at most). It is no proof:
    with the 1-D CNN on Dirichlet(0.1) shards an honest peer sat over 15x the median for
    140 rounds in a row early in training.

    Example:
        >>> outlying(torch.tensor([1.0, 1.2, 9.0])).tolist()
        [False, False, True]
    """
    if middle is None:
        middle = median_gap([0.0, *gaps.tolist()])
    return gaps > EVICT_RATIO * middle


def nearest_to_rest(models: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The row of ``models`` ``[k, n]`` with the least summed distance to the others (the
    medoid: a few far rows cannot move it), and its distances to each row (float64)."""
    wide = models.double()
    apart = torch.cdist(wide, wide)
    nearest = int(apart.sum(1).argmin())
    return nearest, apart[nearest]


DEFENCES = "none, clip[:BAD], trimmed[:TRIM], median, balance[:GAMMA[:RHO]], each +descent[:TAU]"
DESCENT_TAU = 0.4
"""``+descent``'s default: a neighbour farther than the median one is set aside while its
running descent score is below −0.4. With −0.3 honest neighbours on Dirichlet(0.3) shards
were set aside often enough to cost 1.8 and 2.6 points with no attack (exponential and
4-regular graphs of 16); with −0.4, 0.4 and 1.0 in one run and 1.0 and 1.1 in the next,
and it held label flipping as well."""
EVICTING_RULES = ("clip", "balance")
"""The defences eviction (``evict_after``) counts rounds under: they set a bad model's pull
aside nearly whole, while the coordinate-wise rules set part of every model aside."""


class Judgement(NamedTuple):
    """What a defence made of one round's models (:meth:`Defence.judge`): the new model,
    each neighbour's distance, the share of its model set aside, and the share that counts
    against it (eviction)."""

    model: torch.Tensor
    gaps: torch.Tensor
    aside: torch.Tensor
    evidence: torch.Tensor


@dataclass(frozen=True)
class Defence:
    """A ``defence`` setting: which rule combines the neighbours' models, and its number
    (clip: bad neighbours assumed; trimmed: values trimmed per side; balance: γ).

    BALANCE's ``rho`` (``balance:GAMMA:RHO``; 0, the default, is off) also rejects a
    neighbour more than RHO times as far as the median neighbour, however small that is
    against γ‖x‖. A model trained on flipped labels stays well inside γ‖x‖, but once the
    honest models agree it sits 5-90x as far from a peer as the median neighbour (16
    peers, iid shards, from about step 900 of 1500; honest ones within 1.4x). On
    Dirichlet shards an honest outlier spreads as far early on, and RHO 2 rejected honest
    ones there (README *Misbehaving peers*). Assumes fewer than half of a peer's
    neighbours bad (the median is an honest one's) and three or more neighbours (with
    two it is not applied).

    ``descent`` (``+descent[:TAU]`` after any rule; 0, the default, is off) sets a
    neighbour aside while its running :func:`descent_scores` is below −TAU, before the rule
    sees the models (its weight shared among the rest, as a stale model's), but only one
    farther than the median neighbour. The peer's judge
    (:class:`~gossipdl.averaging.judging.Judge`) remembers where its own move is measured
    from (dense gossip: its model after each mix; CHOCO and BEER: its public copy) and
    each neighbour's score over the last rounds. Assumes that an honest
    neighbour's model lies, on average, no further back along the peer's own descent than
    the peer itself; on Dirichlet(0.3) shards honest neighbours whose classes differ score
    as low as label flippers at times, and setting them aside slows mixing (README
    *Misbehaving peers* gives what it cost)."""

    rule: str
    param: float
    rho: float = 0.0
    descent: float = 0.0

    def judge(
        self,
        x: torch.Tensor,
        neighbours: torch.Tensor,
        weights: torch.Tensor,
        kept: float,
        steps: int = 1,
        gaps: torch.Tensor | None = None,
        x_norm: float | None = None,
        majority: bool = True,
    ) -> Judgement:
        """The new model from ``x`` and the neighbours' models that arrived (``[k, n]``, their
        mixing ``weights``; ``kept``: the row's weight left on the peer, a missing
        neighbour's included), each neighbour's :func:`distances` to ``x``, and how much of
        each one's model the rule set aside (``[k]``, 0..1: clipping the share of its pull
        clipped away, ``1 − τ/‖x_j − x‖``; BALANCE 1 for a model rejected; the
        coordinate-wise rules the share of its coordinates outside the values they kept),
        which a peer records so a report can show which neighbour looks wrong; and how much
        of it counts as evidence against the neighbour (eviction): the same, but only for a
        neighbour far beyond the neighbourhood (:func:`outlying`), and not for a model
        BALANCE rejected by RHO alone, which on non-IID shards an honest outlier draws (an
        exponential graph of 16, Dirichlet(0.3) shards, ``balance:0.5:3`` with
        ``evict_after`` 10: an honest peer was evicted). The distances and the sort are
        done once for all.

        Clipping and BALANCE use the weights; the coordinate-wise rules count every model
        alike. BALANCE runs without its schedule (progress 0): a peer does not know
        how long training lasts. Its γ grows as √``steps``, the local steps since the
        peer last took a neighbour's model in: honest models drift apart between mixings,
        and a round in which it rejected every model is none (a ring of 8,
        fault seed 20115's job, at its end: 0.19 apart syncing every step, 0.46 every 3rd,
        0.78 every 6th, 1.29 every 12th, against γ‖x‖ = 3.3). Early in training, when ‖x‖
        is small and the steps large, γ alone rejected every honest neighbour of a dynamic
        trigger's syncs 14 steps apart, and one was evicted. Counted from its last
        judged round instead, a ring peer that heard one neighbour of two a round (during a
        partition: too few for the median) rejected it by γ‖x‖ round after round, trained
        alone on a one-class shard and was evicted (fault seed 62783). The cost: a liar
        that is all a peer hears is taken in once γ√s‖x‖ reaches it, a sign-flipped model
        (2‖x‖ away, γ 0.5) after 16 such rounds, a scaled one (×100) after 40,000. When
        neighbours are missing and fewer values are left than a coordinate-wise rule needs
        to outvote its bad ones (``2·TRIM + 1`` for a trimmed mean, 3 for the median), the
        peer keeps its own model that round, as clipping does with no more neighbours than
        bad ones: trimming what it could let a lone liar in at half the weight. ``gaps``:
        the neighbours' :func:`distances`, and ``x_norm``: ``‖x‖``, where the caller has
        them. ``majority``: these are most of the peer's neighbours and none was set aside
        before the rule saw them, so BALANCE may go by their median (:func:`balance`)."""
        gaps = distances(x, neighbours) if gaps is None else gaps
        middle = median_gap([0.0, *gaps.tolist()])  # the neighbourhood's, the peer among it
        if self.rule == "clip":
            radius = auto_radius(gaps, int(self.param))
            model = clipped_mix(x, neighbours, weights, kept, radius=radius, gaps=gaps)
            aside = (1.0 - radius / gaps.clamp_min(1e-30)).clamp_min(0.0)
            return Judgement(model, gaps, aside, aside * outlying(gaps, middle))
        if self.rule == "balance":
            gamma = self.param * math.sqrt(steps)
            if x_norm is None:  # one pass, for both bounds
                x_norm = float(torch.linalg.vector_norm(x.double()))
            limit = self._relative_limit(gaps)
            model, accepted = balance(
                x, neighbours, weights, 0.0, gamma=gamma, gaps=gaps, limit=limit,
                x_norm=x_norm, majority=majority, middle=middle,
            )  # fmt: skip
            beyond = (gaps > gamma * x_norm) & outlying(gaps, middle)
            return Judgement(model, gaps, (~accepted).double(), (~accepted & beyond).double())
        count = neighbours.shape[0] + 1
        trim = int(self.param) if self.rule == "trimmed" else (count - 1) // 2
        if count < (2 * trim + 1 if self.rule == "trimmed" else 3):  # too few to outvote the bad
            whole = torch.ones_like(gaps)
            return Judgement(x.clone(), gaps, whole, torch.zeros_like(gaps))
        ordered = torch.sort(torch.cat([x.unsqueeze(0), neighbours]), dim=0).values
        low, high = ordered[trim], ordered[count - 1 - trim]
        aside = ((neighbours < low) | (neighbours > high)).double().mean(1)
        return Judgement(_kept_mean(ordered, trim), gaps, aside, aside)

    @property
    def least_neighbours(self) -> int:
        """The fewest neighbours with which this rule ever takes a neighbour's model in
        (:meth:`judge`): clipping more than BAD (with BAD or fewer its radius is 0), a
        trimmed mean 2·TRIM (the peer and they must be 2·TRIM + 1 values), the median 2
        (3 values); BALANCE and a trimmed mean of TRIM 0 one. A peer with fewer keeps its
        own model every round and never mixes, attack or not (8 peers on a star or the
        one-peer exponential graph: consensus distance 4.69 against plain gossip's 0.002),
        so a config whose graph gives a peer fewer is refused.

        Example:
            >>> [parse_defence(s).least_neighbours for s in ("clip:2", "trimmed", "median")]
            [3, 2, 2]
        """
        if self.rule == "clip":
            return int(self.param) + 1
        if self.rule == "trimmed":
            return max(1, 2 * int(self.param))
        if self.rule == "median":
            return 2
        return 1

    def _relative_limit(self, gaps: torch.Tensor) -> float:
        """BALANCE's second bound: RHO times the :func:`median_gap` (three or more
        neighbours; none without RHO)."""
        if not self.rho or gaps.numel() < 3:
            return math.inf
        return self.rho * median_gap(gaps)


def parse_defence(spec: str) -> Defence | None:
    """``spec`` as a :class:`Defence` (None for ``none``); ValueError naming the forms.

    Example:
        >>> parse_defence("clip:2"), parse_defence("none")
        (Defence(rule='clip', param=2.0, rho=0.0, descent=0.0), None)
        >>> parse_defence("balance:0.5:2+descent")
        Defence(rule='balance', param=0.5, rho=2.0, descent=0.4)
    """
    usage = f"defence = {spec!r}; use one of {DEFENCES}"
    rule, plus, extra = spec.partition("+")
    descent = _descent(extra, usage) if plus else 0.0
    defence = _rule(rule, usage)
    if defence is None:
        if descent:
            raise ValueError(f"{usage} (+descent goes after a rule, e.g. balance+descent)")
        return None
    return replace(defence, descent=descent)


def _descent(spec: str, usage: str) -> float:
    """TAU of a ``descent[:TAU]`` suffix (:data:`DESCENT_TAU` without one), in (0, 1]."""
    name, *args = spec.split(":")
    if name != "descent" or len(args) > 1:
        raise ValueError(usage)
    try:
        tau = float(args[0]) if args and args[0] else DESCENT_TAU
    except ValueError:
        raise ValueError(usage) from None
    if not 0 < tau <= 1:
        raise ValueError(f"{usage} (descent's TAU is a cosine in (0, 1])")
    return tau


def _rule(spec: str, usage: str) -> Defence | None:
    """The rule part of a defence setting (before any ``+``)."""
    name, *args = spec.split(":")
    # each rule's default number and how many numbers it takes (balance: γ and RHO)
    forms = {"clip": (1.0, 1), "trimmed": (1.0, 1), "median": (0.0, 0), "balance": (0.5, 2)}
    if name == "none" and not args:
        return None
    if name not in forms or len(args) > forms[name][1]:
        raise ValueError(usage)
    number, relative = [*args, "", ""][:2]
    try:
        value = float(number) if number else forms[name][0]
        rho = float(relative) if relative else 0.0
    except ValueError:
        raise ValueError(usage) from None
    whole = name in ("clip", "trimmed")
    if not math.isfinite(value) or value < 0 or (whole and not value.is_integer()):
        raise ValueError(f"{usage} ({name}'s number is a {'count' if whole else 'γ'} >= 0)")
    if not (rho == 0 or (math.isfinite(rho) and rho >= 1)):
        raise ValueError(f"{usage} (RHO is 0, off, or at least 1: the median neighbour passes)")
    return Defence(name, value, rho)
