"""The codec interface: a flat float32 tensor in, a :class:`Payload` out, and back.

A codec has two verbs. ``encode(x)`` returns the payload *and* the tensor the
receiver will decode from it (CHOCO-SGD's public copy and error feedback need
that estimate on the sender, so it is computed alongside, not by decoding
again). ``decode(payload, numel, device)`` trusts nothing in the payload: every
array count, dtype, length, index and count is checked against ``numel``
before anything is allocated or indexed, and anything wrong raises
:class:`CodecError` naming what is wrong.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

__all__ = ["WIRE_DTYPES", "Codec", "CodecError", "MetaValue", "Payload", "ValueCodec"]

MetaValue = int | float | str
"""What a payload's ``meta`` may hold: a few small scalars (counts, seeds, parameters)."""

WIRE_DTYPES: frozenset[str] = frozenset(
    {"float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64"}
)
"""Array dtypes a payload may carry (bfloat16 travels as uint16)."""

_WIRE_NAMES: dict[type, str] = {np.dtype(name).type: name for name in WIRE_DTYPES}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, looked up by scalar type for the wire dtypes (numpy computes ``name``
    in Python, which the many small payloads of a simulated swarm notice)."""
    return _WIRE_NAMES.get(dtype.type) or dtype.name


_MAX_META_KEYS = 64
_SCALARS = (int, float)  # exact types a meta value may have without a closer look
_MAX_META_STR = 256
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest float32."""
MAX_DECODED = FLOAT32_MAX / 2
"""The largest magnitude a payload's numbers may carry a value to (its scales, or the reach
of its codes or factors): a decoder refuses a payload past it. Half float32's largest, so the
rounding in the decoder's float32 arithmetic cannot carry a value to ±inf either (a QSGD norm
of float32's largest decoded to inf: its norm/LEVELS rounded up)."""


class CodecError(ValueError):
    """A codec spec or payload that cannot be used; the message names what is wrong."""


@dataclass(frozen=True)
class Payload:
    """What one encoded tensor puts on the wire: raw arrays plus a few scalars.

    ``arrays`` are host-memory, C-contiguous, one-dimensional buffers exactly as
    they are sent (dtypes from :data:`WIRE_DTYPES`); ``meta`` is a small map of
    ints, floats and strings that travels in the message header.
    :attr:`nbytes` is the exact number of payload bytes on the wire.

    A list of arrays is accepted and stored as a tuple. Construction checks
    types only; whether the arrays make sense for a codec is checked by that
    codec's ``decode``.

    Example::

        >>> import numpy as np
        >>> p = Payload((np.zeros(3, np.float32),), {"k": 3})
        >>> p.nbytes  # 12 array bytes + 4 bytes of msgpack for {"k": 3}
        16
    """

    arrays: tuple[np.ndarray, ...]
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arrays = self.arrays
        if not isinstance(arrays, tuple | list):
            raise CodecError(f"payload arrays must be a tuple of numpy arrays, got {arrays!r:.80}")
        for i, array in enumerate(arrays):
            if not isinstance(array, np.ndarray):
                raise CodecError(f"payload array {i} is a {type(array).__name__}, not an ndarray")
            if dtype_name(array.dtype) not in WIRE_DTYPES:
                raise CodecError(
                    f"payload array {i} has dtype {array.dtype}; allowed: {sorted(WIRE_DTYPES)}"
                )
        object.__setattr__(self, "arrays", tuple(arrays))
        meta = self.meta
        if type(meta) is not dict and not isinstance(meta, Mapping):
            raise CodecError(f"payload meta must be a dict, got {type(meta).__name__}")
        if len(meta) > _MAX_META_KEYS:
            raise CodecError(f"payload meta has {len(meta)} keys, at most {_MAX_META_KEYS}")
        for key, value in meta.items():
            if type(key) is not str and not isinstance(key, str):
                raise CodecError(f"payload meta key {key!r} is not a string")
            if type(value) in _SCALARS:  # the usual case, checked in one look-up
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise CodecError(f"payload meta {key!r} = {value!r:.80} is not an int/float/str")
            if isinstance(value, str) and len(value) > _MAX_META_STR:
                raise CodecError(f"payload meta {key!r} is a string of {len(value)} characters")
        if not isinstance(meta, dict):
            object.__setattr__(self, "meta", dict(meta))

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: every array's buffer plus the msgpack-packed ``meta``."""
        return sum(int(a.nbytes) for a in self.arrays) + len(msgpack.packb(self.meta))

    def layout(self) -> Layout:
        """What this payload puts on the wire, without its bytes."""
        return Layout(tuple((dtype_name(a.dtype), a.size) for a in self.arrays), self.meta)


