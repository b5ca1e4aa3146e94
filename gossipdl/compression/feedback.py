"""Error feedback: what a lossy codec did not send is added to the next message."""

from __future__ import annotations

import torch

from gossipdl.compression.base import Codec, Payload, check_vector

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Codec):
    """Error-feedback state around any codec; spec suffix ``+ef`` (e.g. ``topk:0.01+ef``).

    Seide et al. 2014 (1-bit SGD), Strom 2015, Stich, Cordonnier, Jaggi 2018
    and Karimireddy et al. 2019 (EF-SignSGD, Algorithm 1): the sender keeps a
    residual ``e`` and, for each message,

    1. ``p = x + e``             (the input plus what was not sent before),
    2. ``Δ = C(p)``              (``payload, sent = codec.encode(p)``),
    3. ``e ← p − Δ``             (the new residual, from the *same* ``p`` tensor).

    Arithmetic, not algebra: ``e`` is the float32 difference ``p − Δ`` rounded
    once. Wherever that subtraction is exact, ``sent + e == x + e_old`` holds
    bit for bit — always for sparsifiers with float32 values (an entry is sent
    as itself or not at all), for ``fp16``/``bf16`` inside their range, and for
    every entry where ``Δ`` is zero or within a factor 2 of ``p`` (Sterbenz).
    Elsewhere (``sign``, ``uniform``, ``qsgd``, ``ternary``, ``powersgd``, scaled
    ``randomk``) the identity holds up to that one rounding, at most half an
    ulp of ``|p − Δ|`` per entry and message; no float32 residual can do
    better, since for some ``(p, Δ)`` no float32 ``e`` satisfies ``Δ + e == p``.

    State: ``residual`` (None until the first call; one model-sized float32
    tensor after), reset with :meth:`reset`. The residual is kept in place:
    step 1 adds ``x`` into it and step 3 subtracts ``Δ`` from it, so error
    feedback costs two passes and no extra buffer. A change of length, device
    or dtype of ``x`` restarts from a zero residual. ``decode`` is the wrapped
    codec's: the receiver needs no state.

    Example::

        >>> import torch
        >>> from gossipdl.compression import build_codec
        >>> ef = build_codec("topk:0.5+ef")
        >>> _, sent = ef.encode(torch.tensor([1.0, -3.0, 0.5, 2.0]))
        >>> sent.tolist(), ef.residual.tolist()
        ([0.0, -3.0, 0.0, 2.0], [1.0, 0.0, 0.5, 0.0])
    """

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"ErrorFeedback wraps a Codec, got {type(codec).__name__}")
        if isinstance(codec, ErrorFeedback):
            raise ValueError("ErrorFeedback around ErrorFeedback: use one '+ef'")
        self.codec = codec
        self.spec = f"{codec.spec}+ef"
        self.lossy = codec.lossy
        self.residual: torch.Tensor | None = None

    def omega(self, numel: int) -> float:
        """The wrapped codec's ω."""
        return self.codec.omega(numel)

    def reset(self) -> None:
        """Forget the residual (e.g. after a dense resync)."""
        self.residual = None

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        x = check_vector(x)
        residual = self.residual
        # 1. p = x + e (in the residual's buffer; x + 0 the first time, so -0.0 becomes 0.0).
        if residual is None or residual.shape != x.shape or residual.device != x.device:
            p = x + 0.0
        else:
            p = residual.add_(x)
            self.residual = None  # if the codec raises, do not keep a half-updated residual
        # 2. Δ = C(p)
        payload, sent = self.codec.encode(p)
        if _shares_memory(sent, p):  # a codec that returns its input: keep Δ intact
            sent = sent.clone()
        # 3. e = p − Δ
        self.residual = p.sub_(sent)
        return payload, sent

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        return self.codec.decode(payload, numel, device)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
