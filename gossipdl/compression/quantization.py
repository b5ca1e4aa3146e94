"""Low-bit value quantizers: ``sign``, ``ternary``, ``qsgd:LEVELS``, ``uniform:BITS``.

Each maps a float32 vector to a few bits per value plus float32 scales (one
per tensor, or one per block of ``BLOCK`` consecutive values), packed densely:
a stream of ``BITS``-bit codes, least significant bit first, ``ceil(n*BITS/8)``
bytes. Each also encodes the kept values of a sparsifier
(``topk:0.01+qsgd:16``). The receiver's value is computed by one function
shared by ``encode`` and ``decode`` (in the C kernels, the same float
operations in the same order), so the sender's estimate is the decoded
tensor bit for bit.

On CPU, when the C kernels are built (``_native.c``), each codec's encode is
one pass over the tensor (two for a whole-tensor scale: the scale first)
that writes the packed payload and the sender's estimate, and its decode one
pass that writes the tensor into recycled memory
(:func:`~gossipdl.compression._kernels.host_empty`): the torch code makes
several full-size temporaries per step (``benchmarks/codecs.py``: ternary
141 ms for 10M values in torch). Elsewhere, or without the C kernels, the
torch code runs; both read each other's payloads.

Unbiased (``E[decode(encode(x))] = x``): ``qsgd`` and ``ternary``. Biased but
contractive: ``sign`` and ``uniform``. CHOCO-SGD (Koloskova et al. 2019)
needs a contractive compressor, ``E‖Q(x) − x‖² ≤ (1 − δ)‖x‖²``; an unbiased
one with variance ``ω‖x‖²`` qualifies after scaling by ``1/(1 + ω)``: each
codec states its ω (:meth:`~gossipdl.compression.Codec.omega`), and CHOCO
applies the scale on both ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from gossipdl.compression._kernels import (
    Rng,
    from_host,
    host_empty,
    native_kernels,
    pack_bits,
    packed_size,
    to_host,
    unpack_bits,
    use_numpy,
)
from gossipdl.compression.base import (
    MAX_DECODED,
    CodecError,
    Layout,
    Payload,
    ValueCodec,
    check_arrays,
    check_layout,
    check_meta,
    check_numel,
    check_scales,
    check_vector,
    increasing_below,
)

__all__ = ["QSGD", "Sign", "Ternary", "Uniform"]

# Row b of a table holds the 8 values whose bits are b, least significant first.
_BIT_ROWS = (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(8)) & 1
_SIGN_TABLE = np.where(_BIT_ROWS == 1, np.float32(-1.0), np.float32(1.0)).astype(np.float32)
# Row b holds the 5 base-3 digits of byte b (b < 243) as values -1, 0, 1.
_TRIT_ROWS = (np.arange(243)[:, None] // 3 ** np.arange(5)) % 3
_TRIT_TABLE = (_TRIT_ROWS - 1).astype(np.float32)


def _pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """Values in {-1, 0, 1} (int8, any device) packed 5 per byte in base 3, the first value
    the least significant digit (``3^5 = 243 <= 256``: 1.6 bits per value); the last byte is
    padded with zeros. Uint8 ``[ceil(n/5)]``, every byte < 243 (``_TRIT_TABLE`` unpacks)."""
    count = trits.numel()
    groups = -(-count // 5)
    digits = torch.ones(groups * 5, dtype=torch.uint8, device=trits.device)
    digits[:count] = (trits + 1).view(torch.uint8)
    columns = digits.view(groups, 5)
    packed = columns[:, 4] * 3 + columns[:, 3]  # Horner: d0 + 3(d1 + 3(d2 + 3(d3 + 3 d4)))
    for j in (2, 1, 0):
        packed = packed * 3 + columns[:, j]
    return packed


def _check_trits(packed: np.ndarray, what: str) -> None:
    if packed.size and int(packed.max()) > 242:
        raise CodecError(f"{what}: a packed byte exceeds 242 (not 5 base-3 digits)")


# --- blocks: one scale per tensor (block == 0) or per BLOCK consecutive values -----------------


def _num_blocks(count: int, block: int) -> int:
    return 1 if block == 0 else -(-count // block)


MAX_BLOCK = 2**40
"""The longest BLOCK (or BUCKET) a codec takes: longer than any vector, far enough below
2**63 that the kernels' block counts cannot overflow (a config names it, which a joiner takes
from the swarm)."""


def _check_block(name: str, block: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block <= MAX_BLOCK:
        raise CodecError(
            f"{name}: BLOCK must be an integer from 0 (the whole tensor) to {MAX_BLOCK:,}"
        )
    return block


def _reduce(
    t: torch.Tensor, block: int, op: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``op`` (a row reduction of a 2-D tensor) over each block of ``t``'s last dimension (a
    vector, or rows of vectors); float32, one value per block: ``[..., blocks]``."""
    count, lead = t.shape[-1], t.shape[:-1]
    if count == 0:
        return torch.zeros(*lead, _num_blocks(0, block), dtype=torch.float32, device=t.device)
    size = count if block == 0 else block
    full = count // size
    rows = t.reshape(-1, count)
    parts = []
    if full:
        parts.append(op(rows[:, : full * size].reshape(-1, size)).view(-1, full))
    if count > full * size:
        parts.append(op(rows[:, full * size :]).view(-1, 1))
    return torch.cat(parts, dim=1).float().view(*lead, -1)


