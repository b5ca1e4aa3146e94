"""Wire format: round trips and every malformed-message case, decoder level."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from conftest import with_header
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipdl.transport.wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, WireError, decode, encode

LIMIT = 1 << 30


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "float16", "int32", "uint8", "int64"]),
            st.lists(st.integers(0, 7), max_size=3),
        ),
        max_size=4,
    ),
    st.integers(-1, 2**31),
    st.integers(0, 2**40),
)
@settings(max_examples=100, deadline=None)
def test_round_trip_keeps_arrays_and_fields(specs, sender, round_) -> None:
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal(shape) * 10).astype(dtype) for dtype, shape in specs]
    frames = encode("params", sender, 3, round_, arrays, meta={"k": [1, "x"]}, codec="dense")
    msg = decode(frames, LIMIT)
    assert (msg.kind, msg.sender, msg.seq, msg.round, msg.meta) == (
        "params",
        sender,
        3,
        round_,
        {"k": [1, "x"]},
    )
    assert msg.nbytes == sum(len(f) for f in frames)
    for sent, got in zip(arrays, msg.arrays, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


def test_large_array_is_split_into_bounded_frames() -> None:
    x = np.arange(MAX_FRAME_BYTES // 4 * 2 + 5, dtype=np.float32)
    frames = encode("params", 0, 0, 0, [x])
    assert len(frames) == 4 and all(len(f) <= MAX_FRAME_BYTES for f in frames[1:])
    np.testing.assert_array_equal(decode(frames, LIMIT).arrays[0], x)


def good() -> list:
    return encode("params", 1, 1, 0, [np.ones(10, np.float32)])


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\xc1garbage"], "malformed_header"),
        ([msgpack.packb([1, 2, 3])], "malformed_header"),
        ([], "malformed_header"),
        (with_header(good(), v=PROTOCOL_VERSION + 1), "bad_version"),
        (with_header(good(), kind="explode"), "bad_kind"),
        (with_header(good(), sender="me"), "malformed_header"),
        (with_header(good(), round=True), "malformed_header"),
        (with_header(good(), frames=[41]), "frame_mismatch"),
        (with_header(good(), frames=[40, 4]), "frame_mismatch"),
        (good()[:1], "frame_mismatch"),
        ([*good(), b"extra"], "frame_mismatch"),
        (with_header(good(), arrays=[["float32", [11]]]), "frame_mismatch"),
        (with_header(good(), arrays=[["float32", [5]]]), "frame_mismatch"),
        (with_header(good(), arrays=[["complex64", [5]]]), "bad_dtype"),
        (with_header(good(), arrays=[["float32", [-1]]]), "bad_shape"),
        (with_header(good(), arrays=[["float32", [2**62, 2**62]]]), "bad_shape"),
        (with_header(good(), arrays=[["float32"]]), "malformed_header"),
        (encode("params", 1, 1, 0, [np.array([1.0, np.nan], np.float32)]), "non_finite"),
        (encode("params", 1, 1, 0, [np.array([np.inf], np.float16)]), "non_finite"),
    ],
)
def test_bad_messages_raise_with_reason(frames: list, reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode(frames, LIMIT)
    assert info.value.reason == reason


def test_oversize_is_rejected_before_parsing() -> None:
    frames = encode("params", 7, 1, 0, [np.ones(1000, np.float32)])
    with pytest.raises(WireError) as info:
        decode(frames, 1000)
    assert info.value.reason == "oversize"


def test_error_names_the_sender_when_the_header_parses() -> None:
    with pytest.raises(WireError) as info:
        decode(with_header(good(), v=99, sender=42), LIMIT)
    assert info.value.sender == 42


@given(st.binary(max_size=200), st.lists(st.binary(max_size=50), max_size=3))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_the_decoder(head: bytes, rest: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        decode([head, *rest], LIMIT)
