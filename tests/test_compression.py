"""Tests for gossipdl.compression: round trips, bias, error feedback, bytes, bad payloads."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gossipdl.averaging.choco import choco_step
from gossipdl.compression import (
    Codec,
    CodecError,
    ErrorFeedback,
    Payload,
    available_codecs,
    build_codec,
    register_codec,
)
from gossipdl.compression import _kernels as kernels
from gossipdl.compression import powersgd as powersgd_module
from gossipdl.compression import sparse as sparse_module
from gossipdl.compression.base import ValueCodec
from gossipdl.compression.floating import Float16
from gossipdl.compression.indices import DeltaGolomb, golomb_streams
from gossipdl.compression.powersgd import (
    LowRankLayout,
    matrix_shape,
    power_step,
    reconstruct,
    row_split,
)
from gossipdl.compression.quantization import QSGD, Sign
from gossipdl.compression.sparse import random_subset

EXAMPLES = [
    "topk:0.01",
    "topk:0.01+fp16",
    "topk:0.01+qsgd:16+delta-golomb",
    "threshold:auto+sign",
    "randomk:0.01",
    "powersgd:2",
    "fp16",
    "sign",
    "uniform:4",
    "ternary",
    "none",
]
COMBOS = [
    "dense",
    "bf16",
    "sign:5",
    "sign:16",
    "uniform:1",
    "uniform:3:7",
    "uniform:8:16",
    "ternary:6",
    "qsgd:16",
    "qsgd:4:0",
    "qsgd:1:8",
    "qsgd:16:trits",
    "qsgd:2:7:trits",
    "topk:0.05+qsgd:16:trits+raw",
    "topk:0.2+raw",
    "topk:0.3+delta-varint",
    "topk:0.05+delta-zlib",
    "topk:0.5+bf16+raw",
    "threshold:0.5+bf16+delta-varint",
    "threshold:auto:0.2+uniform:2:4",
    "randomk:0.25:noscale+ternary",
    "randomk:0.6+fp16",
    "powersgd:1+ef",
    "topk:0.01+ef",
    "sign+ef",
    "topk:0.1+qsgd:4+raw+ef",
]
SPECS = EXAMPLES + COMBOS
FAST = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)

finite32 = st.floats(-1e4, 1e4, width=32, allow_subnormal=True)


def vectors(max_size: int = 300) -> st.SearchStrategy[torch.Tensor]:
    """1-D float32 tensors with zeros, -0.0, ties and subnormals among the values."""
    special = st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-40, 3.5])
    return hnp.arrays(
        np.float32, st.integers(0, max_size), elements=st.one_of(finite32, special)
    ).map(lambda a: torch.from_numpy(a.copy()))


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32
    assert a.shape == b.shape
    np.testing.assert_array_equal(bits_of(a), bits_of(b))


def wire_copy(payload: Payload) -> Payload:
    """The payload as a receiver sees it: read-only arrays from bytes, meta through msgpack."""
    arrays = tuple(np.frombuffer(a.tobytes(), dtype=a.dtype) for a in payload.arrays)
    return Payload(arrays, msgpack.unpackb(msgpack.packb(payload.meta)))


@pytest.fixture(params=["numpy", "torch"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the numpy CPU kernels (default) and with the torch kernels forced."""
    if request.param == "torch":
        with kernels.torch_kernels():
            yield "torch"
    else:
        yield "numpy"


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@FAST
@given(x=vectors())
def test_round_trip_matches_sender_estimate(spec: str, x: torch.Tensor) -> None:
    """decode(payload) on another instance equals the sender's estimate bit for bit."""
    original = x.clone()
    sender, receiver = build_codec(spec, seed=1), build_codec(spec, seed=999)
    payload, sent = sender.encode(x)
    assert_bitwise(x, original)  # encode does not modify its input
    assert sent.shape == x.shape and sent.device == x.device
    received = receiver.decode(wire_copy(payload), x.numel(), "cpu")
    assert_bitwise(received, sent)
    assert_bitwise(sender.decode(payload, x.numel(), torch.device("cpu")), sent)
    for array in payload.arrays:
        assert array.ndim == 1 and array.flags.c_contiguous
        assert not np.shares_memory(array, sent.numpy())
        assert not np.shares_memory(array, x.numpy())


@pytest.mark.parametrize("other", ["torch", "numpy"])
@pytest.mark.parametrize("spec", [s for s in SPECS if "ef" not in s.split("+")])
@settings(max_examples=5, deadline=None, derandomize=True)
@given(x=vectors(200))
def test_other_kernels_round_trip(spec: str, other: str, x: torch.Tensor) -> None:
    """The torch kernels (what runs on a GPU) and the numpy ones (a build without a C
    compiler) decode what the default CPU kernels encode, and back."""
    switch = kernels.torch_kernels if other == "torch" else kernels.numpy_kernels
    payload, sent = build_codec(spec, seed=1).encode(x)
    with switch():
        assert_bitwise(build_codec(spec).decode(wire_copy(payload), x.numel(), "cpu"), sent)
        payload_t, sent_t = build_codec(spec, seed=1).encode(x)
    assert_bitwise(build_codec(spec).decode(wire_copy(payload_t), x.numel(), "cpu"), sent_t)
    # Deterministic given the seed: same payload from both kernels, but for the scales of
    # sign and the norms of qsgd (float sums in different orders), what auto thresholds
    # sample, and the codes of ternary and qsgd (the C kernels round with their own
    # random stream: test_c_ternary_matches_its_reference and the qsgd one check them).
    rounded = any(stage.split(":")[0] in ("ternary", "qsgd") for stage in spec.split("+"))
    assert len(payload.arrays) == len(payload_t.arrays)
    assert payload.meta == payload_t.meta or spec.startswith("threshold:auto")
    for a, b in zip(payload.arrays, payload_t.arrays, strict=True):
        if spec.startswith("threshold:auto"):
            continue
        assert a.dtype == b.dtype
        if ":trits" in spec:  # how many levels exceed 1 depends on the draw
            continue
        assert a.shape == b.shape
        if (spec.startswith("sign") or rounded) and a.dtype == np.float32:  # the scales
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-38)  # torch's norm underflows
        elif not rounded:
            np.testing.assert_array_equal(a, b)


NATIVE_ISAS = ["avx512f", "avx2", "generic"]
CPU_KERNELS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "c": contextlib.nullcontext,
    "numpy": kernels.numpy_kernels,
    "torch": kernels.torch_kernels,
}  # what a CPU runs by default, without a C compiler, and what a GPU runs