@dataclass(frozen=True)
class Layout:
    """What a payload puts on the wire, without its bytes: each (1-D) array's dtype name
    and length, and the meta; :func:`gossipdl.transport.wire.message_size` counts its
    message's bytes from it. Codecs that can give many at once (``SparseCodec.layouts``):
    the batched simulator counts a swarm's messages without building them."""

    arrays: tuple[tuple[str, int], ...]
    meta: dict[str, MetaValue] = field(default_factory=dict)


class Codec(ABC):
    """Maps a flat float32 tensor to a :class:`Payload` and back.

    Attributes:
        spec: the normalized spec string; :func:`~gossipdl.compression.build_codec`
            of it builds an equivalent codec (this is what peers compare).
        lossy: False only when ``decode(encode(x))`` equals ``x`` bit for bit.

    Contract for subclasses:

    * ``encode(x)`` takes a 1-D float32 tensor on any device and returns
      ``(payload, estimate)``: ``estimate`` is on ``x``'s device and equal bit
      for bit to ``decode(payload, x.numel(), x.device)``. Neither shares
      memory with ``x``, and the payload's arrays do not share memory with the
      estimate, so the caller may keep, send or modify each independently.
    * ``decode(payload, numel, device)`` returns a new 1-D float32 tensor of
      ``numel`` elements on ``device`` or raises :class:`CodecError`; it never
      allocates or indexes by a size it has not checked against ``numel``.
    * A codec instance may hold sender state (a random generator, a warm
      start); decoding never depends on it.
    """

    spec: str = ""
    lossy: bool = True

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        """Compress ``x``; return the payload and the tensor the receiver will decode."""

    @abstractmethod
    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Rebuild the 1-D float32 tensor of ``numel`` elements on ``device``."""

    def bind_layout(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the tensors the flat vectors are made of (a model's parameters, in
        order), for codecs that work per tensor; both ends bind the same. Others ignore it."""
        return None

    def contraction(self, numel: int) -> float:
        """δ, the share of ``‖x‖²`` a message keeps (``E‖C(x) − x‖² ≈ (1 − δ)‖x‖²``, after the
        ``1/(1 + ω)`` scale of an unbiased codec): 1 for a lossless codec. A lossy codec
        without an estimate of its own says 0.01, top-1%'s, a cautious guess. CHOCO's
        automatic γ grows with it (``averaging.choco.auto_gamma``)."""
        return 0.01 if self.lossy else 1.0

    def contraction_is_exact(self) -> bool:
        """Whether :meth:`contraction` is what every message keeps (a random subset), not a
        floor that real vectors beat (top-k: their largest entries hold more than their
        share). CHOCO's automatic step is then bounded by δ itself
        (``averaging.choco.auto_gamma``)."""
        return False

    def omega(self, numel: int) -> float:
        """ω of the codec's unbiased random stage on a vector of ``numel`` values:
        ``E‖Q(x) − x‖² ≤ ω‖x‖²`` (0 when nothing in it is an unbiased random rounding).

        CHOCO-SGD needs a contractive compressor; an unbiased one becomes one when what
        it sends is scaled by ``1/(1 + ω)`` (Koloskova et al. 2019, Section 3).
        """
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class ValueCodec(Codec):
    """A codec that can also encode the kept values of a sparsifier (a value quantizer).

    ``n_arrays`` is the fixed number of arrays its payloads carry, so a sparse
    payload can be split into index arrays and value arrays without trusting
    the payload.
    """

    n_arrays: int = 1
    fixed_layout: bool = True
    """Whether :meth:`layout` tells a payload's arrays before encoding (false where their
    lengths depend on the values, as ``qsgd:LEVELS:trits``'s exceptions do)."""

    @abstractmethod
    def layout(self, count: int) -> Layout:
        """What :meth:`encode` puts on the wire for ``count`` values (its arrays' dtypes and
        lengths; a value codec sends no meta), without encoding: what :meth:`decode` checks
        a payload against, and what the batched simulator counts."""


# --- checks shared by the codecs ---------------------------------------------------------------


