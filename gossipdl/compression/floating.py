"""Floating-point value codecs: ``none`` (float32, lossless), ``fp16`` and ``bf16``.

Each also encodes the kept values of a sparsifier (``topk:0.01+fp16``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from gossipdl.compression._kernels import empty_on, from_host, to_host
from gossipdl.compression.base import (
    CodecError,
    Layout,
    Payload,
    ValueCodec,
    check_layout,
    check_numel,
    check_vector,
)

__all__ = ["BFloat16", "Float16", "Identity"]

_FP16_MAX = 65504.0
_BF16_EXPONENT = 0x7F80  # a bfloat16's exponent bits: all set for ±inf and NaN


def _host_copy(
    values: np.ndarray, device: torch.device, view: torch.dtype | None = None
) -> torch.Tensor:
    """The wire's ``values`` (float32 or float16, maybe a read-only buffer; bfloat16 bits
    as int16 with ``view`` bfloat16) as a new float32 tensor on ``device``: on a CPU in
    recycled memory, cast by torch (vectorised, unlike numpy's half casts)."""
    if device.type != "cpu":
        source = from_host(values, device)
        return (source if view is None else source.view(view)).float()
    with warnings.catch_warnings():  # a read-only wire buffer: only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(values)
    return empty_on(device, values.size).copy_(source if view is None else source.view(view))


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
        estimate = empty_on(v.device, v.numel()).copy_(v)
        if v.device.type == "cpu":  # the payload owns its bytes (to_host would share x's)
            array = empty_on(v.device, v.numel()).copy_(v).numpy()
        else:
            array = to_host(v)
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("float32", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "none", self.layout(numel))
        return _host_copy(values, torch.device(device))


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
        half = empty_on(v.device, v.numel(), torch.float16).copy_(v)
        if half.is_cuda:  # clamped in place: a branch on the host would wait for the GPU
            torch.nan_to_num_(half, nan=math.nan, posinf=_FP16_MAX, neginf=-_FP16_MAX)
        elif bool(torch.isinf(half).any()):  # on a CPU one read to find out beats a write
            half = v.clamp(-_FP16_MAX, _FP16_MAX).half()  # (aminmax missed inf beside a NaN)
        estimate = empty_on(v.device, v.numel()).copy_(half)
        array = to_host(half)  # shares memory with ``half`` on CPU, which nothing else holds
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("float16", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "fp16", self.layout(numel))
        return _host_copy(values, torch.device(device))


class BFloat16(ValueCodec):
    """``bf16``: bfloat16 (8-bit exponent, 8-bit significand), round to nearest even.

    Same range as float32, relative error at most 2^-9. bfloat16 has no numpy
    dtype, so the 16-bit patterns travel as uint16 (the top half of each
    float32), which the wire's finiteness check does not read: the decoder
    refuses a NaN or an infinity itself.

    Payload: one uint16 array of ``n`` values, empty meta; ``2n + 1`` bytes.
    """

    spec = "bf16"
    n_arrays = 1

    def contraction(self, numel: int) -> float:
        """1: rounding to half precision keeps all but ~2⁻¹⁶ of ``‖x‖²``."""
        return 1.0

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        brain = empty_on(v.device, v.numel(), torch.bfloat16).copy_(v)
        estimate = empty_on(v.device, v.numel()).copy_(brain)
        array = to_host(brain.view(torch.int16)).view(np.uint16)
        return Payload((array,), {}), estimate

    def layout(self, count: int) -> Layout:
        return Layout((("uint16", count),))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        (values,) = check_layout(payload, "bf16", self.layout(numel))
        if np.any((values & _BF16_EXPONENT) == _BF16_EXPONENT):  # the wire sees uint16 only
            raise CodecError("bf16: a value is not finite (NaN or ±inf): the sender's model is")
        return _host_copy(values.view(np.int16), torch.device(device), torch.bfloat16)
