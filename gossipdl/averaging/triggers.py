"""When a peer talks: every step, every H steps, or only when its model has drifted too far.

A trigger splits a peer's local steps into rounds of ``period`` steps; the
peer communicates at the end of each round, so every peer of a swarm agrees
on which steps end a round without exchanging a word. What happens there:

- ``always``: period 1, every round syncs (plain gossip);
- ``periodic:H``: period H, every round syncs — local SGD, H local steps
  between averaging rounds;
- ``dynamic:DELTA[:B]`` — Kamp, Adilova, Sicking, Hüger, Schlicht, Wirtz,
  Wrobel 2018, "Efficient Decentralized Deep Learning by Dynamic Model
  Averaging": period B (default 10); a peer whose local condition
  ``‖w_i − r‖² ≤ Δ`` fails raises an alarm, and the whole swarm syncs once
  it has spread to every peer, ``r`` being the model agreed at the last
  sync (the peer loop holds the protocol). While every condition holds no
  model is sent. ``DELTA`` is absolute, or relative to ``‖r‖²`` when written
  with a ``%`` suffix (``dynamic:0.5%`` means Δ = 0.005 ‖r‖²).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossipdl.averaging.base import Averager
from gossipdl.numerals import is_decimal


class TriggerError(ValueError):
    """A trigger spec that cannot be parsed."""


@dataclass(frozen=True)
class Trigger:
    """A parsed trigger spec: its round length in steps and, for ``dynamic``, the threshold Δ."""

    spec: str
    period: int = 1
    delta: float | None = None  # None: every round syncs
    relative: bool = False

    @property
    def dynamic(self) -> bool:
        """True when rounds sync only on a violated local condition."""
        return self.delta is not None

    def ends_round(self, step: int) -> bool:
        """Whether local step ``step`` (counted from 1) is the last of a round."""
        return step % self.period == 0

    def violated(self, x: torch.Tensor, reference: torch.Tensor) -> bool:
        """Kamp et al.'s local condition fails: ``‖x − r‖² > Δ`` (Δ·‖r‖² when relative)."""
        if self.delta is None:
            return True
        limit = self.delta * float(reference.square().sum()) if self.relative else self.delta
        return float((x - reference).square().sum()) > limit


def parse_trigger(spec: str) -> Trigger:
    """``always``, ``periodic:H`` or ``dynamic:DELTA[%][:B]`` as a :class:`Trigger`.

    Example:
        >>> parse_trigger("periodic:10").period
        10
        >>> t = parse_trigger("dynamic:0.5%:5"); (t.period, t.delta, t.relative)
        (5, 0.005, True)
    """
    name, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    usage = "use always, periodic:H (H >= 1) or dynamic:DELTA[:B] (DELTA >= 0, or DELTA% of ‖r‖²)"
    if name == "always" and not args:
        return Trigger(spec)
    if name == "periodic" and len(args) == 1:
        period = _positive_int(args[0], spec, usage)
        return Trigger(spec, period=period)
    if name == "dynamic" and len(args) in (1, 2):
        relative = args[0].endswith("%")
        try:
            delta = float(args[0].removesuffix("%"))
        except ValueError:
            delta = -1.0
        if not delta >= 0 or delta == float("inf"):
            raise TriggerError(f"trigger {spec!r}: DELTA {args[0]!r} is not a number >= 0; {usage}")
        period = _positive_int(args[1], spec, usage) if len(args) == 2 else 10
        return Trigger(spec, period, delta / 100 if relative else delta, relative)
    raise TriggerError(f"unknown trigger {spec!r}; {usage}")


def _positive_int(text: str, spec: str, usage: str) -> int:
    if not is_decimal(text) or int(text) < 1:
        raise TriggerError(f"trigger {spec!r}: {text!r} is not a whole number >= 1; {usage}")
    return int(text)


def check_overlap(
    overlap: bool, ring: bool, reduces_gradients: bool, asynchronous: bool, codec: str
) -> None:
    """Refuse ``overlap`` where there is nothing to overlap: gossip overlaps a round with
    the next step, a ring its gradient all-reduce with backward (every step, no PowerSGD,
    whose factors need every layer's gradient at once); a walk waits for nothing."""
    if not overlap:
        return
    if not ring and asynchronous:
        raise ValueError(
            "overlap runs a round behind the next step; a walk (gossip-learning) has no "
            "round to wait for: set overlap = false"
        )
    if ring and not reduces_gradients:
        raise ValueError(
            "overlap in a ring all-reduces gradients in buckets during backward, every step; "
            "with a periodic trigger the ring averages models: use trigger always, or "
            "overlap = false"
        )
    if ring and codec.startswith("powersgd:"):
        raise ValueError(
            f"overlap in a ring sends gradients in buckets during backward; codec {codec!r} "
            "(PowerSGD) needs every layer's gradient at once: use codec none or fp16, or "
            "overlap = false"
        )


def check_trigger(trigger: Trigger, averager: Averager) -> None:
    """Refuse a dynamic trigger for an algorithm whose peers cannot sit out a round."""
    if trigger.dynamic and not averager.supports_dynamic:
        raise TriggerError(
            f"trigger {trigger.spec!r} lets peers skip rounds, which {averager.name!r} cannot "
            f"do (every peer must apply every update); use always or periodic:H, or "
            f"algorithm dense or choco"
        )