def check_vector(x: Any) -> torch.Tensor:
    """Return ``x`` detached after checking it is a 1-D float32 tensor (the encode contract)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codecs encode a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(
            f"codecs encode a 1-D float32 tensor, got dtype={x.dtype} shape={tuple(x.shape)}; "
            "flatten and cast first, e.g. x.detach().reshape(-1).float()"
        )
    return x.detach().contiguous()


def check_numel(numel: Any) -> int:
    """Return ``numel`` as an int after checking it is a non-negative integer."""
    if isinstance(numel, bool):
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}")
    try:
        value = operator.index(numel)
    except TypeError:
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}") from None
    if value < 0:
        raise CodecError(f"numel must be a non-negative integer, got {value}")
    return value


def check_arrays(
    payload: Any, what: str, dtypes: Sequence[str], lengths: Sequence[int | None]
) -> tuple[np.ndarray, ...]:
    """Check ``payload`` holds exactly these 1-D arrays; a ``None`` length is checked by the caller.

    Returns the arrays (C-contiguous) for convenience.
    """
    if not isinstance(payload, Payload):
        raise CodecError(f"{what}: expected a Payload, got {type(payload).__name__}")
    arrays = payload.arrays
    if len(arrays) != len(dtypes):
        raise CodecError(f"{what}: payload has {len(arrays)} arrays, expected {len(dtypes)}")
    out = []
    for i, (array, dtype, length) in enumerate(zip(arrays, dtypes, lengths, strict=True)):
        if array.ndim != 1:
            raise CodecError(f"{what}: array {i} has shape {array.shape}, expected 1-D")
        if dtype_name(array.dtype) != dtype:
            raise CodecError(f"{what}: array {i} has dtype {array.dtype}, expected {dtype}")
        if length is not None and array.shape[0] != length:
            raise CodecError(f"{what}: array {i} has {array.shape[0]} elements, expected {length}")
        out.append(np.ascontiguousarray(array))
    return tuple(out)


def check_layout(payload: Any, what: str, layout: Layout) -> tuple[np.ndarray, ...]:
    """Check ``payload`` holds exactly ``layout``'s arrays and no meta (a value codec's
    payload, :meth:`ValueCodec.layout`); returns the arrays as :func:`check_arrays` does."""
    arrays = check_arrays(
        payload, what, [dtype for dtype, _ in layout.arrays], [n for _, n in layout.arrays]
    )
    check_meta(payload.meta, what, {})
    return arrays


def check_meta(meta: Mapping[str, Any], what: str, keys: Mapping[str, type]) -> None:
    """Check ``meta`` has exactly ``keys`` with values of the given types (int excludes bool)."""
    if set(meta) != set(keys):
        missing = sorted(set(keys) - set(meta))
        extra = sorted(set(meta) - set(keys))
        raise CodecError(f"{what}: meta keys wrong (missing {missing}, unexpected {extra})")
    for key, kind in keys.items():
        value = meta[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value)
        if not ok:
            raise CodecError(f"{what}: meta {key!r} = {value!r:.40} is not a valid {kind.__name__}")


def meta_int(meta: Mapping[str, Any], key: str, what: str, lo: int, hi: int) -> int:
    """``meta[key]`` after checking it is an int in ``[lo, hi]``."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CodecError(f"{what}: meta {key!r} = {value!r:.40} is not an integer in [{lo}, {hi}]")
    return value


def increasing_below(array: np.ndarray, numel: int, what: str) -> np.ndarray:
    """``array`` as int64 after checking it is strictly increasing inside ``[0, numel)`` (the
    differences taken in int64: an unsigned dtype's would wrap)."""
    values = array.astype(np.int64)
    if values.size and (
        int(values[0]) < 0 or int(values[-1]) >= numel or not (np.diff(values) > 0).all()
    ):
        raise CodecError(
            f"{what}: not strictly increasing inside [0, {numel}) "
            "(out of range, unsorted or duplicated)"
        )
    return values


def check_scales(scales: np.ndarray, what: str) -> None:
    """Scales, norms and steps must be finite, non-negative and at most ``MAX_DECODED``."""
    if scales.size and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"{what}: scales must be finite and non-negative")
    if scales.size and scales.max() > MAX_DECODED:
        raise CodecError(f"{what}: a scale above {MAX_DECODED:.4g} overflows float32 when decoded")


def split_meta(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``meta`` whose key starts with ``prefix``, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
