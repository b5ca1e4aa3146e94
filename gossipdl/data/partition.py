"""Split a training set among peers: iid, Dirichlet label skew, or label shards.

A spec string names the scheme:

- ``iid`` — a seeded shuffle cut into ``n`` parts whose sizes differ by at most one.
- ``dirichlet:ALPHA`` — label skew after Hsu, Qi & Brown (2019), "Measuring the
  Effects of Non-Identical Data Distribution for Federated Visual
  Classification": for each class ``c`` draw ``p_c ~ Dir(ALPHA · 1_n)`` and give
  peer ``i`` a fraction ``p_c[i]`` of the class-``c`` samples. Small ALPHA (0.1)
  gives each peer a few dominant classes; large ALPHA (100) is close to iid.
  The whole draw is repeated (up to ten times) until every peer holds at least
  ``min_size`` samples; after that, the last draw's short parts are topped up
  with random samples of the parts with the most to spare (thousands of peers
  rarely all reach ``min_size`` in any draw, and the label skew is kept for all
  but the few samples moved).
- ``shards:K`` — pathological skew after McMahan et al. (2017), "Communication-
  Efficient Learning of Deep Networks from Decentralized Data": sort the samples
  by label, cut them into ``n·K`` equal shards and deal ``K`` random shards to
  each peer, so a peer sees about ``K`` classes (at most ``2K`` when every class fills
  at least one shard; with fewer shards than classes, ``n·K`` below their number, a
  shard spans several classes and a peer sees more).
- ``natural`` — by the samples' natural owners (LEAF's writers and speakers,
  Synthetic(α, β)'s devices): each part holds whole owners, with the sample counts
  they have.
- ``powerlaw:A`` — iid labels but skewed sizes, as real fleets' devices hold (LEAF;
  Li et al. 2020, FedProx): each part's share of the samples above ``min_size`` is
  drawn from a Pareto distribution of shape ``A`` (smaller: more skewed; 1.5 makes
  a few peers hold most of the data).

Every scheme returns disjoint, sorted ``int64`` index arrays that together cover
all samples, and depends only on ``(labels, n, spec, seed)``: each peer can call
:func:`partition` itself and take its own part.
"""

from __future__ import annotations

import math

import numpy as np

from gossipdl.data.datasets import DataError

_FORMS = (
    "'iid', 'dirichlet:ALPHA' (ALPHA > 0), 'shards:K' (integer K >= 1), 'powerlaw:A' (A > 0) "
    "or 'natural' (by the samples' owners)"
)
_DIRICHLET_DRAWS = 10