def _expand(scales: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """Per-block ``scales`` (``[..., blocks]``) repeated to one value per element of the last
    dimension (a broadcastable view if block 0). Each is repeated at most ``count`` times: a
    block longer than the vector (a peer's ``ternary:200000000``) is one block, not a
    BLOCK-long temporary."""
    if block == 0:
        return scales
    return scales.repeat_interleave(min(block, count), dim=-1)[..., :count]


def _scale_blocks(values: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """``values`` (numpy, modified in place) times the scale of each block; returns ``values``."""
    full = values.size // block * block
    if full:
        values[:full].reshape(-1, block)[...] *= scales[: full // block, None]
    if full < values.size:
        values[full:] *= scales[-1]
    return values


def _block_lengths(count: int, block: int) -> np.ndarray:
    """Values in each block (float64; 1 for an empty tensor, so a scale is 0, not NaN)."""
    size = count if block == 0 else block
    lengths = np.full(_num_blocks(count, block), float(max(size, 1)))
    if block and count % block:
        lengths[-1] = float(count % block)
    return lengths


def _expand_signs(
    native: ModuleType, bits: np.ndarray, scales: np.ndarray, block: int, count: int
) -> torch.Tensor:
    """``±scale`` per sign bit (set: negative), by the C kernel into recycled host memory."""
    out = host_empty(count)
    native.sign_expand(bits, scales, out, block)
    return torch.from_numpy(out)


class Sign(ValueCodec):
    """``sign`` or ``sign:BLOCK``: one bit per value and one scale per tensor or block.

    The scaled sign compressor of EF-SignSGD (Karimireddy, Rebjock, Stich,
    Jaggi 2019, "Error Feedback Fixes SignSGD and other Gradient Compression
    Schemes", Algorithm 1 line 4): ``C(p) = (‖p‖₁ / d) · sign(p)``, with ``d``
    the tensor's (or the block's) length. Biased and contractive with
    ``δ = ‖p‖₁² / (d‖p‖₂²)``; meant to run under error feedback (``sign+ef``).

    Steps, in the paper's order:

    1. ``scale = ‖p‖₁ / d`` per tensor or block (float32);
    2. ``sign(p)``: the float's sign bit (``-0.0`` counts as negative, so
       every value is ``±scale``), packed 8 per byte;
    3. the receiver's value ``±scale``.

    Payload: uint8 sign bits ``[ceil(n/8)]`` and float32 scales ``[blocks]``
    (1 for the whole tensor, ``ceil(n/BLOCK)`` with a block), empty meta:
    ``ceil(n/8) + 4·blocks + 1`` bytes.

    On CPU, for the whole tensor or blocks of a multiple of 8 values, the C
    kernels run (``_native.c``): one read of ``p`` for the bits and the
    ``‖p‖₁`` of each block together, one write of ``±scale``, into recycled
    memory (:func:`~gossipdl.compression._kernels.host_empty`). Otherwise (or
    built without a compiler) it runs in numpy: ``np.packbits(np.signbit(x))``
    for the bits, a 256-row table of ±1 expanded from the bits, ``np.dot`` of
    that with ``x`` for ``‖p‖₁`` (per block: ``|p|`` summed by rows), and the
    table scaled in place. ``benchmarks/codecs.py`` times both.
    """

    n_arrays = 2

    def __init__(self, block: int = 0) -> None:
        self.block = _check_block("sign", block)
        self.spec = "sign" if self.block == 0 else f"sign:{self.block}"

    def contraction(self, numel: int) -> float:
        """``2/π``: a scaled sign keeps ``‖x‖₁²/(n‖x‖²)`` of ``‖x‖²``, 2/π for Gaussian values."""
        return 2 / math.pi

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        p = check_vector(x)
        if use_numpy(p):
            return self._encode_numpy(p.numpy())
        negative, scales, estimate = self._quantize(p)
        bits = pack_bits(negative.to(torch.uint8), 1)
        return Payload((bits, to_host(scales).copy()), {}), estimate

    def estimate_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """What the receiver of :meth:`encode` reads, for every row of ``rows`` (``[count,
        n]``) at once, without the payloads (the batched simulator's peers)."""
        return self._quantize(rows)[2]

    def _quantize(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1–3 in torch along ``p``'s last dimension: the sign bits (set: negative),
        the scales and the receiver's values."""
        count = p.shape[-1]
        # 1. scale = ‖p‖₁ / d per tensor or block.
        l1 = _reduce(p.abs(), self.block, lambda rows: rows.double().sum(dim=1))
        lengths = from_host(_block_lengths(count, self.block), p.device)
        scales = (l1.double() / lengths).float()
        # 2. sign(p), -0.0 included.
        negative = torch.signbit(p)
        # 3. the receiver's value: ±scale.
        estimate = (1.0 - 2.0 * negative.float()) * _expand(scales, self.block, count)
        return negative, scales, estimate

    def _encode_numpy(self, p: np.ndarray) -> tuple[Payload, torch.Tensor]:
        count = p.size
        native = native_kernels(torch.device("cpu"))
        if native is not None and self.block % 8 == 0:
            bits = np.empty(packed_size(count, 1), np.uint8)
            sums = np.empty(_num_blocks(count, self.block), np.float64)
            native.sign_encode(p, bits, self.block, sums)
            scales = (sums / _block_lengths(count, self.block)).astype(np.float32)
            return Payload((bits, scales), {}), _expand_signs(
                native, bits, scales, self.block, count
            )
        bits = np.packbits(np.signbit(p), bitorder="little")
        ones = np.take(_SIGN_TABLE, bits, axis=0).reshape(-1)[:count]  # ±1.0, fresh buffer
        if self.block == 0:
            l1 = float(np.dot(p, ones)) if count else 0.0  # Σ p_i · sign(p_i) = ‖p‖₁
            scales = np.array([l1 / max(count, 1)], np.float32)
            np.multiply(ones, scales[0], out=ones)
            estimate = ones
        else:
            magnitude = np.multiply(p, ones)  # |p|
            full = count // self.block * self.block
            sums = np.add.reduce(magnitude[:full].reshape(-1, self.block), axis=1)
            if full < count:
                sums = np.append(sums, magnitude[full:].sum(dtype=np.float32))
            scales = (sums / _block_lengths(count, self.block)).astype(np.float32)
            estimate = _scale_blocks(ones, scales, self.block)
        return Payload((bits, scales), {}), torch.from_numpy(estimate)

    def layout(self, count: int) -> Layout:
        return Layout(
            (("uint8", packed_size(count, 1)), ("float32", _num_blocks(count, self.block)))
        )

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        count = check_numel(numel)
        bits, scales = check_layout(payload, self.spec, self.layout(count))
        check_scales(scales, self.spec)
        device = torch.device(device)
        native = native_kernels(device)
        if native is not None and self.block % 8 == 0:
            return _expand_signs(native, bits, scales, self.block, count)
        if use_numpy(device):
            if self.block == 0:
                table = _SIGN_TABLE * scales[0]
                return torch.from_numpy(np.take(table, bits, axis=0).reshape(-1)[:count])
            ones = np.take(_SIGN_TABLE, bits, axis=0).reshape(-1)[:count]
            return torch.from_numpy(_scale_blocks(ones, scales, self.block))
        signs = 1.0 - 2.0 * unpack_bits(bits, 1, count, device).float()
        return signs * _expand(from_host(scales, device), self.block, count)


class Ternary(ValueCodec):
    """``ternary`` or ``ternary:BLOCK``: TernGrad, values in ``{-s, 0, s}``; unbiased.

    Wen, Xu, Yan, Wu, Wang, Chen, Li 2017, "TernGrad: Ternary Gradients to
    Reduce Communication in Distributed Deep Learning", eq. (5):
    ``g̃ = s · sign(g) ∘ b`` with ``s = ‖g‖∞`` and ``b_k ~ Bernoulli(|g_k| / s)``,
    so ``E[g̃] = g``. (The paper's optional gradient clipping is left to the
    caller.) Steps, in the paper's order:

    1. ``s = max |g|`` per tensor or block (float32);
    2. ``b_k = [u_k < |g_k| / s]`` with ``u_k`` uniform on [0, 1);
    3. ``t_k = sign(g_k) · b_k`` in {-1, 0, 1}, packed 5 per byte in base 3
       (``3^5 = 243 <= 256``: 1.6 bits per value);
    4. the receiver's value ``s · t_k``.

    Payload: uint8 ``[ceil(n/5)]`` (every byte < 243) and float32 scales
    ``[blocks]``, empty meta: ``ceil(n/5) + 4·blocks + 1`` bytes.

    On CPU the C kernels run: one read of ``g`` for the scales (per block, in
    cache, for blocks that fit), one for steps 2–4 writing the packed bytes
    and the estimate (torch: a dozen full-size temporaries). Their ``u`` is 24
    random bits per value, as ``torch.rand``'s float32 has: the top bits of 16
    interleaved xoshiro128+ generators seeded per call from the codec's
    generator (another stream than torch's, the same distribution); ``b`` is
    ``u < |g|·(2^24/s)``, one multiply (within an ulp of ``|g|/s``).
    """

    n_arrays = 2

    def __init__(self, block: int = 0, seed: int = 0) -> None:
        self.block = _check_block("ternary", block)
        self.spec = "ternary" if self.block == 0 else f"ternary:{self.block}"
        self._rng = Rng(seed, salt=3)

    def contraction(self, numel: int) -> float:
        """``1/(1 + ω)``: what CHOCO's scale leaves of an unbiased rounding."""
        return 1 / (1 + self.omega(numel))

    def omega(self, numel: int) -> float:
        """``√B − 1`` for blocks of ``B`` values: with ``s = ‖x‖∞`` the variance is
        ``s‖x‖₁ − ‖x‖² ≤ (√B − 1)‖x‖²`` (``‖x‖₁ ≤ √B‖x‖``, ``s ≤ ‖x‖``)."""
        size = min(self.block or numel, numel)
        return max(math.sqrt(size) - 1.0, 0.0)

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        g = check_vector(x)
        native = native_kernels(g.device)
        if native is not None:
            return self._encode_native(native, g.numpy())
        count = g.numel()
        magnitude = g.abs()
        # 1. s = ‖g‖∞ per tensor or block.
        scales = _reduce(magnitude, self.block, lambda rows: rows.amax(dim=1))
        s = _expand(scales, self.block, count)
        # 2. b ~ Bernoulli(|g| / s); where s == 0, |g| / s is NaN and b is 0.
        u = torch.rand(count, generator=self._rng.torch(g.device), device=g.device)
        keep = u < magnitude / s
        # 3. t = sign(g) · b in {-1, 0, 1}, packed in base 3.
        trits = torch.sign(g).to(torch.int8) * keep.to(torch.int8)
        packed = _pack_trits(trits)
        # 4. the receiver's value s · t.
        estimate = trits.float() * s
        return Payload((to_host(packed).copy(), to_host(scales).copy()), {}), estimate

    def _encode_native(self, native: ModuleType, g: np.ndarray) -> tuple[Payload, torch.Tensor]:
        """Steps 1–4 by the C kernels, the estimate into recycled memory."""
        packed = np.empty(-(-g.size // 5), np.uint8)
        scales = np.empty(_num_blocks(g.size, self.block), np.float32)
        out = host_empty(g.size)
        native.ternary_encode(g, packed, scales, out, self._rng.message_seed(), self.block)
        return Payload((packed, scales), {}), torch.from_numpy(out)

    def layout(self, count: int) -> Layout:
        return Layout((("uint8", -(-count // 5)), ("float32", _num_blocks(count, self.block))))

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        count = check_numel(numel)
        packed, scales = check_layout(payload, self.spec, self.layout(count))
        check_scales(scales, self.spec)
        _check_trits(packed, self.spec)
        device = torch.device(device)
        native = native_kernels(device)
        if native is not None:
            out = host_empty(count)
            native.ternary_decode(packed, scales, out, self.block)
            return torch.from_numpy(out)
        if use_numpy(device) and self.block == 0:
            table = _TRIT_TABLE * scales[0]  # s·t exactly, as in encode
            return torch.from_numpy(np.take(table, packed, axis=0).reshape(-1)[:count])
        if use_numpy(device):
            trits = np.take(_TRIT_TABLE, packed, axis=0).reshape(-1)[:count]
            return torch.from_numpy(trits * np.repeat(scales, min(self.block, count))[:count])
        # Only the packed bytes cross to the device; the lookup runs there.
        table = from_host(_TRIT_TABLE, device)
        t = table[from_host(packed, device).long()].reshape(-1)[:count]
        return t * _expand(from_host(scales, device), self.block, count)


class QSGD(ValueCodec):
    """``qsgd:LEVELS[:BUCKET][:trits]``: stochastic rounding to ``s`` levels; unbiased.

    Alistarh, Grubic, Li, Tomioka, Vojnovic 2017, "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding", eq. (4):
    ``Q_s(v_i) = ‖v‖₂ · sgn(v_i) · ξ_i(v, s)``, where with
    ``ℓ = floor(|v_i| s / ‖v‖₂)``, ``ξ_i = (ℓ + 1)/s`` with probability
    ``|v_i| s / ‖v‖₂ − ℓ`` and ``ℓ/s`` otherwise, so ``E[Q_s(v)] = v`` (Lemma 3.1).
    The norm is taken per bucket of ``BUCKET`` values, as in the paper's
    experiments (default 512; 0 = the whole tensor, whose variance bound
    ``min(n/s², √n/s)`` is large for big tensors). Steps, in the paper's order:

    1. ``‖v‖₂`` per bucket (float32);
    2. ``ℓ`` and the random rounding up with probability ``|v_i| s/‖v‖ − ℓ``;
    3. the signed level ``sgn(v_i)·ξ_i·s`` in ``[-s, s]``, sent as ``code = level + s``
       with ``ceil(log2(2s + 1))`` bits (fixed width, not the paper's Elias
       code: vectorizable and within a bit of it at s >= 4);
    4. the receiver's value ``(code − s) · (‖v‖₂ / s)``.

    ``LEVELS`` is 1..127 (codes fit 8 bits). Payload: uint8 codes
    ``[ceil(n·bits/8)]`` and float32 norms ``[buckets]``, empty meta.

    ``:trits`` codes the same levels in fewer bytes where most are -1, 0 or 1, as
    top-k's kept values are (each near ``‖v‖/√B``, so ``|v_i| s/‖v‖ < 2`` for
    ``s <= √B``: 99% of top-0.5%'s levels at ``s = 16``, whose entropy is 1.66 bits
    where the fixed codes take 6). The patched frame of reference of column stores
    (PFOR): every level clipped to -1..1 and packed 5 per byte in base 3 (1.6 bits,
    as ``ternary``), and the others listed apart, each a position and its level.
    Payload: uint8 ``[ceil(n/5)]``, float32 norms ``[buckets]``, the exceptions'
    positions (strictly increasing; uint16 for ``n <= 65536``, else int32) and their
    int8 levels (``2 <= |level| <= s``). The rounding, and so the receiver's values,
    are the fixed codes' bit for bit; only the size differs, and depends on the codes
    (:attr:`~gossipdl.compression.base.ValueCodec.fixed_layout` is false).

    On CPU the C kernels run: each bucket's norm (summed in double) and then
    steps 2–4 on the bucket while it is in cache, writing the packed codes and
    the estimate in one pass over ``v`` (torch: a dozen full-size temporaries).
    The rounding's ``u`` is 24 random bits per value, as ``torch.rand``'s
    float32 has: the top bits of 16 interleaved xoshiro128+ generators seeded
    per call from the codec's generator (another stream than torch's, the same
    distribution).
    """

    CODINGS = ("fixed", "trits")

    def __init__(
        self, levels: int, bucket: int = 512, seed: int = 0, coding: str = "fixed"
    ) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise CodecError(f"qsgd:LEVELS needs an integer 1..127, got {levels!r}")
        if coding not in self.CODINGS:
            raise CodecError(f"qsgd: the coding is one of {list(self.CODINGS)}, got {coding!r}")
        self.levels = levels
        self.block = _check_block("qsgd", bucket)
        self.bits = (2 * levels).bit_length()
        self.coding = coding
        self.fixed_layout = coding == "fixed"
        self.n_arrays = 2 if self.fixed_layout else 4
        self.spec = f"qsgd:{levels}" + ("" if bucket == 512 else f":{bucket}")
        self.spec += "" if self.fixed_layout else f":{coding}"
        self._rng = Rng(seed, salt=4)

    def contraction(self, numel: int) -> float:
        """``1/(1 + ω)``: what CHOCO's scale leaves of an unbiased rounding."""
        return 1 / (1 + self.omega(numel))

    def omega(self, numel: int) -> float:
        """``min(B/s², √B/s)`` for buckets of ``B`` values (Lemma 3.1; a shorter last
        bucket has a smaller one)."""
        size = min(self.block or numel, numel)
        return min(size / self.levels**2, math.sqrt(size) / self.levels)

    def _values(self, codes: torch.Tensor, norms: torch.Tensor, count: int) -> torch.Tensor:
        """Step 4, shared by encode and decode: ``(code − s) · (‖v‖₂ / s)``."""
        unit = _expand(norms / self.levels, self.block, count)
        return (codes.float() - self.levels) * unit

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        native = native_kernels(v.device)
        if native is not None:
            out = host_empty(v.numel())
            payload = self._encode_native(native, v.numpy(), self._rng.message_seed(), out)
            estimate = torch.from_numpy(out)
        else:
            codes, norms, estimate = self._quantize(v)
            payload = Payload((pack_bits(codes, self.bits), to_host(norms).copy()), {})
        if not self.fixed_layout:
            payload = self._patched(payload, v.numel())
        return payload, estimate

    def _patched(self, fixed: Payload, count: int) -> Payload:
        """The ``:trits`` payload of the fixed codes' ``fixed``: levels clipped to -1..1 in
        base 3, and the others' positions and levels."""
        packed, norms = fixed.arrays
        codes = unpack_bits(packed, self.bits, count, torch.device("cpu")).numpy()
        levels = codes.astype(np.int16) - self.levels
        positions = np.flatnonzero(np.abs(levels) > 1)
        trits = torch.from_numpy(np.clip(levels, -1, 1).astype(np.int8))
        return Payload(
            (
                _pack_trits(trits).numpy(),
                norms,
                positions.astype(_position_dtype(count)),
                levels[positions].astype(np.int8),
            ),
            {},
        )

    def _encode_native(
        self, native: ModuleType, v: np.ndarray, seed: int, out: np.ndarray
    ) -> Payload:
        """Steps 1–4 by the C kernels: the payload, and the receiver's values into ``out``."""
        packed = np.empty(packed_size(v.size, self.bits), np.uint8)
        norms = np.empty(_num_blocks(v.size, self.block), np.float32)
        native.qsgd_encode(v, packed, norms, out, self.levels, seed, self.block)
        return Payload((packed, norms), {})

    def estimate_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """What the receiver of :meth:`encode` reads, for every row of ``rows`` (``[count,
        n]``) at once, without the payloads: one draw of the rounding for all rows (the
        batched simulator hands each peer's row to that peer's own codec)."""
        native = native_kernels(rows.device)
        if native is None or rows.numel() == 0 or rows.dtype != torch.float32:
            return self._quantize(rows)[2]
        flat = rows.detach().contiguous().reshape(-1, rows.shape[-1])
        out = torch.empty_like(flat)
        seed = self._rng.message_seed()  # one for all rows: the same draw per index
        for row, into in zip(flat.numpy(), out.numpy(), strict=True):
            self._encode_native(native, row, seed, into)
        return out.view(rows.shape)

    def _quantize(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1–4 along ``v``'s last dimension: the codes, the norms and the receiver's
        values."""
        count, s = v.shape[-1], self.levels
        # 1. ‖v‖₂ per bucket.
        norms = _reduce(v, self.block, lambda rows: torch.linalg.vector_norm(rows, dim=1))
        scale = _expand(
            torch.where(norms > 0, s / norms, torch.zeros_like(norms)), self.block, count
        )
        # 2. ℓ = floor(|v_i| s/‖v‖), rounded up with probability |v_i| s/‖v‖ − ℓ.
        r = v.abs() * scale
        low = r.floor()
        u = torch.rand(count, generator=self._rng.torch(v.device), device=v.device)
        level = (low + (u < r - low).float()).clamp_(0, s)
        # 3. signed level + s in [0, 2s], packed with ``bits`` bits.
        codes = (torch.sign(v) * level + s).to(torch.uint8)
        # 4. the receiver's value.
        return codes, norms, self._values(codes, norms, count)

    def layout(self, count: int) -> Layout:
        if not self.fixed_layout:
            raise CodecError(f"{self.spec}: a message's size depends on its codes; encode it")
        return Layout(
            (("uint8", packed_size(count, self.bits)), ("float32", _num_blocks(count, self.block)))
        )

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        count = check_numel(numel)
        if not self.fixed_layout:
            return self._decode_patched(payload, count, torch.device(device))
        packed, norms = check_layout(payload, self.spec, self.layout(count))
        check_scales(norms, self.spec)
        device = torch.device(device)
        native = native_kernels(device)
        if native is not None:
            out = host_empty(count)
            top = native.qsgd_decode(packed, norms, out, self.levels, self.block)
            if top > 2 * self.levels:
                raise CodecError(f"{self.spec}: a code exceeds 2·LEVELS = {2 * self.levels}")
            return torch.from_numpy(out)
        # On a GPU the codes are checked on the host, in C where it was built: a check on
        # the device would make the receive thread wait for every kernel queued there.
        host = native_kernels(torch.device("cpu")) if device.type == "cuda" else None
        if host is not None and host.codes_over(packed, self.bits, count, 2 * self.levels):
            raise CodecError(f"{self.spec}: a code exceeds 2·LEVELS = {2 * self.levels}")
        codes = unpack_bits(packed, self.bits, count, device)
        if host is None and count and int(codes.max()) > 2 * self.levels:
            raise CodecError(f"{self.spec}: a code exceeds 2·LEVELS = {2 * self.levels}")
        return self._values(codes, from_host(norms, device), count)

    def _decode_patched(self, payload: Payload, count: int, device: torch.device) -> torch.Tensor:
        """:meth:`decode` of a ``:trits`` payload, every array checked first."""
        blocks = _num_blocks(count, self.block)
        packed, norms, positions, big = check_arrays(
            payload,
            self.spec,
            ("uint8", "float32", _position_dtype(count), "int8"),
            (-(-count // 5), blocks, None, None),
        )
        check_meta(payload.meta, self.spec, {})
        check_scales(norms, self.spec)
        _check_trits(packed, self.spec)
        if positions.size != big.size:
            raise CodecError(
                f"{self.spec}: {positions.size} exception positions but {big.size} levels"
            )
        where = increasing_below(positions, count, f"{self.spec} exception positions")
        magnitude = np.abs(big.astype(np.int16))
        if big.size and (int(magnitude.min()) < 2 or int(magnitude.max()) > self.levels):
            raise CodecError(f"{self.spec}: an exception's level is not in 2..{self.levels}")
        levels = np.take(_TRIT_TABLE, packed, axis=0).reshape(-1)[:count]
        levels[where] = big
        codes = from_host((levels + self.levels).astype(np.uint8), device)
        return self._values(codes, from_host(norms, device), count)


def _position_dtype(count: int) -> str:
    """The narrowest wire dtype of a position below ``count``."""
    return "uint16" if count <= 1 << 16 else "int32"


class Uniform(ValueCodec):
    """``uniform:BITS`` or ``uniform:BITS:BLOCK``: min/max scaling to ``2^BITS`` levels; biased.

    Deterministic round-to-nearest on the grid ``lo + q·step``,
    ``step = (hi − lo)/(2^BITS − 1)``, with ``lo, hi`` the minimum and maximum of
    the tensor or block (the "min-max" quantizer of e.g. hivemind's
    ``Uint8Quantization`` and of QSGD's deterministic baseline). Error per
    value at most ``step/2``. Steps:

    1. ``lo``, ``hi`` per tensor or block; ``step = (hi − lo)/(2^BITS − 1)`` (float32);
    2. ``q = round((x − lo)/step)`` clamped to ``[0, 2^BITS − 1]``, packed ``BITS`` bits each;
    3. the receiver's value ``q·step + lo``.

    ``BITS`` is 1..8. Payload: uint8 codes ``[ceil(n·BITS/8)]``, float32 ``lo``
    and ``step`` ``[blocks]``, empty meta: ``ceil(n·BITS/8) + 8·blocks + 1`` bytes.

    On CPU the C kernels run: one read of ``x`` for each block's ``lo`` and
    ``hi`` (in cache for blocks that fit), one for steps 2–3 writing the packed
    codes and the estimate; the same float operations as the torch code, so
    both give the same bytes.
    """

    n_arrays = 3

    def __init__(self, bits: int, block: int = 0) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise CodecError(f"uniform:BITS needs an integer 1..8, got {bits!r}")
        self.bits = bits
        self.block = _check_block("uniform", block)
        self.spec = f"uniform:{bits}" if self.block == 0 else f"uniform:{bits}:{self.block}"

    def contraction(self, numel: int) -> float:
        """``1 − 1/(2^BITS − 1)²``: rounding to a grid of the range's ``2^BITS − 1`` steps loses
        at most a quarter step² per value, against values spread over the range."""
        return 1 - 1 / (2**self.bits - 1) ** 2

    def _values(
        self, codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, count: int
    ) -> torch.Tensor:
        """Step 3, shared by encode and decode: ``q·step + lo`` (two roundings, no FMA)."""
        out = codes.float() * _expand(step, self.block, count)
        return out.add_(_expand(lo, self.block, count))

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        native = native_kernels(v.device)
        if native is not None:
            return self._encode_native(native, v.numpy())
        count, top = v.numel(), (1 << self.bits) - 1
        # 1. lo, hi and step per tensor or block.
        lo = _reduce(v, self.block, lambda rows: rows.amin(dim=1))
        hi = _reduce(v, self.block, lambda rows: rows.amax(dim=1))
        step = (hi - lo) / top
        inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        # 2. q = round((x − lo)/step), clamped.
        q = (v - _expand(lo, self.block, count)) * _expand(inverse, self.block, count)
        codes = q.add_(0.5).floor_().clamp_(0, top).to(torch.uint8)
        # 3. the receiver's value.
        estimate = self._values(codes, lo, step, count)
        arrays = (pack_bits(codes, self.bits), to_host(lo).copy(), to_host(step).copy())
        return Payload(arrays, {}), estimate

    def _encode_native(self, native: ModuleType, v: np.ndarray) -> tuple[Payload, torch.Tensor]:
        """Steps 1–3 by the C kernels, the estimate into recycled memory."""
        blocks = _num_blocks(v.size, self.block)
        packed = np.empty(packed_size(v.size, self.bits), np.uint8)
        lo, step = np.empty(blocks, np.float32), np.empty(blocks, np.float32)
        out = host_empty(v.size)
        native.uniform_encode(v, packed, lo, step, out, self.bits, self.block)
        return Payload((packed, lo, step), {}), torch.from_numpy(out)

    def layout(self, count: int) -> Layout:
        blocks = _num_blocks(count, self.block)
        return Layout(
            (("uint8", packed_size(count, self.bits)), ("float32", blocks), ("float32", blocks))
        )

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        count = check_numel(numel)
        packed, lo, step = check_layout(payload, self.spec, self.layout(count))
        check_scales(step, self.spec)
        if lo.size and not np.isfinite(lo).all():
            raise CodecError(f"{self.spec}: lo must be finite")
        reach = np.abs(lo.astype(np.float64)) + (2**self.bits - 1) * step.astype(np.float64)
        if reach.size and reach.max() > MAX_DECODED:
            raise CodecError(f"{self.spec}: lo + (2^BITS − 1)·step overflows float32")
        device = torch.device(device)
        native = native_kernels(device)
        if native is not None:
            out = host_empty(count)
            native.uniform_decode(packed, lo, step, out, self.bits, self.block)
            return torch.from_numpy(out)
        codes = unpack_bits(packed, self.bits, count, device)
        return self._values(codes, from_host(lo, device), from_host(step, device), count)