@pytest.fixture(params=NATIVE_ISAS)
def native_isa(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The C kernels with each instruction set this CPU has (the others are skipped)."""
    native = kernels.native_kernels(torch.device("cpu"))
    if native is None:
        pytest.skip("the C kernels are not built (no compiler); test_c_kernels_are_built says")
    try:
        before = native.use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param}")
    try:
        yield native
    finally:
        native.use_isa(before)


def test_c_kernels_are_built() -> None:
    """A machine with a C compiler (CI's) builds them: a compile error must not pass unseen
    as a silent fallback to the slower numpy kernels."""
    import sysconfig
    from shutil import which

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: the numpy kernels run")
    assert kernels.native_kernels(torch.device("cpu")) is not None, (
        "gossipdl.compression._native did not build; run `pip install -e .` and read the "
        "compiler's error"
    )


@pytest.mark.parametrize(
    "count", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100, 4095, 4096, 4097, 70_001]
)
def test_c_sign_kernels_match_numpy(native_isa: Any, count: int) -> None:
    rng = np.random.default_rng(count)
    x = rng.standard_normal(count).astype(np.float32) * 100
    x[: min(count, 3)] = [-0.0, 0.0, -1e-40][: min(count, 3)]  # -0.0 and subnormals: sign bits
    bits = np.full((count + 7) // 8, 0xAB, np.uint8)  # stale bytes must all be overwritten
    l1 = native_isa.sign_encode(x, bits)
    np.testing.assert_array_equal(bits, np.packbits(np.signbit(x), bitorder="little"))
    assert l1 == pytest.approx(float(np.abs(x.astype(np.float64)).sum()), rel=1e-5, abs=1e-30)
    out = np.full(count, np.nan, np.float32)
    native_isa.sign_expand(bits, np.array([0.75], np.float32), out)
    expected = np.where(np.signbit(x), np.float32(-0.75), np.float32(0.75))
    np.testing.assert_array_equal(out.view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("block", [8, 16, 24, 4096, 8192])
@pytest.mark.parametrize("count", [0, 5, 8, 100, 4097, 20_001])
def test_c_sign_kernels_by_block_match_numpy(native_isa: Any, count: int, block: int) -> None:
    rng = np.random.default_rng(count + block)
    x = rng.standard_normal(count).astype(np.float32)
    bits = np.full((count + 7) // 8, 0xAB, np.uint8)
    blocks = -(-count // block)
    sums = np.full(blocks, np.nan)
    total = native_isa.sign_encode(x, bits, block, sums)
    np.testing.assert_array_equal(bits, np.packbits(np.signbit(x), bitorder="little"))
    magnitude = np.abs(x.astype(np.float64))
    want = [magnitude[i : i + block].sum() for i in range(0, count, block)]
    np.testing.assert_allclose(sums, want, rtol=1e-5)
    assert total == pytest.approx(sum(want), rel=1e-5, abs=1e-30)
    scales = np.arange(1, blocks + 1, dtype=np.float32)
    out = np.full(count, np.nan, np.float32)
    native_isa.sign_expand(bits, scales, out, block)
    per_value = np.repeat(scales, block)[:count]
    np.testing.assert_array_equal(out, np.where(np.signbit(x), -per_value, per_value))


def test_c_sign_expand_streams_large_aligned_outputs(native_isa: Any) -> None:
    """Outputs of 16 MB and more, 64-byte aligned, take the non-temporal store path."""
    count = (16 << 20) // 4 + 21
    x = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    bits = np.empty((count + 7) // 8, np.uint8)
    native_isa.sign_encode(x, bits)
    out = kernels.host_empty(count)
    assert out.ctypes.data % 64 == 0
    for block, scales in ((0, [2.0]), (4096, [2.0] * -(-count // 4096))):
        out[:] = np.nan
        native_isa.sign_expand(bits, np.array(scales, np.float32), out, block)
        np.testing.assert_array_equal(out, np.where(np.signbit(x), np.float32(-2), np.float32(2)))


def test_c_sign_kernels_name_a_size_mismatch() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    if native is None:
        pytest.skip("the C kernels are not built")
    with pytest.raises(ValueError, match="3 values need 1 bytes of sign bits, got 2"):
        native.sign_encode(np.zeros(3, np.float32), np.zeros(2, np.uint8))
    one = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="5 bytes is not whole values"):
        native.sign_expand(np.zeros(1, np.uint8), one, np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match=r"block 12 must be 0 \(whole tensor\) or a positive"):
        native.sign_encode(np.zeros(16, np.float32), np.zeros(2, np.uint8), 12)
    with pytest.raises(ValueError, match="2 blocks need 16 bytes of sums, got 8"):
        native.sign_encode(np.zeros(16, np.float32), np.zeros(2, np.uint8), 8, np.zeros(1))
    with pytest.raises(ValueError, match="2 blocks need 8 bytes of scales, got 4"):
        native.sign_expand(np.zeros(2, np.uint8), one, np.zeros(16, np.float32), 8)
    with pytest.raises(TypeError, match="read-write"):
        native.sign_encode(np.zeros(8, np.float32), np.frombuffer(b"x", np.uint8))
    with pytest.raises(ValueError, match="sse9 is unknown or not on this CPU"):
        native.use_isa("sse9")


# --- the C quantizers: ternary, qsgd, uniform ----------------------------------------------------


def xoshiro_uniform24(seed: int, count: int) -> np.ndarray:
    """The C kernels' random numbers for one encode: 16 xoshiro128+ generators seeded by
    splitmix64 from ``seed``; value i takes step i // 16 of generator i % 16, top 24 bits."""
    mask, state, words = 2**64 - 1, seed, []
    for _ in range(32):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        words += [z & 0xFFFFFFFF, z >> 32]
    s0, s1, s2, s3 = np.array(words, np.uint32).reshape(4, 16)
    steps = np.empty((-(-count // 16), 16), np.uint32)
    for k in range(len(steps)):
        steps[k] = s0 + s3
        t = s1 << np.uint32(9)
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = (s3 << np.uint32(11)) | (s3 >> np.uint32(21))
    return (steps.reshape(-1)[:count] >> np.uint32(8)).astype(np.float32)


def per_value(scales: np.ndarray, block: int, count: int) -> np.ndarray:
    return np.repeat(scales, block or count)[:count] if count else np.zeros(0, np.float32)


def ternary_reference(x: np.ndarray, block: int, seed: int) -> tuple[np.ndarray, ...]:
    """TernGrad as documented for the C kernels: keep with u < |x|·(2^24/s)."""
    count = x.size
    size = block or max(count, 1)
    scales = np.array(
        [np.abs(x[i : i + size]).max() for i in range(0, count, size)] or [0.0], np.float32
    )[: -(-count // block) if block else 1]
    s = per_value(scales, block, count)
    inv24 = np.divide(np.float32(2**24), s, out=np.zeros_like(s), where=s > 0)
    keep = xoshiro_uniform24(seed, count) < np.abs(x) * inv24
    digits = np.where(keep, np.where(x < 0, 0, 2), 1).astype(np.uint8)
    estimate = (digits.astype(np.float32) - 1) * s
    padded = np.ones(-(-count // 5) * 5, np.uint8)
    padded[:count] = digits
    packed = (padded.reshape(-1, 5).astype(np.int32) * 3 ** np.arange(5)).sum(1)
    return packed.astype(np.uint8), scales, estimate


def qsgd_reference(
    x: np.ndarray, levels: int, bucket: int, norms: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """QSGD as documented for the C kernels, given their norms: the packed codes and the
    estimate."""
    count, s = x.size, np.float32(levels)
    norm = per_value(norms, bucket, count)
    scale = np.divide(s, norm, out=np.zeros_like(norm), where=norm > 0)
    r = np.abs(x) * scale
    low = np.floor(r)
    level = low + (xoshiro_uniform24(seed, count) < (r - low) * np.float32(2**24))
    level = np.minimum(np.where(level > 0, level, 0), s).astype(np.float32)
    code = np.where(x < 0, s - level, s + level).astype(np.float32)
    estimate = (code - s) * (norm / s)
    bits = (2 * levels).bit_length()
    return kernels.pack_bits(torch.from_numpy(code.astype(np.uint8)), bits), estimate


def seeded_encode(codec: Codec, x: torch.Tensor) -> tuple[Payload, torch.Tensor, int]:
    """Encode with the seed the codec draws for this call, and that seed."""
    state = codec._rng.numpy.bit_generator.state  # type: ignore[attr-defined]
    seed = codec._rng.message_seed()  # type: ignore[attr-defined]
    codec._rng.numpy.bit_generator.state = state  # type: ignore[attr-defined]
    payload, estimate = codec.encode(x)
    return payload, estimate, seed


QUANTIZER_COUNTS = [0, 1, 15, 17, 79, 80, 81, 4079, 4081, 8161, 20_001]


@pytest.mark.parametrize("block", [0, 6, 16, 100, 4096])
def test_c_ternary_matches_its_reference(native_isa: Any, block: int) -> None:
    """Every instruction set's kernels give the documented bytes, scales and estimate (the
    same random numbers, so the same rounding), and decode what they encode."""
    for count in QUANTIZER_COUNTS:
        x = np.random.default_rng(count).standard_normal(count).astype(np.float32)
        x[: min(count, 4)] = [0.0, -0.0, 1e-40, -3.0][: min(count, 4)]
        codec = build_codec("ternary" if block == 0 else f"ternary:{block}", seed=count)
        payload, estimate, seed = seeded_encode(codec, torch.from_numpy(x))
        packed, scales, want = ternary_reference(x, block, seed)
        np.testing.assert_array_equal(payload.arrays[0], packed, err_msg=str(count))
        np.testing.assert_array_equal(payload.arrays[1].view(np.int32), scales.view(np.int32))
        assert_bitwise(estimate, torch.from_numpy(want))
        assert_bitwise(codec.decode(wire_copy(payload), count), estimate)


@pytest.mark.parametrize(("levels", "bucket"), [(16, 512), (4, 0), (1, 8), (127, 100), (5, 3)])
def test_c_qsgd_matches_its_reference(native_isa: Any, levels: int, bucket: int) -> None:
    for count in QUANTIZER_COUNTS:
        x = np.random.default_rng(count).standard_normal(count).astype(np.float32)
        x[: min(count, 3)] = [0.0, -0.0, -3.0][: min(count, 3)]
        codec = QSGD(levels, bucket, seed=count)
        payload, estimate, seed = seeded_encode(codec, torch.from_numpy(x))
        packed, norms = payload.arrays
        size = bucket or max(count, 1)
        want_norms = [
            np.linalg.norm(x[i : i + size].astype(np.float64)) for i in range(0, count, size)
        ]
        np.testing.assert_allclose(norms, want_norms or [0.0][: 1 if bucket == 0 else 0], rtol=1e-6)
        want_packed, want = qsgd_reference(x, levels, bucket, norms, seed)
        np.testing.assert_array_equal(packed, want_packed, err_msg=str(count))
        assert_bitwise(estimate, torch.from_numpy(want))
        assert_bitwise(codec.decode(wire_copy(payload), count), estimate)


def test_qsgd_trits_sends_the_fixed_codes_levels_in_fewer_bytes() -> None:
    """``:trits`` is a coding, not a rounding: the receiver reads the fixed codes' values bit
    for bit, in about a third of their bytes for top-k's kept values (levels mostly -1..1),
    with the few larger levels listed apart."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(600_000, generator=g) * torch.rand(600_000, generator=g) ** 4
    fixed = build_codec("topk:0.005+qsgd:16", 7)
    patched = build_codec("topk:0.005+qsgd:16:trits", 7)
    sent_fixed, estimate_fixed = fixed.encode(x)
    sent, estimate = patched.encode(x)
    assert_bitwise(estimate, estimate_fixed)
    assert_bitwise(patched.decode(wire_copy(sent), x.numel()), estimate)
    values, values_fixed = sent.arrays[-4:], sent_fixed.arrays[-2:]
    k = 3000
    assert values[0].nbytes == k // 5 and values_fixed[0].nbytes == k * 6 // 8
    assert 0 < values[2].size < k // 20  # exceptions: positions and levels of |level| >= 2
    assert (np.abs(values[3]) >= 2).all()
    assert sum(a.nbytes for a in values) < 0.45 * sum(a.nbytes for a in values_fixed)
    with kernels.torch_kernels():
        assert_bitwise(patched.decode(wire_copy(sent), x.numel()), estimate)


@pytest.mark.parametrize(
    ("change", "part"),
    [
        (lambda a: (a[0], a[1], a[2][:-1], a[3]), "positions but"),
        (lambda a: (a[0], a[1], a[2][::-1].copy(), a[3]), "not strictly increasing"),
        (lambda a: (a[0], a[1], a[2] + np.uint16(2000), a[3]), r"inside \[0, 1000\)"),
        (lambda a: (a[0], a[1], a[2], np.ones_like(a[3])), "2..16"),
        (lambda a: (a[0], a[1], a[2], np.full_like(a[3], 17)), "2..16"),
        (lambda a: (np.full_like(a[0], 243), *a[1:]), "exceeds 242"),
    ],
)
def test_qsgd_trits_refuses_bad_exceptions(change: Callable, part: str) -> None:
    codec = build_codec("qsgd:16:trits")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload, _ = codec.encode(x)
    assert payload.arrays[2].size > 1
    with pytest.raises(CodecError, match=part):
        codec.decode(Payload(change(payload.arrays), {}), 1000)


def test_qsgd_trits_refuses_a_negative_exception_position() -> None:
    """Above 65,536 values positions are int32: a negative one would index from the end."""
    codec = build_codec("qsgd:16:trits")
    x = torch.randn(70_000, generator=torch.Generator().manual_seed(0))
    payload, _ = codec.encode(x)
    packed, norms, positions, big = payload.arrays
    assert positions.dtype == np.int32 and positions.size > 1
    bad = positions.copy()
    bad[0] = -5
    with pytest.raises(CodecError, match="out of range"):
        codec.decode(Payload((packed, norms, bad, big), {}), x.numel())


def test_qsgd_trits_has_no_layout_before_encoding() -> None:
    with pytest.raises(CodecError, match="depends on its codes"):
        build_codec("qsgd:16:trits").layout(100)
    assert not build_codec("qsgd:16:trits").fixed_layout and build_codec("qsgd:16").fixed_layout


@pytest.mark.parametrize("spec", ["uniform:4", "uniform:8:1024", "uniform:3:7", "uniform:1:16"])
def test_c_uniform_matches_the_torch_kernels(native_isa: Any, spec: str) -> None:
    """Rounding to nearest is deterministic: the bytes and values of the torch code."""
    codec = build_codec(spec)
    for count in QUANTIZER_COUNTS:
        x = torch.from_numpy(np.random.default_rng(count).standard_normal(count).astype(np.float32))
        payload, estimate = codec.encode(x)
        with kernels.torch_kernels():
            payload_t, estimate_t = codec.encode(x)
        for a, b in zip(payload.arrays, payload_t.arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        assert_bitwise(estimate, estimate_t)
        assert_bitwise(codec.decode(wire_copy(payload), count), estimate)


@pytest.mark.parametrize("spec", ["ternary", "ternary:4096", "qsgd:16", "qsgd:6:0", "uniform:4"])
def test_c_quantizers_stream_large_outputs_alike_on_every_isa(native_isa: Any, spec: str) -> None:
    """16 MB and more: the estimate and the decoded tensor are written with non-temporal
    stores; the bytes and values are those of the generic kernels, and the torch kernels
    decode them."""
    count = (16 << 20) // 4 + 37
    x = torch.randn(count, generator=torch.Generator().manual_seed(5))
    payload, estimate = build_codec(spec, seed=3).encode(x)
    before = native_isa.use_isa("generic")
    try:
        payload_g, estimate_g = build_codec(spec, seed=3).encode(x)
    finally:
        native_isa.use_isa(before)
    for a, b in zip(payload.arrays, payload_g.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_bitwise(estimate, estimate_g)
    assert_bitwise(build_codec(spec).decode(payload, count), estimate)
    with kernels.torch_kernels():
        assert_bitwise(build_codec(spec).decode(payload, count), estimate)


@pytest.mark.parametrize("spec", ["ternary", "ternary:6", "qsgd:16", "qsgd:3:7", "uniform:5:9"])
def test_c_and_torch_quantizers_decode_each_others_payloads(spec: str) -> None:
    """Long enough for every vector path: each kernel decodes what the other encodes into
    the other's estimate, bit for bit."""
    x = torch.randn(20_001, generator=torch.Generator().manual_seed(1))
    payload, estimate = build_codec(spec, seed=1).encode(x)
    with kernels.torch_kernels():
        assert_bitwise(build_codec(spec).decode(wire_copy(payload), x.numel()), estimate)
        payload_t, estimate_t = build_codec(spec, seed=1).encode(x)
    assert_bitwise(build_codec(spec).decode(wire_copy(payload_t), x.numel()), estimate_t)


def test_c_rounding_resolves_small_probabilities() -> None:
    """24 random bits per value: a value kept with probability 1e-5 (under 2^-16) is kept
    about that often, not never; and a seed gives the same draw, a second call another."""
    count = 2_000_001
    x = torch.full((count,), 1e-5)
    x[0] = 1.0  # s = 1: each other value is kept with probability 1e-5
    codec = build_codec("ternary", seed=4)
    kept = [int((codec.encode(x)[1][1:] != 0).sum()) for _ in range(5)]
    expected = 1e-5 * (count - 1)  # 20 per call
    assert abs(sum(kept) - 5 * expected) < 5 * math.sqrt(5 * expected), kept
    assert len(set(kept)) > 1
    first = build_codec("ternary", seed=4).encode(x)[0].arrays[0]
    again = build_codec("ternary", seed=4).encode(x)[0].arrays[0]
    np.testing.assert_array_equal(first, again)


def test_c_quantizers_name_a_size_mismatch() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    if native is None:
        pytest.skip("the C kernels are not built")
    x, one = np.zeros(10, np.float32), np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="10 values need 2 bytes of packed codes, got 3"):
        native.ternary_encode(x, np.zeros(3, np.uint8), one, np.zeros(10, np.float32), 1)
    with pytest.raises(ValueError, match="out has 36 bytes, x 40"):
        native.ternary_encode(x, np.zeros(2, np.uint8), one, np.zeros(9, np.float32), 1)
    with pytest.raises(ValueError, match="2 blocks need 8 bytes of scales, got 4"):
        native.ternary_decode(np.zeros(2, np.uint8), one, np.zeros(10, np.float32), 5)
    with pytest.raises(ValueError, match="10 values need 8 bytes of packed codes, got 7"):
        native.qsgd_decode(np.zeros(7, np.uint8), one, np.zeros(10, np.float32), 16, 0)
    with pytest.raises(ValueError, match=r"levels 128 must be 1\.\.127"):
        native.qsgd_encode(x, np.zeros(10, np.uint8), one, np.zeros(10, np.float32), 128, 1)
    with pytest.raises(ValueError, match=r"bits 9 must be 1\.\.8"):
        native.uniform_decode(np.zeros(10, np.uint8), one, one, np.zeros(10, np.float32), 9)
    with pytest.raises(ValueError, match="block -1 must be 0"):
        native.uniform_decode(np.zeros(5, np.uint8), one, one, np.zeros(10, np.float32), 4, -1)
    with pytest.raises(ValueError, match="6 bytes is not whole values"):
        native.ternary_decode(np.zeros(2, np.uint8), one, np.zeros(6, np.uint8))
    with pytest.raises(TypeError, match="read-write"):
        native.qsgd_encode(
            x, np.zeros(8, np.uint8), one, np.frombuffer(bytes(40), np.float32), 16, 1
        )


def test_recycled_host_memory_comes_back_only_when_no_view_is_left() -> None:
    recycler = kernels._Recycler(min_bytes=1 << 20, keep=2)
    count = 1 << 20  # bytes
    a = recycler.empty(count).view(np.float32)
    address = a.ctypes.data
    t = torch.from_numpy(a)
    view = t[10:]  # torch views and numpy views of them keep the memory
    array_view = view.numpy()[5:]
    del a, t, view
    fresh = recycler.empty(count)
    assert fresh.ctypes.data != address  # still in use: a new block
    array_view[0] = 1.0
    del array_view
    again = recycler.empty(count)
    assert again.ctypes.data == address  # gone: the same memory again
    other_size = recycler.empty(count - 4)
    assert other_size.ctypes.data not in (address, fresh.ctypes.data)
    small = recycler.empty(10)
    assert small.base is None  # under min_bytes: plain numpy memory


def test_the_recycler_keeps_no_more_idle_memory_than_its_cap() -> None:
    recycler = kernels._Recycler(min_bytes=1 << 20, keep=8, max_bytes=3 << 20)
    blocks = [recycler.empty(1 << 20) for _ in range(5)]
    del blocks  # five blocks come back; three fit under the cap
    assert len(recycler._free) == 3


def test_recycled_tensors_of_any_type_give_their_memory_back() -> None:
    """host_tensor's tensors (float32, half, bfloat16) are views of a recycled block: the
    next tensor of the same size gets the block once the last one is gone."""
    count = (32 << 20) // 2
    half = kernels.host_tensor(count, torch.float16)
    address = half.data_ptr()
    brain = kernels.host_tensor(count, torch.bfloat16)
    assert brain.data_ptr() != address  # the first is still alive
    del half
    again = kernels.host_tensor(count // 2, torch.float32)  # the same bytes
    assert again.data_ptr() == address and again.dtype == torch.float32
    assert kernels.host_tensor(0, torch.bfloat16).shape == (0,)


@FAST
@given(
    values=hnp.arrays(np.uint8, st.integers(0, 70), elements=st.integers(0, 255)),
    bits=st.integers(1, 8),
)
def test_bit_packing_kernels_agree(values: np.ndarray, bits: int) -> None:
    q = torch.from_numpy(values & ((1 << bits) - 1))
    packed = kernels.pack_bits(q, bits)
    assert packed.size == kernels.packed_size(q.numel(), bits)
    with kernels.torch_kernels():
        np.testing.assert_array_equal(kernels.pack_bits(q, bits), packed)
        unpacked_t = kernels.unpack_bits(packed, bits, q.numel(), torch.device("cpu"))
    unpacked = kernels.unpack_bits(packed, bits, q.numel(), torch.device("cpu"))
    assert torch.equal(unpacked, q) and torch.equal(unpacked_t, q)
    if bits == 1:  # the stream is np.packbits(bitorder="little")
        np.testing.assert_array_equal(packed, np.packbits(q.numpy(), bitorder="little"))


def test_none_is_lossless_for_every_bit_pattern() -> None:
    raw = np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32)
    x = torch.from_numpy(raw.view(np.float32).copy())  # includes NaNs, infinities, subnormals
    codec = build_codec("none")
    assert not codec.lossy and build_codec("dense").spec == "none"
    payload, sent = codec.encode(x)
    np.testing.assert_array_equal(
        bits_of(codec.decode(wire_copy(payload), 5000)), raw.view(np.int32)
    )
    np.testing.assert_array_equal(bits_of(sent), raw.view(np.int32))


def test_fp16_clamps_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, float("inf"), 1.5, 70000.0])
    _, sent = build_codec("fp16").encode(x)
    assert sent.tolist() == [65504.0, -65504.0, 65504.0, 1.5, 65504.0]


@pytest.mark.parametrize("spec", ["fp16", "bf16", "uniform:8", "qsgd:127:0"])
def test_fine_quantizers_are_close(spec: str) -> None:
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    _, sent = build_codec(spec).encode(x)
    bound = {"fp16": 1e-3, "bf16": 4e-3, "uniform:8": 1e-2, "qsgd:127:0": 0.6}[spec]
    assert float((sent - x).norm() / x.norm()) < bound


def test_sign_sends_mean_magnitude() -> None:
    x = torch.tensor([3.0, -1.0, 0.0, -0.0, 2.0])
    payload, sent = build_codec("sign").encode(x)
    assert sent.tolist() == pytest.approx([1.2, -1.2, 1.2, -1.2, 1.2])  # ‖x‖₁/d = 6/5
    assert torch.signbit(sent).tolist() == [False, True, False, True, False]  # -0.0: sign bit
    assert payload.arrays[1].tolist() == pytest.approx([1.2])
    _, blocked = build_codec("sign:2").encode(x)
    assert blocked.tolist() == pytest.approx([2.0, -2.0, 0.0, -0.0, 2.0])


# --- sparsifiers -------------------------------------------------------------------------------


@pytest.fixture(params=["exact", "sampled"])
def topk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Exercise both torch.topk and the sample-threshold-refine path on small vectors."""
    if request.param == "sampled":
        monkeypatch.setattr(sparse_module, "_EXACT_BELOW", 0)
    return request.param


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(x=vectors(400))
def test_topk_keeps_the_largest_magnitudes(
    topk_path: str, backend: str, ratio: float, x: torch.Tensor
) -> None:
    codec = build_codec(f"topk:{ratio}")
    payload, sent = codec.encode(x)
    n = x.numel()
    kept = np.flatnonzero(sent.numpy() != 0)
    assert payload.meta["k"] == (min(n, max(1, math.ceil(ratio * n))) if n else 0)
    indices = codec.indices.decode(  # type: ignore[attr-defined]
        payload.arrays[:2], {"b": payload.meta["i.b"]}, payload.meta["k"], n
    )
    assert (np.diff(indices) > 0).all() and set(kept) <= set(indices)
    np.testing.assert_array_equal(sent.numpy()[indices], x.numpy()[indices])
    dropped = np.setdiff1d(np.arange(n), indices)
    if indices.size and dropped.size:
        assert np.abs(x.numpy()[indices]).min() >= np.abs(x.numpy()[dropped]).max()


def test_topk_fast_path_on_a_large_vector() -> None:
    x = torch.randn(700_000, generator=torch.Generator().manual_seed(3))
    x[:1000] = 0.0  # some ties at zero
    codec = build_codec("topk:0.01")
    payload, sent = codec.encode(x)
    k = 7000
    assert payload.meta["k"] == k and int((sent != 0).sum()) == k
    magnitude = x.abs()
    assert float(magnitude[sent != 0].min()) >= float(magnitude[sent == 0].max())
    assert torch.equal(sent[sent != 0], x[sent != 0])


def test_topk_fast_path_falls_back_on_ties() -> None:
    x = torch.ones(600_000)
    x[::2] = -1.0
    x[5] = 7.0
    payload, sent = build_codec("topk:0.3").encode(x)
    assert payload.meta["k"] == 180_000 and int((sent != 0).sum()) == 180_000
    assert float(sent[5]) == 7.0


def test_threshold_keeps_exactly_above_tau_and_auto_hits_density() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    _, sent = build_codec("threshold:2.0").encode(x)
    assert torch.equal(sent != 0, x.abs() > 2.0)
    for spec, density in [("threshold:auto", 0.01), ("threshold:auto:0.001", 0.001)]:
        payload, _ = build_codec(spec).encode(x)
        # 131,072 samples: relative std of the count is 2.7% (0.01) and 8.7% (0.001).
        assert abs(int(payload.meta["k"]) / (density * x.numel()) - 1) < 0.3


def test_random_subset_is_deterministic_sorted_and_uniform() -> None:
    a = random_subset(123, 1000, 100)
    assert np.array_equal(a, random_subset(123, 1000, 100))
    assert a.size == 100 and (np.diff(a) > 0).all() and a[0] >= 0 and a[-1] < 1000
    assert random_subset(5, 10, 7).size == 7  # the complement branch
    counts = np.zeros(20)
    for seed in range(2000):
        counts[random_subset(seed, 20, 5)] += 1
    expected = 2000 * 5 / 20
    assert np.abs(counts - expected).max() < 5 * math.sqrt(expected)


@pytest.mark.parametrize(
    ("numel", "count"), [(1000, 100), (1000, 600), (17, 16), (9, 1), (64, 63), (100_003, 50_002)]
)
def test_random_subset_is_the_same_from_the_c_bitmap_and_from_numpy(numel: int, count: int) -> None:
    """Sender and receiver may run different kernels (one built without a compiler): each
    derives the same subset from the message's seed, the complement branch included."""
    assert kernels.native_kernels(torch.device("cpu")) is not None
    for seed in (0, 7, 2**63 - 2):
        c = random_subset(seed, numel, count)
        with kernels.numpy_kernels():
            assert np.array_equal(c, random_subset(seed, numel, count))


def test_the_subset_kernels_check_their_sizes() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    assert native is not None
    draws, seen = np.arange(4, dtype=np.uint64), np.zeros(2, np.uint8)
    with pytest.raises(ValueError, match="3 bitmap bytes"):
        native.subset_mark(draws, 17, seen, 0, 2)  # 17 bits need 3 bytes
    with pytest.raises(ValueError, match="want <= numel"):
        native.subset_mark(draws, 9, np.zeros(2, np.uint8), 0, 10)
    assert native.subset_mark(draws, 9, np.zeros(2, np.uint8), 0, 3) == 3
    with pytest.raises(ValueError, match="2 positions have bit 1, but out holds 3"):
        native.subset_positions(np.array([0b101], np.uint8), 8, 1, np.empty(3, np.int64))
    out = np.empty(2, np.int64)
    native.subset_positions(np.array([0b11111010, 0xFF], np.uint8), 9, 0, out)  # bit 8 is set
    assert out.tolist() == [0, 2]


@pytest.mark.parametrize("count", [0, 1, 31, 32, 33, 1000, 100_003])
def test_c_magnitude_at_least_matches_numpy(native_isa: Any, count: int) -> None:
    """Positions and values of ``|x| >= tau`` on every instruction set: never NaN, always
    ``±tau`` itself, and an output too short for them still counts them all."""
    rng = np.random.default_rng(count)
    x = rng.standard_normal(count).astype(np.float32)
    x[::13] = np.nan
    x[5::17] = -1.5
    want = np.flatnonzero(np.abs(x) >= 1.5)
    idx, val = np.full(count, -7, np.int64), np.full(count, np.nan, np.float32)
    assert native_isa.magnitude_at_least(x, 1.5, idx, val) == want.size
    np.testing.assert_array_equal(idx[: want.size], want)
    np.testing.assert_array_equal(val[: want.size], x[want])
    short = np.empty(2, np.int64), np.empty(2, np.float32)
    assert native_isa.magnitude_at_least(x, 1.5, *short) == want.size
    np.testing.assert_array_equal(short[0][: min(2, want.size)], want[:2])


@pytest.mark.parametrize("count", [0, 1, 7, 8, 17, 1000, 100_003, (16 << 20) // 4 + 21])
def test_c_densify_matches_numpy_and_refuses_bad_positions(native_isa: Any, count: int) -> None:
    """A dense vector from sorted pairs on every instruction set (the largest output takes
    the non-temporal stores); positions that do not rise strictly inside it are refused."""
    rng = np.random.default_rng(count)
    pos = np.sort(rng.choice(count, count // 10, replace=False)).astype(np.int64)
    val = rng.standard_normal(pos.size).astype(np.float32)
    out = kernels.host_empty(count)
    out[:] = np.nan
    native_isa.densify(pos, val, out)
    want = np.zeros(count, np.float32)
    want[pos] = val
    np.testing.assert_array_equal(out, want)
    if pos.size < 2:
        return
    for bad in (pos[::-1], np.r_[pos[:-1], count], np.r_[-1, pos[1:]], np.r_[pos[:1], pos[:-1]]):
        with pytest.raises(ValueError, match=rf"rise strictly and lie in \[0, {count}\)"):
            native_isa.densify(np.ascontiguousarray(bad, np.int64), val, out)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 1000, (16 << 20) // 4 + 21])
def test_c_choco_step_is_torch_bit_for_bit(native_isa: Any, count: int) -> None:
    """CHOCO's step ``x + γ(s − x̂)`` in one C pass rounds as torch's three passes do, on
    every instruction set, NaN and infinities included; the largest output streams."""
    rng = np.random.default_rng(count)
    x, s, x_hat = (torch.from_numpy(rng.standard_normal(count).astype(np.float32)) for _ in "abc")
    s[::7], x_hat[3::11], x[5::13] = float("inf"), float("nan"), -float("inf")
    gamma = 0.123456789  # not a float32: both round it to one
    want = torch.sub(s, x_hat).mul_(gamma).add_(x)
    got = choco_step(x, s, x_hat, gamma)
    assert got.data_ptr() % 64 == 0 or count * 4 < (16 << 20)
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32))
    with pytest.raises(ValueError, match="float32 vectors of one length"):
        native_isa.choco_step(
            x.numpy(), s.numpy(), x_hat.numpy(), 0.5, np.empty(count + 1, np.float32)
        )


@pytest.mark.parametrize("bits", range(1, 9))
def test_c_codes_over_reads_packed_codes_as_unpack_bits_does(native_isa: Any, bits: int) -> None:
    """The host check of a GPU's QSGD decode: whether a packed code is over a limit, for
    every limit, a code just over it in each position of a group and in the tail; the
    codes past ``count`` in the last byte are not looked at; bad arguments refused."""
    rng = np.random.default_rng(bits)
    top = (1 << bits) - 1
    for count in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 1003):
        for limit in sorted({0, top // 2, top - 1, top}):
            codes = rng.integers(0, limit + 1, count).astype(np.uint8)
            packed = kernels.pack_bits(torch.from_numpy(codes), bits)
            assert not native_isa.codes_over(packed, bits, count, limit)
            if limit == top or count == 0:
                continue
            for at in {*range(min(count, 9)), count // 2}:
                over = codes.copy()
                over[count - 1 - at] = rng.integers(limit + 1, top + 1)
                packed = kernels.pack_bits(torch.from_numpy(over), bits)
                assert native_isa.codes_over(packed, bits, count, limit), (count, limit, at)
    tail = kernels.pack_bits(torch.tensor([0, 0, 0, top], dtype=torch.uint8), bits)
    assert not native_isa.codes_over(tail, bits, 3, 0)  # the fourth code is past count
    with pytest.raises(ValueError, match="10 codes of 6 bits"):
        native_isa.codes_over(np.zeros(7, np.uint8), 6, 10, 32)
    with pytest.raises(ValueError, match="limit -1 must be >= 0"):
        native_isa.codes_over(np.zeros(8, np.uint8), 6, 10, -1)


@pytest.mark.parametrize("density", [0.0, 0.0005, 0.01, 0.3, 1.0])
def test_delta_golomb_streams_are_the_same_from_c_numpy_and_torch(density: float) -> None:
    """The C kernels and the torch code a GPU runs (here on the CPU) write the bytes numpy
    writes, and C reads them back as numpy does, every Rice parameter from 0 (dense
    supports) up; damaged streams (a flipped bit, a byte cut off or added) are refused by
    both readers, or decode to the same indices."""
    coder, rng = DeltaGolomb(), np.random.default_rng(int(density * 1e4))
    for numel in (1, 9, 1000, 250_003):
        count = round(density * numel)
        indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        arrays, meta = coder.encode(indices, numel)
        with kernels.numpy_kernels():
            expected, expected_meta = coder.encode(indices, numel)
        unary, rest, b = golomb_streams(torch.from_numpy(indices), numel)
        assert meta == expected_meta == {"b": b}
        for got, want in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(unary.numpy(), expected[0])
        np.testing.assert_array_equal(rest.numpy(), expected[1])
        np.testing.assert_array_equal(coder.decode(arrays, meta, count, numel), indices)
        for _ in range(20):
            unary, rest = (a.copy() for a in arrays)
            damage = rng.integers(4)
            if damage == 0 and unary.size:
                unary[rng.integers(unary.size)] ^= np.uint8(1 << rng.integers(8))
            elif damage == 1 and rest.size:
                rest[rng.integers(rest.size)] ^= np.uint8(1 << rng.integers(8))
            elif damage == 2:
                unary = unary[:-1]
            else:
                unary = np.concatenate((unary, rng.integers(256, size=1).astype(np.uint8)))
            seen = []
            for backend in (contextlib.nullcontext, kernels.numpy_kernels):
                with backend():
                    try:
                        seen.append(coder.decode((unary, rest), meta, count, numel).tolist())
                    except CodecError:
                        seen.append("refused")
            assert seen[0] == seen[1]


def test_the_golomb_kernels_check_their_sizes() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    assert native is not None
    gaps, one = np.array([3, 0, 5], np.int64), np.zeros(1, np.uint8)
    with pytest.raises(ValueError, match="gaps >= 0"):
        native.golomb_pack(np.array([-1], np.int64), 0, one, np.zeros(0, np.uint8))
    with pytest.raises(ValueError, match="2 bytes of unary code"):
        native.golomb_pack(gaps, 0, one, np.zeros(0, np.uint8))
    with pytest.raises(ValueError, match="0 <= b <= 56"):
        native.golomb_unpack(one, one, 57, 1, 10, np.empty(1, np.int64))
    with pytest.raises(ValueError, match="int64 out of count"):
        native.golomb_unpack(one, np.zeros(0, np.uint8), 0, 1, 10, np.empty(2, np.int64))
    assert native.golomb_sums(gaps, 1) == (3, 1, 0)  # [1, 0, 2], [0, 0, 1], [0, 0, 0]


def test_the_sparse_kernels_check_their_sizes() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    assert native is not None
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="as many float32 val"):
        native.magnitude_at_least(x, 1.0, np.empty(2, np.int64), np.empty(3, np.float32))
    with pytest.raises(ValueError, match="as many float32 val"):
        native.densify(np.arange(2, dtype=np.int64), np.ones(3, np.float32), x)
    with pytest.raises(ValueError, match="whole float32 out"):
        native.densify(np.arange(2, dtype=np.int64), np.ones(2, np.float32), np.zeros(5, np.uint8))


def test_threshold_selects_alike_on_every_kernel() -> None:
    """C, numpy and torch keep the same entries, compared in float32: a fixed tau that float32
    cannot hold (0.1) and entries exactly at it, ``threshold:auto``, and top-k's refinement
    among ties."""
    x = torch.randn(600_000, generator=torch.Generator().manual_seed(4))
    x[:50] = float(np.float32(0.1))
    x[50:100] = -float(np.float32(0.1))
    x[100:20_000] = 2.5  # ties at top-k's k-th largest magnitude
    kept = {}
    specs = ("threshold:0.1", "threshold:0.09999", "threshold:auto", "topk:0.02")
    for name, backend in CPU_KERNELS.items():
        with backend():
            kept[name] = [build_codec(spec).encode(x)[1] for spec in specs]
    for spec, c, n, t in zip(specs, *kept.values(), strict=True):
        assert torch.equal(c, n) and torch.equal(c, t), spec
    assert int((kept["c"][1][:100] != 0).sum()) == 100 and int((kept["c"][0][:100] != 0).sum()) == 0


# --- unbiasedness ---------------------------------------------------------------------------------

UNBIASED = {"qsgd:4:8": 3000, "qsgd:16": 3000, "ternary": 3000, "randomk:0.25": 4000,
            "ternary:8": 3000, "randomk:0.5+qsgd:2:0": 4000}  # fmt: skip


@pytest.mark.parametrize("spec", list(UNBIASED))
def test_unbiased_codecs_average_to_the_input(spec: str) -> None:
    """Every coordinate of the mean of N decodes is within 4 standard errors of x.

    The standard error is the sample standard deviation over sqrt(N). With 40
    coordinates, a correct codec fails this with probability ~2.5e-3; the
    seeds are fixed, so the test is deterministic.
    """
    x = torch.linspace(0.5, 3, 40) * torch.tensor([1.0, -1.0]).repeat(20)  # no rare events
    x[7] = 0.0
    draws = UNBIASED[spec]
    codec = build_codec(spec, seed=7)
    samples = torch.stack([codec.encode(x)[1] for _ in range(draws)]).double()
    mean, std = samples.mean(0), samples.std(0)
    error = (mean - x.double()).abs()
    assert (error <= 4 * std / math.sqrt(draws) + 1e-9).all(), error / (std / math.sqrt(draws))
    assert float(std.max()) > 0  # the codec is random at all


# --- error feedback -------------------------------------------------------------------------------

EXACT_EF = ["topk:0.2+ef", "threshold:0.5+ef", "fp16+ef", "bf16+ef", "randomk:0.3:noscale+ef",
            "none+ef", "topk:0.1+raw+ef"]  # fmt: skip
ROUNDED_EF = ["sign+ef", "uniform:3+ef", "qsgd:8+ef", "ternary+ef", "powersgd:2+ef",
              "randomk:0.3+ef", "threshold:auto+sign+ef"]  # fmt: skip


@pytest.mark.parametrize("spec", EXACT_EF + ROUNDED_EF)
@FAST
@given(data=st.data())
def test_error_feedback_keeps_what_was_not_sent(spec: str, data: st.DataObject) -> None:
    """new residual == (x + old residual) − sent, rounded once in float32; exact where it can be."""
    n = data.draw(st.integers(0, 200))
    ef = build_codec(spec, seed=2)
    assert isinstance(ef, ErrorFeedback)
    old = torch.zeros(n)
    for _ in range(3):
        x = data.draw(
            hnp.arrays(np.float32, n, elements=st.floats(-100, 100, width=32)).map(torch.from_numpy)
        )
        payload, sent = ef.encode(x)
        assert ef.residual is not None
        new = ef.residual.clone()
        p = x + old
        assert_bitwise(new, p - sent)
        assert_bitwise(ef.decode(wire_copy(payload), n, "cpu"), sent)
        if spec in EXACT_EF:
            assert torch.equal(sent + new, p)  # == as IEEE numbers (-0.0 == 0.0)
        else:  # one rounding of p − sent: at most half an ulp of |p − sent|
            gap = (sent.double() + new.double() - p.double()).abs().numpy()
            assert (gap <= 0.5 * np.spacing(np.abs(new.numpy())).astype(np.float64)).all()
        old = new


def test_error_feedback_state_resets_and_follows_shape() -> None:
    ef = ErrorFeedback(build_codec("topk:0.5"))
    ef.encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert ef.residual is not None and ef.residual.tolist() == [1.0, 2.0, 0.0, 0.0]
    _, sent = ef.encode(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    assert sent.tolist() == [1.0, 2.0, 0.0, 0.0]  # the residual went out next time
    ef.encode(torch.ones(3))  # a new length starts from zero
    assert ef.residual is not None and ef.residual.numel() == 3
    ef.reset()
    assert ef.residual is None and ef.spec == "topk:0.5+delta-golomb+ef"


# --- bytes on the wire ----------------------------------------------------------------------------


def meta_bytes(meta: dict) -> int:
    return len(msgpack.packb(meta))


def expected_nbytes(spec: str, n: int, meta: dict) -> int | None:
    """The closed-form size of fixed-rate codecs (None for data-dependent ones)."""
    rows, cols = matrix_shape(n)
    base, *args = spec.split(":")
    m = meta_bytes(meta)
    blocks = lambda size: -(-n // size) if size else 1  # noqa: E731
    if base in ("topk", "threshold"):
        return None
    if spec.startswith("randomk:") and "+" not in spec:
        k = min(n, max(1, math.ceil(float(args[0]) * n))) if n else 0
        return 4 * k + m
    if "+" in spec:
        return None
    if base in ("none", "dense"):
        return 4 * n + m
    if base in ("fp16", "bf16"):
        return 2 * n + m
    if base == "sign":
        return math.ceil(n / 8) + 4 * blocks(int(args[0]) if args else 0) + m
    if base == "ternary":
        return math.ceil(n / 5) + 4 * blocks(int(args[0]) if args else 0) + m
    if base == "uniform":
        bits = int(args[0])
        return math.ceil(n * bits / 8) + 8 * blocks(int(args[1]) if len(args) > 1 else 0) + m
    if base == "qsgd" and args[-1] == "trits":
        return None
    if base == "qsgd":
        bits = (2 * int(args[0])).bit_length()
        bucket = int(args[1]) if len(args) > 1 else 512
        return math.ceil(n * bits / 8) + 4 * blocks(bucket) + m
    if base == "powersgd":
        rank = min(int(args[0]), rows, cols)
        return 4 * rank * (rows + cols) + m
    raise AssertionError(spec)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(x=vectors(300))
def test_nbytes_is_the_bytes_on_the_wire(spec: str, x: torch.Tensor) -> None:
    from gossipdl.transport import wire

    payload, _ = build_codec(spec.removesuffix("+ef")).encode(x)
    on_wire = sum(len(a.tobytes()) for a in payload.arrays) + meta_bytes(payload.meta)
    assert payload.nbytes == on_wire
    frames = wire.encode("params", 0, 0, 0, payload.arrays, payload.meta, codec=spec)
    empty = wire.encode("params", 0, 0, 0, payload.arrays, {}, codec=spec)
    assert sum(len(f) for f in frames[1:]) == sum(a.nbytes for a in payload.arrays)
    assert len(frames[0]) - len(empty[0]) == meta_bytes(payload.meta) - meta_bytes({})
    formula = expected_nbytes(spec.removesuffix("+ef"), x.numel(), payload.meta)
    if formula is not None:
        assert payload.nbytes == formula


def test_sparse_payload_sizes() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    raw, _ = build_codec("topk:0.01+raw").encode(x)
    assert raw.nbytes == 1000 * 4 + 1000 * 4 + meta_bytes(raw.meta)
    golomb, _ = build_codec("topk:0.01").encode(x)
    assert golomb.nbytes < raw.nbytes * 0.65  # ~1 byte per index instead of 4
    sign, _ = build_codec("topk:0.01+sign").encode(x)
    assert sign.nbytes < golomb.nbytes * 0.35


# --- bad payloads ---------------------------------------------------------------------------------


def decode_or_codec_error(codec: Codec, payload: Payload, n: int) -> None:
    """Decoding a damaged payload gives a CodecError or a well-formed tensor; nothing else."""
    try:
        out = codec.decode(payload, n, "cpu")
    except CodecError:
        return
    assert out.dtype == torch.float32 and out.shape == (n,)


def damaged(
    payload: Payload,
    arrays: Sequence[np.ndarray] | None = None,
    meta: dict[str, Any] | None = None,
) -> Payload:
    """A copy of ``payload`` with its arrays or meta replaced."""
    return Payload(
        tuple(payload.arrays if arrays is None else arrays),
        dict(payload.meta if meta is None else meta),
    )


@pytest.mark.parametrize("spec", SPECS)
def test_structural_damage_raises_codec_error(spec: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    codec = build_codec(spec)
    payload, _ = codec.encode(x)
    bad: list[Payload] = [
        damaged(payload, arrays=payload.arrays[:-1]),  # an array dropped
        damaged(payload, arrays=(*payload.arrays, np.zeros(3, np.uint8))),  # one too many
        damaged(payload, meta={**payload.meta, "extra": 1}),  # unknown meta
    ]
    for i, array in enumerate(payload.arrays):
        arrays = list(payload.arrays)
        if array.size:
            arrays[i] = array[:-1]  # cut short
            bad.append(damaged(payload, arrays=arrays))
        arrays = list(payload.arrays)
        arrays[i] = array.view(np.uint8) if array.dtype != np.uint8 else array.view(np.int8)
        bad.append(damaged(payload, arrays=arrays))  # wrong dtype
        arrays = list(payload.arrays)
        arrays[i] = array.reshape(1, -1)
        bad.append(damaged(payload, arrays=arrays))  # not 1-D
    for key in payload.meta:
        meta = dict(payload.meta)
        del meta[key]
        bad.append(damaged(payload, meta=meta))  # a meta entry missing
        bad.append(damaged(payload, meta={**payload.meta, key: "x"}))  # wrong type
    for candidate in bad:
        with pytest.raises(CodecError):
            codec.decode(candidate, 1000, "cpu")
    with pytest.raises(CodecError):
        codec.decode(payload, -1, "cpu")
    if "k" in payload.meta:
        for k in (-1, 1001, int(payload.meta["k"]) + 1):
            with pytest.raises(CodecError):
                codec.decode(damaged(payload, meta={**payload.meta, "k": k}), 1000, "cpu")


def test_out_of_range_and_unsorted_indices_raise() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    codec = build_codec("topk:0.01+raw")
    payload, _ = codec.encode(x)
    indices, values = payload.arrays
    for broken in (
        np.concatenate((indices[:-1], [1000])),  # out of range
        np.concatenate((indices[:-1], [-1])),  # negative
        indices[::-1].copy(),  # unsorted
        np.concatenate((indices[:-1], indices[-2:-1])),  # duplicated
    ):
        with pytest.raises(CodecError, match="raw indices"):
            codec.decode(damaged(payload, arrays=(broken.astype(np.int32), values)), 1000)
    golomb = build_codec("topk:0.01")
    payload, _ = golomb.encode(x)
    unary, rest, values = payload.arrays
    for bad in (
        damaged(payload, meta={**payload.meta, "i.b": 70}),  # absurd Rice parameter
        damaged(payload, arrays=(np.concatenate((unary, [255])), rest, values)),  # extra gaps
        damaged(payload, arrays=(np.zeros_like(unary), rest, values)),  # no gaps at all
        damaged(payload, arrays=(np.full(600, 0, np.uint8), rest, values)),  # huge gap
    ):
        with pytest.raises(CodecError, match="delta-golomb"):
            golomb.decode(bad, 1000)
    with pytest.raises(CodecError, match="delta-golomb"):  # indices run past numel
        golomb.decode(payload, 500)


@pytest.mark.parametrize(
    ("spec", "index", "value", "match"),
    [
        ("ternary", 0, 255, "242"),
        ("qsgd:4:0", 0, 255, "2·LEVELS"),
        ("sign", 1, -1.0, "scales"),
        ("sign", 1, float("nan"), "scales"),
        ("uniform:4", 2, float("inf"), "scales"),
        ("uniform:4", 1, float("nan"), "lo"),
    ],
)
def test_impossible_values_raise(spec: str, index: int, value: float, match: str) -> None:
    codec = build_codec(spec)
    payload, _ = codec.encode(torch.randn(100, generator=torch.Generator().manual_seed(0)))
    arrays = [a.copy() for a in payload.arrays]
    arrays[index][0] = value
    with pytest.raises(CodecError, match=match):
        codec.decode(damaged(payload, arrays=arrays), 100)


def test_overlong_varint_raises() -> None:
    codec = build_codec("topk:0.5+delta-varint")
    payload, _ = codec.encode(torch.randn(300))  # numel 300: at most 2 bytes per gap
    stream = np.array([0x80, 0x80, 0x00] + [0x00] * 149, np.uint8)  # gap 0 padded to 3 bytes
    with pytest.raises(CodecError, match="longer than"):
        codec.decode(damaged(payload, arrays=(stream, payload.arrays[1])), 300)
    with pytest.raises(CodecError, match="too long"):
        codec.decode(damaged(payload, arrays=(np.zeros(301, np.uint8), payload.arrays[1])), 300)


def test_corrupt_compressed_streams_raise() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for spec in ("topk:0.05+delta-zlib", "topk:0.05+delta-varint"):
        codec = build_codec(spec)
        payload, _ = codec.encode(x)
        stream, values = payload.arrays
        for bad_stream in (
            stream[: len(stream) // 2],
            stream[::-1].copy(),
            np.full(9, 0xFF, np.uint8),
            np.concatenate([stream, np.zeros(4, np.uint8)]),  # zlib took bytes after its end
        ):
            with pytest.raises(CodecError):
                codec.decode(damaged(payload, arrays=(bad_stream, values)), 1000)


def test_payload_rejects_what_cannot_go_on_the_wire() -> None:
    with pytest.raises(CodecError, match="dtype"):
        Payload((np.zeros(2, bool),), {})
    with pytest.raises(CodecError, match="ndarray"):
        Payload(([1, 2],), {})  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="meta"):
        Payload((), {"k": [1]})  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="meta"):
        Payload((), {"k": True})
    assert Payload([np.zeros(2, np.float32)], {"k": 1}).arrays[0].shape == (2,)  # type: ignore[arg-type]


meta_values = st.one_of(st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=3))
mutation = st.one_of(
    st.tuples(st.just("cut"), st.integers(0, 9), st.integers(1, 8)),
    st.tuples(st.just("grow"), st.integers(0, 9), st.integers(1, 8)),
    st.tuples(st.just("byte"), st.integers(0, 9), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("dtype"), st.integers(0, 9), st.sampled_from(["uint8", "int32", "float16"])),
    st.tuples(st.just("drop"), st.integers(0, 9)),
    st.tuples(st.just("swap"), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("meta"), st.integers(0, 9), meta_values),
    st.tuples(st.just("unmeta"), st.integers(0, 9)),
)  # fmt: skip


def mutate(payload: Payload, op: tuple) -> Payload:
    arrays, meta = list(payload.arrays), dict(payload.meta)
    kind, where, *rest = op
    if kind in ("meta", "unmeta"):
        if not meta:
            return payload
        key = sorted(meta)[where % len(meta)]
        if kind == "unmeta":
            del meta[key]
        else:
            meta[key] = rest[0]
        return Payload(tuple(arrays), meta)
    if not arrays:
        return payload
    i = where % len(arrays)
    raw = bytearray(arrays[i].tobytes())
    dtype = arrays[i].dtype
    if kind == "cut":
        raw = raw[: max(0, len(raw) - rest[0] * dtype.itemsize)]
    elif kind == "grow":
        raw += bytes(range(rest[0] * dtype.itemsize))
    elif kind == "byte" and raw:
        raw[rest[0] % len(raw)] = rest[1]
    elif kind == "dtype":
        dtype = np.dtype(rest[0])
        raw = raw[: len(raw) // dtype.itemsize * dtype.itemsize]
    elif kind == "drop":
        del arrays[i]
        return Payload(tuple(arrays), meta)
    elif kind == "swap":
        j = rest[0] % len(arrays)
        arrays[i], arrays[j] = arrays[j], arrays[i]
        return Payload(tuple(arrays), meta)
    arrays[i] = np.frombuffer(bytes(raw), dtype=dtype)
    return Payload(tuple(arrays), meta)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(x=vectors(120), ops=st.lists(mutation, min_size=1, max_size=3))
def test_random_damage_gives_codec_error_or_a_tensor(
    spec: str, x: torch.Tensor, ops: list[tuple]
) -> None:
    codec = build_codec(spec)
    payload, _ = codec.encode(x)
    for op in ops:
        payload = mutate(payload, op)
    decode_or_codec_error(codec, payload, x.numel())


# --- specs and the registry -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_normalized_spec_rebuilds_the_same_codec(spec: str) -> None:
    codec = build_codec(spec)
    assert build_codec(codec.spec).spec == codec.spec
    assert build_codec(spec.upper() if ":" not in spec else spec).spec == codec.spec


def test_spec_normalization() -> None:
    assert build_codec("topk:1e-2").spec == "topk:0.01+delta-golomb"
    assert build_codec("topk:0.01+qsgd:16+delta-golomb").spec == "topk:0.01+qsgd:16+delta-golomb"
    assert build_codec("threshold:auto:0.01+sign").spec == "threshold:auto+sign+delta-golomb"
    assert build_codec("qsgd:4:512").spec == "qsgd:4"
    assert build_codec("randomk:0.01").spec == "randomk:0.01"
    assert build_codec(" Sign + EF ").spec == "sign+ef"
    assert build_codec("powersgd:2").lossy and not build_codec("none+ef").lossy


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("", "non-empty"),
        ("nope", "'nope'"),
        ("topk", "topk:RATIO"),
        ("topk:0", "RATIO"),
        ("topk:1.5", "RATIO"),
        ("topk:abc", "'abc'"),
        ("topk:0.1:2", "topk:RATIO"),
        ("fp16+topk:0.01", "out of order"),
        ("topk:0.1+fp16+sign", "two value codecs"),
        ("topk:0.1+raw+delta-golomb", "two index coders"),
        ("qsgd:0", "1..127"),
        ("qsgd:200", "1..127"),
        ("qsgd:16:huffman", "'trits'"),
        ("qsgd:16:512:0:trits", "got 4 argument"),
        ("uniform:9", "1..8"),
        ("uniform", "uniform:BITS"),
        ("sign:x", "'x'"),
        ("sign:-3", "BLOCK"),
        ("sign:9223372036854775800", "1,099,511,627,776"),  # counted blocks overflowed in C
        ("qsgd:4:9223372036854775807", "1,099,511,627,776"),
        ("delta-golomb", "needs a sparsifier"),
        ("randomk:0.1+raw", "sends none"),
        ("randomk:0.1:maybe", "noscale"),
        ("ef", "needs a codec"),
        ("sign+ef+ef", "last"),
        ("ef+sign", "last"),
        ("powersgd:2+fp16", "whole-vector"),
        ("none+topk:0.1", "whole-vector"),
        ("powersgd:0", "RANK"),
        ("threshold:auto:2", "RATIO"),
        ("threshold:-1", "TAU"),
        ("threshold:0.1:0.2", "auto"),
        ("topk:0.1++fp16", "empty stage"),
        ("no_such_module_xyz:Codec", "cannot import"),
    ],
)
def test_bad_specs_name_the_bad_part(spec: str, part: str) -> None:
    with pytest.raises(CodecError) as info:
        build_codec(spec)
    assert part in str(info.value)
    if part not in ("non-empty", "empty stage"):
        assert "topk:RATIO" in str(info.value) or spec in str(info.value)


def test_unknown_stage_lists_the_allowed_forms() -> None:
    with pytest.raises(CodecError) as info:
        build_codec("topk:0.1+zstd")
    for form in ("topk:RATIO", "qsgd:LEVELS[:BUCKET]", "delta-golomb", "powersgd:RANK", "+ef"):
        assert form in str(info.value)
    assert "topk:RATIO" in available_codecs() and "ef" in available_codecs()


def test_delta_zstd_needs_zstandard() -> None:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(CodecError, match="zstandard"):
            build_codec("topk:0.01+delta-zstd")
    else:
        codec = build_codec("topk:0.01+delta-zstd")
        x = torch.randn(5000)
        payload, sent = codec.encode(x)
        assert torch.equal(codec.decode(wire_copy(payload), 5000), sent)


class Halves(Codec):
    """A user codec: fp16 under another name."""

    def __init__(self, seed: int = 0) -> None:
        self.inner = Float16()
        self.seed = seed

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        return self.inner.encode(x)

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        return self.inner.decode(payload, numel, device)


def test_user_codecs_register_and_import(monkeypatch: pytest.MonkeyPatch) -> None:
    register_codec("halves", lambda arg, seed: Halves(seed), usage="halves", replace=True)
    codec = build_codec("halves+ef", seed=4)
    assert isinstance(codec, ErrorFeedback) and codec.spec == "halves+ef"
    assert isinstance(codec.codec, Halves) and codec.codec.seed == 4
    assert "halves" in available_codecs()
    with pytest.raises(CodecError, match="already registered"):
        register_codec("halves", lambda arg, seed: Halves(seed))
    with pytest.raises(CodecError, match="built-in"):
        register_codec("topk", lambda arg, seed: Halves(seed), replace=True)
    with pytest.raises(CodecError, match="lowercase"):
        register_codec("bad:name", lambda arg, seed: Halves(seed))
    plugin = types.ModuleType("gossipdl_codec_plugin")
    plugin.Halves = Halves  # type: ignore[attr-defined]
    plugin.NotACodec = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gossipdl_codec_plugin", plugin)
    codec = build_codec("gossipdl_codec_plugin:Halves", seed=3)
    assert isinstance(codec, Halves) and codec.spec == "gossipdl_codec_plugin:Halves"
    x = torch.randn(10)
    payload, sent = codec.encode(x)
    assert torch.equal(build_codec(codec.spec).decode(payload, 10), sent)
    with pytest.raises(CodecError, match="not a Codec"):
        build_codec("gossipdl_codec_plugin:NotACodec")
    with pytest.raises(CodecError, match="has no"):
        build_codec("gossipdl_codec_plugin:Missing")


def test_encode_rejects_what_is_not_a_flat_float32_tensor() -> None:
    codec = build_codec("sign")
    with pytest.raises(TypeError):
        codec.encode(np.zeros(3, np.float32))  # type: ignore[arg-type]
    for bad in (torch.zeros(2, 2), torch.zeros(3, dtype=torch.float64)):
        with pytest.raises(ValueError, match="1-D float32"):
            codec.encode(bad)


def test_powersgd_warm_start_lives_on_the_sender() -> None:
    torch.manual_seed(0)
    low_rank = (torch.randn(300, 2) @ torch.randn(2, 300)).reshape(-1)
    sender = build_codec("powersgd:2", seed=5)
    errors = []
    for _ in range(4):
        payload, sent = sender.encode(low_rank)
        errors.append(float((sent - low_rank).norm() / low_rank.norm()))
        assert torch.equal(
            build_codec("powersgd:2", seed=6).decode(payload, low_rank.numel()), sent
        )
    assert errors[-1] < 1e-4 < errors[0] or errors[0] < 1e-4  # the iteration converges
    _, zeros = sender.encode(torch.zeros(90_000))
    assert not zeros.any()
    _, again = sender.encode(low_rank)
    assert float((again - low_rank).norm() / low_rank.norm()) < 0.5  # not stuck at zero


def whole_matrix_product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``((p₀q₀ + p₁q₁) + p₂q₂) + …`` over the whole matrix, each operation rounded, flat."""
    expected = p[:, 0:1] * q[:, 0]
    for j in range(1, p.shape[1]):
        expected = expected + p[:, j : j + 1] * q[:, j]
    return expected.reshape(-1)


def low_rank_factors(rows: int, cols: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded P̂ (rows × rank, large) and Q (cols × rank) with signed zeros among them."""
    generator = torch.Generator().manual_seed(rows * 1009 + cols * 31 + rank)
    p = torch.randn(rows, rank, generator=generator) * 1e3
    q = torch.randn(cols, rank, generator=generator)
    p[min(4, rows - 1)], q[min(6, cols - 1)] = 0.0, -0.0
    return p, q


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("rank", [1, 2, 3, 4])
def test_reconstruct_rounds_every_product_and_sum_on_its_own(
    kernel: str, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reconstruct`` in C, with numpy a block of rows at a time (3 here, the last block
    short), or in one pass with the torch kernels (a GPU's) gives the bits of the
    whole-matrix formula ``((p₀q₀ + p₁q₁) + p₂q₂)``, each operation rounded: no fused
    multiply-add."""
    monkeypatch.setattr(powersgd_module, "RECONSTRUCT_BLOCK_BYTES", 3 * 4 * 37)
    p, q = low_rank_factors(20, 37, rank)
    out = torch.full((20 * 37,), math.nan)
    with CPU_KERNELS[kernel]():
        assert reconstruct(p, q, out) is out
    assert_bitwise(out, whole_matrix_product(p, q))


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("rows", "cols", "count"),
    [
        (1, 1, 1),
        (3, 5, 15),
        (3, 5, 11),  # the last row cropped
        (20, 37, 20 * 37 - 5),
        (8, 16, 128),
        (5, 33, 160),
        (2049, 2049, 2049 * 2049 - 1000),  # 16 MB: streamed, rows on every alignment
        (600_001, 7, 4_200_000),  # 16 MB of rows shorter than a vector
    ],
)
def test_c_low_rank_product_matches_numpy_and_torch(
    native_isa: Any, rank: int, rows: int, cols: int, count: int
) -> None:
    """The C product on every instruction set has the bits of numpy's blocks and torch's
    pass, the last row cropped to ``count`` values and nothing written past them."""
    p, q = low_rank_factors(rows, cols, rank)
    expected = {}
    for name in ("numpy", "torch"):
        with CPU_KERNELS[name]():
            expected[name] = reconstruct(p, q, torch.full((rows * cols,), math.nan))[:count]
    buffer = kernels.host_empty(count + 16)
    buffer[:] = np.nan
    qt = q.T.contiguous().numpy()
    native_isa.low_rank_product(p.numpy(), qt, buffer[:count], rows, cols)
    assert_bitwise(torch.from_numpy(buffer[:count]), expected["numpy"])
    assert_bitwise(expected["torch"], expected["numpy"])
    assert np.isnan(buffer[count:]).all()


def test_c_low_rank_product_checks_its_sizes() -> None:
    native = kernels.native_kernels(torch.device("cpu"))
    assert native is not None
    p, qt = np.ones(6, np.float32), np.ones(10, np.float32)  # rank 2 of 3 × 5
    bad_factors = [
        (np.ones(7, np.float32), qt, 3, 5),  # p is not rows × rank
        (p, np.ones(9, np.float32), 3, 5),  # qt is not rank × cols
        (p, qt, 2, 5),  # p's rank 3, qt's 2
        (p, qt, -3, 5),
        (p, qt, 3, -5),
        (p, qt, 3, 2**62),  # rank × cols would overflow
        (np.ones(6, np.uint8), qt, 3, 5),  # not whole float32
    ]
    for p_, qt_, rows, cols in bad_factors:
        with pytest.raises(ValueError, match="must be float32 rows x rank and rank x cols"):
            native.low_rank_product(p_, qt_, np.zeros(15, np.float32), rows, cols)
    empty = np.zeros(0, np.float32)
    for out, rows, cols in [
        (np.zeros(16, np.float32), 3, 5),  # longer than rows × cols
        (np.zeros(61, np.uint8), 3, 5),  # not whole float32
        (np.zeros(1, np.float32), 0, 0),
    ]:
        with pytest.raises(ValueError, match="at most rows x cols"):
            native.low_rank_product(p if rows else empty, qt if rows else empty, out, rows, cols)
    native.low_rank_product(empty, empty, empty, 0, 0)
    zeros = np.full(15, np.nan, np.float32)
    native.low_rank_product(empty, empty, zeros, 3, 5)  # rank 0
    assert not zeros.any()


def test_powersgd_pads_a_vector_without_copying_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vector short of its near-square matrix is that matrix's full rows (a view) and a
    zero-padded last row: the factors of the padded matrix, and the sender's estimate is
    what every receiver decodes, bit for bit, with the C, numpy or torch kernels."""
    monkeypatch.setattr(powersgd_module, "RECONSTRUCT_BLOCK_BYTES", 5 * 4 * 32)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    rows, cols = matrix_shape(x.numel())  # 32 × 32: 24 zeros of padding
    head, tail = row_split(x, rows, cols)
    padded = torch.cat([x, x.new_zeros(rows * cols - x.numel())]).view(rows, cols)
    assert tail is not None and head.data_ptr() == x.data_ptr()
    assert torch.equal(torch.cat([head, tail]), padded)
    assert row_split(x[:992], 31, 32)[1] is None
    start = torch.randn(cols, 2, generator=torch.Generator().manual_seed(4))
    p, q = power_step(head, tail, start)
    p_padded = torch.linalg.qr(padded @ start, mode="reduced").Q
    torch.testing.assert_close(p @ q.T, p_padded @ p_padded.T @ padded, atol=1e-4, rtol=1e-4)
    payload, sent = build_codec("powersgd:2").encode(x)
    for backend in CPU_KERNELS.values():
        with backend():
            assert_bitwise(build_codec("powersgd:2").decode(wire_copy(payload), x.numel()), sent)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_recycled_memory_is_private_to_a_forked_process() -> None:
    """A fork (a data-loader worker, say) that reuses a pooled block must not write into its
    parent's memory."""
    recycler = kernels._Recycler(min_bytes=1 << 20)
    count = 1 << 20  # bytes
    block = recycler.empty(count)
    block[:] = 1
    del block  # back in the pool, in parent and child alike
    pid = os.fork()
    if pid == 0:  # the child takes the same block and overwrites it
        recycler.empty(count)[:] = 7
        os._exit(0)
    os.waitpid(pid, 0)
    assert recycler.empty(count)[0] == 1


def test_powersgd_compresses_each_layer_of_the_bound_model_and_sends_biases_as_they_are() -> None:
    """An MLP's layout: two weight matrices at rank 2 (P̂ rows×2 and Q cols×2 each), the
    biases sent whole; a model whose every layer has rank 2 is recovered, biases exactly."""
    shapes = [(64, 40), (64,), (10, 64), (10,)]
    numel = sum(math.prod(s) for s in shapes)
    torch.manual_seed(0)
    w1 = torch.randn(64, 2) @ torch.randn(2, 40)
    w2 = torch.randn(10, 2) @ torch.randn(2, 64)
    b1, b2 = torch.randn(64), torch.randn(10)
    x = torch.cat([w1.reshape(-1), b1, w2.reshape(-1), b2])
    sender, receiver = build_codec("powersgd:2", seed=1), build_codec("powersgd:2", seed=2)
    for codec in (sender, receiver):
        codec.bind_layout(shapes)
    for _ in range(3):
        payload, sent = sender.encode(x)
    p_and_biases, q = payload.arrays
    assert p_and_biases.size == 64 * 2 + 10 * 2 + 64 + 10 and q.size == 40 * 2 + 64 * 2
    assert payload.nbytes == 4 * (64 * 2 + 10 * 2 + 64 + 10 + 40 * 2 + 64 * 2) + 1
    assert torch.equal(receiver.decode(payload, numel), sent)
    assert torch.equal(sent[2560 : 2560 + 64], b1) and torch.equal(sent[-10:], b2)
    for start, w in ((0, w1), (2624, w2)):
        layer = sent[start : start + w.numel()].view_as(w)
        assert float((layer - w).norm() / w.norm()) < 1e-4  # each layer's rank 2, found
    whole = build_codec("powersgd:2", seed=1)  # unbound: the old near-square single matrix
    assert float((whole.encode(x)[1] - x).norm() / x.norm()) > 0.1


def test_powersgd_takes_an_empty_parameter_of_any_shape_as_nothing_to_send() -> None:
    """A ``Linear(5, 0)`` weight, (0, 5), divided by its first dimension: ZeroDivisionError."""
    layout = LowRankLayout.of([(0, 5), (5, 0), (0,), (4, 3)], rank=1)
    assert layout.layers == ((0, 4, 3, 1),) and layout.vectors == () and layout.numel == 12


@pytest.mark.parametrize("coder", ["raw", "delta-golomb", "delta-varint"])
@pytest.mark.parametrize("ratio", [0.001, 0.02, 0.3, 0.9])
def test_layouts_are_what_encode_puts_on_the_wire(coder: str, ratio: float) -> None:
    """A sparse codec's layouts of many rows at once (the batched simulator's byte count:
    Golomb's b and stream lengths computed for all rows together) equal each row's real
    payload: dtypes, lengths and meta."""
    codec = build_codec(f"topk:{ratio}+{coder}")
    assert isinstance(codec, sparse_module.SparseCodec)
    generator = torch.Generator().manual_seed(int(ratio * 1000))
    numel = 5000
    rows = torch.randn(40, numel, generator=generator)
    rows[::3] *= torch.rand(numel, generator=generator) ** 8  # some rows heavy-tailed, clustered
    rows[5, :50] += 100.0  # one row's largest entries all at the start
    payloads = [codec.encode(row)[0] for row in rows]
    chosen = np.stack([np.flatnonzero(codec.decode(p, numel).numpy()) for p in payloads])
    assert codec.layouts(chosen, numel) == [p.layout() for p in payloads]


@pytest.mark.parametrize(
    "spec", ["topk:0.02+qsgd:16+delta-golomb", "topk:0.02+sign+raw", "threshold:1.5+delta-varint"]
)
def test_layouts_count_quantized_values_and_rows_of_any_length(spec: str) -> None:
    """Layouts with quantized values, and of rows that keep different counts (a threshold's),
    equal each row's real payload."""
    codec = build_codec(spec)
    assert isinstance(codec, sparse_module.SparseCodec)
    numel = 3000
    rows = torch.randn(12, numel, generator=torch.Generator().manual_seed(5))
    rows[::2] *= 1.4  # a threshold keeps more of these
    payloads = [codec.encode(row)[0] for row in rows]
    chosen = [codec.sparsifier.select(row)[0].numpy() for row in rows]
    assert len({len(c) for c in chosen}) > 1 or spec.startswith("topk")
    assert codec.layouts(chosen, numel) == [p.layout() for p in payloads]


@pytest.mark.parametrize(
    "spec", ["none", "fp16", "bf16", "sign", "sign:64", "ternary:32", "qsgd:8", "uniform:4:100"]
)
def test_a_value_codecs_layout_is_what_encode_sends(spec: str) -> None:
    """``layout(count)`` (what decode checks and the batched simulator counts) is the
    payload encode makes, for empty, short and block-straddling vectors."""
    codec = build_codec(spec)
    assert isinstance(codec, ValueCodec)
    for count in (0, 1, 7, 513, 1000):
        x = torch.randn(count, generator=torch.Generator().manual_seed(count))
        assert codec.layout(count) == codec.encode(x)[0].layout(), count


@pytest.mark.parametrize("spec", ["sign", "sign:64", "qsgd:4:100"])
def test_estimate_rows_is_each_rows_encode(spec: str) -> None:
    """A value codec's ``estimate_rows`` reads for every row what decoding that row's
    message gives, QSGD drawing its rounding once for all rows as codecs from one seed do."""
    rows = torch.randn(6, 450, generator=torch.Generator().manual_seed(2))
    batch = build_codec(spec, 9)
    assert isinstance(batch, QSGD | Sign)
    estimate = batch.estimate_rows(rows)
    for row, got in zip(rows, estimate, strict=True):
        one = build_codec(spec, 9)  # a peer's codec: the same seed, the same draw
        payload, _ = one.encode(row)
        torch.testing.assert_close(got, one.decode(payload, 450), atol=1e-6, rtol=1e-6)


def test_hostile_payloads_that_decode_to_far_more_than_they_carry_are_refused() -> None:
    """A review's probes, each refused with a CodecError and no large allocation:
    a zlib bomb when k = 0 (decompression had no limit then: 400 MB from 407 KB), bf16 NaN or
    infinities (the wire checks floats only, and bf16 travels as uint16), finite factors or
    scales whose product overflows float32, and a BLOCK longer than the vector (the numpy
    ternary decode built the whole BLOCK-long repeat)."""
    import tracemalloc
    import zlib

    bomb = np.frombuffer(zlib.compress(bytes(64 << 20), 9), np.uint8)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="exactly 0 gaps"):
            build_codec("threshold:0.5+delta-zlib").decode(
                Payload((bomb, np.zeros(0, np.float32)), {"k": 0}), 1000
            )
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 1 << 20, peak
        tracemalloc.reset_peak()
        codec = build_codec("ternary:200000000")
        payload, _ = codec.encode(torch.randn(10))
        with kernels.numpy_kernels():
            decoded = codec.decode(payload, 10)
        assert decoded.shape == (10,) and tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    for pattern in (0x7FC0, 0x7F80, 0xFF80):  # NaN, +inf, -inf
        values = np.full(16, 1 << 14, np.uint16)
        values[3] = pattern
        with pytest.raises(CodecError, match="bf16: a value is not finite"):
            build_codec("bf16").decode(Payload((values,), {}), 16)
    uniform = build_codec("uniform:8")
    payload, _ = uniform.encode(torch.randn(8))
    packed = payload.arrays[0]
    huge = np.full(1, 3e38, np.float32)
    with pytest.raises(CodecError, match="overflows float32"):
        uniform.decode(Payload((packed, huge, huge), {}), 8)
    low_rank = build_codec("powersgd:1")
    payload, _ = low_rank.encode(torch.randn(16))
    big = tuple(np.full(a.shape, 1e30, np.float32) for a in payload.arrays)
    with pytest.raises(CodecError, match="overflows float32"):
        low_rank.decode(Payload(big, payload.meta), 16)


FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("spec", "arrays", "numel"),
    [
        ("qsgd:127", [np.array([254], np.uint8), np.array([FLT_MAX], np.float32)], 1),
        ("uniform:2", [np.array([3], np.uint8), np.array([1.0601866e38], np.float32),
                       np.array([7.8087896e37], np.float32)], 1),  # |lo| + 3·step == FLT_MAX
        ("powersgd:10", [np.ones(100, np.float32), np.full(100, 3.4028235e37, np.float32)], 100),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["native", "numpy", "torch"])
def test_finite_numbers_whose_float32_decode_rounds_to_inf_are_refused(
    spec: str, arrays: list[np.ndarray], numel: int, backend: str
) -> None:
    """A review's probes: each passed the checks (a QSGD norm had none; the others' were exact
    float64 sums) and decoded to inf, as norm/LEVELS, code·step or the rank terms' float32
    sum rounded up."""
    chosen = {"numpy": kernels.numpy_kernels, "torch": kernels.torch_kernels}.get(backend)
    refused = pytest.raises(CodecError, match="overflows float32")
    with contextlib.nullcontext() if chosen is None else chosen(), refused:
        build_codec(spec).decode(Payload(tuple(arrays), {}), numel)


def test_fp16_clamps_infinities_even_beside_a_nan() -> None:
    """The documented clamp to ±65504 missed an infinity when a NaN was there too (the
    minimum and maximum were NaN), and the estimate kept inf."""
    x = torch.tensor([math.nan, math.inf, 70000.0, -math.inf, 1.0])
    payload, estimate = build_codec("fp16").encode(x)
    sent = payload.arrays[0].astype(np.float32)
    assert math.isnan(sent[0]) and sent[1:].tolist() == [65504.0, 65504.0, -65504.0, 1.0]
    assert not bool(torch.isinf(estimate).any())
