"""Floating-point value codecs: ``none`` (float32, lossless), ``fp16`` and ``bf16``.

Each also encodes the kept values of a sparsifier (``topk:0.01+fp16``).
"""

from __future__ import annotations

import numpy as np
import torch

from gossipdl.compression._kernels import from_host, to_host
from gossipdl.compression.base import (
    Layout,
    Payload,
    ValueCodec,
    check_layout,
    check_numel,
    check_vector,
)

__all__ = ["BFloat16", "Float16", "Identity"]

_FP16_MAX = 65504.0


class Identity(ValueCodec):
    """``none`` (alias ``dense``): the float32 values as they are; lossless.

    Payload: one float32 array of ``n`` values, empty meta; ``4n + 1`` bytes.

    Example::

        >>> import torch
        >>> codec = Identity()
        >>> payload, sent = codec.encode(torch.arange(3.0))
        >>> payload.nbytes, sent.tolist()
        (13, [0.0, 1.0, 2.0])
    """

    spec = "none"
    lossy = False
    n_arrays = 1

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        array = to_host(v)
        if v.device.type == "cpu":  # to_host shared x's memory; the payload must own its bytes
            array = array.copy()
        estimate = v.clone()
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("float32", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "none", self.layout(numel))
        device = torch.device(device)
        if values.flags.writeable:
            return torch.from_numpy(values).to(device, copy=True)
        return from_host(values, device)  # copies the read-only buffer


class Float16(ValueCodec):
    """``fp16``: IEEE half precision, round to nearest even; 2 bytes per value.

    Values beyond the half range (|x| > 65504, including ±inf) are clamped to
    ±65504 rather than sent as infinities; NaN stays NaN. Relative error per
    value is at most 2^-11 inside the normal range (|x| >= 6.1e-5); smaller
    values keep an absolute precision of 2^-25.

    Payload: one float16 array of ``n`` values, empty meta; ``2n + 1`` bytes.
    """

    spec = "fp16"
    n_arrays = 1

    def contraction(self, numel: int) -> float:
        """1: rounding to half precision keeps all but ~2⁻¹⁶ of ``‖x‖²``."""
        return 1.0

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        half = v.half()
        if half.numel():
            lo, hi = torch.aminmax(half)
            if bool(torch.isinf(lo) | torch.isinf(hi)):
                half = v.clamp(-_FP16_MAX, _FP16_MAX).half()
        estimate = half.float()
        array = to_host(half)  # shares memory with ``half`` on CPU, which nothing else holds
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("float16", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "fp16", self.layout(numel))
        device = torch.device(device)
        return from_host(values, device).float()


class BFloat16(ValueCodec):
    """``bf16``: bfloat16 (8-bit exponent, 8-bit significand), round to nearest even.

    Same range as float32, relative error at most 2^-9. bfloat16 has no numpy
    dtype, so the 16-bit patterns travel as uint16 (the top half of each
    float32).

    Payload: one uint16 array of ``n`` values, empty meta; ``2n + 1`` bytes.
    """

    spec = "bf16"
    n_arrays = 1

    def contraction(self, numel: int) -> float:
        """1: rounding to half precision keeps all but ~2⁻¹⁶ of ``‖x‖²``."""
        return 1.0

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        brain = v.to(torch.bfloat16)
        estimate = brain.float()
        array = to_host(brain.view(torch.int16)).view(np.uint16)
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("uint16", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "bf16", self.layout(numel))
        device = torch.device(device)
        brain = from_host(values.view(np.int16), device).view(torch.bfloat16)
        return brain.float()
