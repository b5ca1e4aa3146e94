"""Wire format: round trips and every malformed-message case, decoder level."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from conftest import with_header
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipdl.transport.wire import (
    MAX_HEADER_BYTES,
    MAX_HEADER_CONTAINERS,
    PROTOCOL_VERSION,
    WireError,
    all_finite,
    decode,
    encode,
    meta_int,
)

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


def test_large_array_is_one_frame_decoded_without_copy() -> None:
    x = np.arange(10_000_005, dtype=np.float32)
    frames = encode("params", 0, 0, 0, [x])
    assert len(frames) == 2 and len(frames[1]) == x.nbytes
    got = decode(frames, LIMIT).arrays[0]
    assert np.shares_memory(got, x)
    np.testing.assert_array_equal(got, x)


def test_array_split_over_frames_is_joined() -> None:
    x = np.arange(1001, dtype=np.float32)
    raw = x.view(np.uint8).data
    header = msgpack.unpackb(encode("params", 0, 0, 0, [x])[0])
    header["frames"] = [1000, 3004]
    frames = [msgpack.packb(header), raw[:1000], raw[1000:]]
    np.testing.assert_array_equal(decode(frames, LIMIT).arrays[0], x)


def test_empty_array_sends_no_frame() -> None:
    frames = encode("params", 0, 0, 0, [np.zeros(0, np.float32), np.ones(2, np.float32)])
    assert len(frames) == 2
    arrays = decode(frames, LIMIT).arrays
    assert arrays[0].shape == (0,) and arrays[1].tolist() == [1.0, 1.0]


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


@pytest.mark.parametrize("nested", [False, True])
def test_a_header_of_millions_of_empty_maps_is_refused_while_it_is_parsed(nested: bool) -> None:
    """A 4 MiB header of empty maps was 4 million Python objects (290 MiB, 0.4 s) before the
    array limit was looked at; split over lists, per-list limits would not hold it either."""
    maps = MAX_HEADER_BYTES - 1000
    header = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "params", "meta": {}, "arrays": []})
    bomb = b"\x80" * maps  # empty maps
    if nested:  # 64 lists of them
        per = maps // 64
        bomb = (b"\xdd" + per.to_bytes(4, "big") + b"\x80" * per) * 64
        packed = header.replace(
            b"\xa6arrays\x90", b"\xa6arrays\xdc" + (64).to_bytes(2, "big") + bomb
        )
    else:
        packed = header.replace(
            b"\xa6arrays\x90", b"\xa6arrays\xdd" + maps.to_bytes(4, "big") + bomb
        )
    assert len(packed) <= MAX_HEADER_BYTES
    with pytest.raises(WireError, match=f"more than {MAX_HEADER_CONTAINERS} maps and lists"):
        decode([packed], LIMIT)


def test_error_names_the_sender_when_the_header_parses() -> None:
    with pytest.raises(WireError) as info:
        decode(with_header(good(), v=99, sender=42), LIMIT)
    assert info.value.sender == 42


@given(st.binary(max_size=200), st.lists(st.binary(max_size=50), max_size=3))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_the_decoder(head: bytes, rest: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        decode([head, *rest], LIMIT)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_finiteness_check_is_exact_even_where_squares_overflow(dtype: type) -> None:
    huge = np.full(1000, np.finfo(dtype).max / 2, dtype)  # x·x overflows, every x is finite
    assert all_finite(huge)
    for bad in (np.nan, np.inf, -np.inf):
        x = huge.copy()
        x[500] = bad
        assert not all_finite(x)
    assert all_finite(np.zeros(0, dtype))


def test_meta_int_takes_integers_only_and_names_the_field() -> None:
    assert meta_int({"k": 3}, "k", "count") == 3
    assert meta_int({}, "k", "count", default=-1, minimum=-1) == -1
    assert meta_int({"k": -5}, "k", "round", minimum=None) == -5
    for bad in ({"k": True}, {"k": 1.0}, {"k": "1"}, {"k": -1}, {}):
        with pytest.raises(WireError, match="count") as caught:
            meta_int(bad, "k", "count")
        assert caught.value.reason == "bad_meta"


@pytest.mark.parametrize(
    "changes",
    [
        {"round": 2**64 - 1},  # a shard answer's round: the worker's next pull is round + 1
        {"meta": {"_age": 2**64 - 1}},  # a walk's age: the receiver's next step adds one
        {"meta": {"members": [[0, "tcp://h:1", 2**64 - 1, None, ""]]}},  # a life's round
        {"meta": {"x": [[[-(2**63)]]]}},  # however deep, and below too
    ],
    ids=["round", "walk age", "table", "nested negative"],
)
def test_an_integer_beyond_int64_is_refused_so_counting_on_from_it_cannot_overflow(
    changes: dict[str, object],
) -> None:
    """msgpack carries up to 2**64 − 1. A member table's round of 2**64 − 1 that a peer
    counted on by one made every table it encoded after that fail (OverflowError), which
    stopped its receive thread; a walk's age and a shard's round did the same elsewhere."""
    good = encode("params", 1, 2, 3, [np.zeros(2, np.float32)], {"seed": 2**63 - 1})
    assert decode(good, LIMIT).meta["seed"] == 2**63 - 1  # random-k's 63-bit seeds pass
    with pytest.raises(WireError) as refused:
        decode(with_header(good, **changes), LIMIT)
    assert refused.value.reason == "malformed_header" and "int64" in str(refused.value)
    assert encode("params", 1, 2, 2**63 - 1 + 1, [])  # one on from the largest: still encodable