def partition(
    labels: np.ndarray,
    n: int,
    spec: str,
    seed: int,
    *,
    min_size: int = 10,
    owners: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Split the indices of ``labels`` into ``n`` disjoint parts according to ``spec``.

    Args:
        labels: 1-D integer class labels of the whole training set.
        n: number of parts (peers), ``1 <= n <= len(labels)``.
        spec: ``"iid"``, ``"dirichlet:ALPHA"``, ``"shards:K"`` or ``"powerlaw:A"`` (see
            module doc).
        seed: non-negative seed; the same arguments always give the same parts.
        min_size: for ``dirichlet`` and ``powerlaw``, the fewest samples any part holds.
        owners: for ``natural``, each sample's owner (a LEAF writer or speaker): every
            part gets whole owners, dealt in a seeded order (one each when ``n`` is
            their number).

    Returns:
        ``n`` sorted ``int64`` index arrays, disjoint, covering ``range(len(labels))``.

    Raises:
        DataError: unknown or malformed spec, or ``n`` / ALPHA / K that cannot
            be satisfied for this many samples.

    Example:
        >>> import numpy as np
        >>> parts = partition(np.repeat(np.arange(4), 25), 4, "shards:1", seed=0)
        >>> [len(np.unique(np.repeat(np.arange(4), 25)[p])) for p in parts]
        [1, 1, 1, 1]
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"labels must be a 1-D integer array, got dtype {labels.dtype} shape {labels.shape}"
        )
    num = len(labels)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= num:
        raise DataError(
            f"number of parts n={n!r} must be an integer in [1, {num}] (the number of samples)"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed={seed!r} must be a non-negative integer")
    n = int(n)
    rng = np.random.default_rng(int(seed))
    if not isinstance(spec, str):
        raise DataError(f"partition spec must be a string, got {spec!r}; expected {_FORMS}")
    name, _, arg = spec.partition(":")
    if spec == "iid":
        parts = _iid(num, n, rng)
    elif name == "dirichlet":
        alpha = _parse_alpha(spec, arg)
        parts = _dirichlet(labels, n, alpha, min_size, rng, spec)
    elif name == "shards":
        k = _parse_k(spec, arg)
        if n * k > num:
            raise DataError(
                f"partition spec {spec!r} with n={n} needs n*K={n * k} shards "
                f"but there are only {num} samples"
            )
        parts = _shards(labels, n, k, rng)
    elif spec == "natural":
        parts = _natural(owners, n, rng)
    elif name == "powerlaw":
        shape = _parse_alpha(spec, arg)
        _check_room(spec, n, min_size, num)
        parts = _powerlaw(num, n, shape, min_size, rng)
    else:
        raise DataError(f"unknown partition spec {spec!r}; expected {_FORMS}")
    return [np.sort(p).astype(np.int64) for p in parts]


def _natural(owners: np.ndarray | None, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each part a set of whole owners: the owners shuffled, then dealt round robin."""
    if owners is None:
        raise DataError(
            "partition 'natural' splits by the samples' owners (writers, speakers), which "
            "only femnist, shakespeare and synthetic-fedprox have; use iid, dirichlet:ALPHA, "
            "shards:K or powerlaw:A"
        )
    users = np.unique(owners)
    if n > len(users):
        raise DataError(
            f"partition 'natural': {len(users)} owners cannot fill {n} parts; use at most "
            f"{len(users)} peers, or another partition"
        )
    dealt = rng.permutation(users)
    part_of = np.empty(int(users.max()) + 1, dtype=np.int64)
    part_of[dealt] = np.arange(len(dealt)) % n
    which = part_of[owners]
    return [np.flatnonzero(which == i) for i in range(n)]


def _parse_alpha(spec: str, arg: str) -> float:
    try:
        alpha = float(arg)
    except ValueError:
        alpha = math.nan
    if not math.isfinite(alpha) or alpha <= 0:
        raise DataError(
            f"partition spec {spec!r}: ALPHA must be a finite number > 0, "
            f"got {arg!r}; expected {_FORMS}"
        )
    return alpha


def _parse_k(spec: str, arg: str) -> int:
    try:
        k = int(arg)
    except ValueError:
        k = 0
    if k < 1:
        raise DataError(
            f"partition spec {spec!r}: K must be an integer >= 1, got {arg!r}; expected {_FORMS}"
        )
    return k


def _iid(num: int, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(num), n))


def _check_room(spec: str, n: int, min_size: int, num: int) -> None:
    if n * min_size > num:
        raise DataError(
            f"partition spec {spec!r}: n={n} parts of at least {min_size} "
            f"samples need {n * min_size} samples, have {num}"
        )


def _dirichlet(
    labels: np.ndarray,
    n: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
    spec: str,
) -> list[np.ndarray]:
    _check_room(spec, n, min_size, len(labels))
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    merged: list[np.ndarray] = []
    for _ in range(_DIRICHLET_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(n, alpha))
            cuts = np.round(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].append(piece)
        merged = [np.concatenate(pieces) for pieces in parts]
        if min(len(m) for m in merged) >= min_size:
            return merged
    return _top_up(merged, min_size, rng)


def _top_up(parts: list[np.ndarray], min_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Parts below ``min_size`` filled up with random samples of the others' surplus over it,
    taken from each in proportion to that surplus (the caller checked there is enough)."""
    sizes = np.array([len(p) for p in parts])
    need = np.maximum(min_size - sizes, 0)
    spare = np.maximum(sizes - min_size, 0)
    give = np.floor(need.sum() * spare / spare.sum()).astype(np.int64)
    short = need.sum() - give.sum()  # what rounding down left: one more from the largest
    give[np.argsort(-spare, kind="stable")[:short]] += 1
    given = []
    for donor in np.flatnonzero(give):
        order = rng.permutation(len(parts[donor]))
        given.append(parts[donor][order[: give[donor]]])
        parts[donor] = parts[donor][order[give[donor] :]]
    pool = rng.permutation(np.concatenate(given))
    for short, extra in enumerate(np.split(pool, np.cumsum(need)[:-1])):
        if len(extra):
            parts[short] = np.concatenate([parts[short], extra])
    return parts


def _powerlaw(
    num: int, n: int, shape: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    # rng.pareto(shape) + 1 is exp(E / shape) for a standard exponential E, drawn the same
    # way; a small shape overflows that to inf, so then the weights are scaled in log space
    log_weights = rng.standard_exponential(n) / shape
    with np.errstate(over="ignore"):
        weights = np.expm1(log_weights) + 1.0
        if not np.isfinite(weights.sum()):
            weights = np.exp(log_weights - log_weights.max())
    rest = num - n * min_size
    extra = np.floor(rest * weights / weights.sum()).astype(np.int64)
    extra[np.argsort(-weights, kind="stable")[: rest - int(extra.sum())]] += 1
    cuts = np.cumsum(min_size + extra)[:-1]
    return list(np.split(rng.permutation(num), cuts))


def _shards(labels: np.ndarray, n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    # Shuffle first so the order within a class (hence shard content) follows the seed.
    perm = rng.permutation(len(labels))
    by_label = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.array_split(by_label, n * k)
    deal = rng.permutation(n * k).reshape(n, k)
    return [np.concatenate([shards[s] for s in row]) for row in deal]
