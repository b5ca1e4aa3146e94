"""Split a training set among peers: iid, Dirichlet label skew, or label shards.

A spec string names the scheme:

- ``iid`` — a seeded shuffle cut into ``n`` parts whose sizes differ by at most one.
- ``dirichlet:ALPHA`` — label skew after Hsu, Qi & Brown (2019), "Measuring the
  Effects of Non-Identical Data Distribution for Federated Visual
  Classification": for each class ``c`` draw ``p_c ~ Dir(ALPHA · 1_n)`` and give
  peer ``i`` a fraction ``p_c[i]`` of the class-``c`` samples. Small ALPHA (0.1)
  gives each peer a few dominant classes; large ALPHA (100) is close to iid.
  The whole draw is repeated until every peer holds at least ``min_size``
  samples.
- ``shards:K`` — pathological skew after McMahan et al. (2017), "Communication-
  Efficient Learning of Deep Networks from Decentralized Data": sort the samples
  by label, cut them into ``n·K`` equal shards and deal ``K`` random shards to
  each peer, so a peer sees about ``K`` (at most ``2K``) classes.

Every scheme returns disjoint, sorted ``int64`` index arrays that together cover
all samples, and depends only on ``(labels, n, spec, seed)``: each peer can call
:func:`partition` itself and take its own part.
"""

from __future__ import annotations

import math

import numpy as np

from gossipdl.data.datasets import DataError

_FORMS = "'iid', 'dirichlet:ALPHA' (ALPHA > 0) or 'shards:K' (integer K >= 1)"
_DIRICHLET_MAX_TRIES = 1000


def partition(
    labels: np.ndarray, n: int, spec: str, seed: int, *, min_size: int = 10
) -> list[np.ndarray]:
    """Split the indices of ``labels`` into ``n`` disjoint parts according to ``spec``.

    Args:
        labels: 1-D integer class labels of the whole training set.
        n: number of parts (peers), ``1 <= n <= len(labels)``.
        spec: ``"iid"``, ``"dirichlet:ALPHA"`` or ``"shards:K"`` (see module doc).
        seed: non-negative seed; the same arguments always give the same parts.
        min_size: for ``dirichlet`` only, the fewest samples any part may hold.

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
    else:
        raise DataError(f"unknown partition spec {spec!r}; expected {_FORMS}")
    return [np.sort(p).astype(np.int64) for p in parts]


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


def _dirichlet(
    labels: np.ndarray,
    n: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
    spec: str,
) -> list[np.ndarray]:
    if n * min_size > len(labels):
        raise DataError(
            f"partition spec {spec!r}: n={n} parts of at least {min_size} "
            f"samples need {n * min_size} samples, have {len(labels)}"
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    smallest = 0
    for _ in range(_DIRICHLET_MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(n, alpha))
            cuts = np.round(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].append(piece)
        merged = [np.concatenate(pieces) for pieces in parts]
        smallest = min(len(m) for m in merged)
        if smallest >= min_size:
            return merged
    raise DataError(
        f"partition spec {spec!r}: after {_DIRICHLET_MAX_TRIES} draws some of "
        f"the n={n} parts still had fewer than {min_size} samples (last draw's "
        f"smallest: {smallest}); ALPHA={alpha} is too small for n={n} and "
        f"{len(labels)} samples — raise ALPHA or lower n"
    )


def _shards(labels: np.ndarray, n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    # Shuffle first so the order within a class (hence shard content) follows the seed.
    perm = rng.permutation(len(labels))
    by_label = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.array_split(by_label, n * k)
    deal = rng.permutation(n * k).reshape(n, k)
    return [np.concatenate([shards[s] for s in row]) for row in deal]
