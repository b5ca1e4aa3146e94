"""Experimental conditions a peer imposes on itself: slower compute, and data that drifts.

``slowdown`` (``PEER:FACTOR[,PEER:FACTOR...]``) makes the named peers' local
steps take FACTOR times as long, by sleeping after each step for (FACTOR − 1)
times what the step took: a straggler on the same hardware.

``drift`` (``STEP:permute[:FRACTION]``) changes the concept to learn at step
STEP: on the first FRACTION of the peers (default all) the labels of the
training and the test data go through one fixed permutation, the same on
every affected peer, so they must unlearn the old mapping (Kamp et al. 2018
study how averaging triggers react to such drift).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class ConditionError(ValueError):
    """A slowdown or drift spec that cannot be parsed."""


def parse_slowdown(spec: str) -> dict[int, float]:
    """``"3:4,5:2"`` as ``{3: 4.0, 5: 2.0}``; ``""`` as no slowdown.

    Example:
        >>> parse_slowdown("3:4")
        {3: 4.0}
    """
    result: dict[int, float] = {}
    for item in filter(None, spec.replace(" ", "").split(",")):
        peer, _, factor = item.partition(":")
        try:
            peer_id, value = int(peer), float(factor)
        except ValueError:
            peer_id, value = -1, 0.0
        if peer_id < 0 or not 1 <= value < math.inf:
            raise ConditionError(
                f"slowdown {item!r}: use PEER:FACTOR with a peer id >= 0 and FACTOR >= 1, "
                f"e.g. 3:4 (peer 3 computes 4x slower)"
            )
        result[peer_id] = value
    return result


@dataclass(frozen=True)
class Drift:
    """At ``step``, the first ``fraction`` of the peers switch to permuted labels."""

    step: int
    fraction: float = 1.0

    def affects(self, peer_id: int, peers: int) -> bool:
        """Whether ``peer_id`` (of ``peers``) drifts."""
        return peer_id % peers < round(self.fraction * peers)

    @staticmethod
    def permutation(num_classes: int, seed: int) -> np.ndarray:
        """The new label of each old label: a derangement, so every class changes meaning."""
        rng = np.random.default_rng(seed + 7777)
        while True:
            perm = rng.permutation(num_classes)
            if num_classes < 2 or not np.any(perm == np.arange(num_classes)):
                return perm


def parse_drift(spec: str) -> Drift | None:
    """``"STEP:permute[:FRACTION]"`` as a :class:`Drift`; ``""`` as none.

    Example:
        >>> parse_drift("750:permute:0.5")
        Drift(step=750, fraction=0.5)
    """
    if not spec:
        return None
    parts = spec.replace(" ", "").split(":")
    usage = f"drift {spec!r}: use STEP:permute[:FRACTION], e.g. 750:permute or 750:permute:0.5"
    if len(parts) not in (2, 3) or parts[1] != "permute" or not parts[0].isdigit():
        raise ConditionError(usage)
    try:
        fraction = float(parts[2]) if len(parts) == 3 else 1.0
    except ValueError:
        raise ConditionError(usage) from None
    if not 0 < fraction <= 1:
        raise ConditionError(f"{usage} (FRACTION in (0, 1])")
    return Drift(int(parts[0]), fraction)
