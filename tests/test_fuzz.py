"""Fuzzing: random and mutated messages never crash the decoder or a live peer.

Every input either decodes or raises ``WireError`` with a reason; a live peer
counts every one it refuses in ``dropped_reasons`` and keeps training.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from conftest import last_record, small_config, start_peer, wait_for, write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipdl.transport.wire import KINDS, WireError, decode, encode

MUTATIONS_PER_EXAMPLE = 100
EXAMPLES = 300  # x 100 mutations = 30,000 messages
LIMIT = 1 << 20
LIVE_MESSAGES = 2_000
STRANGER_REASONS = {  # what a live peer answers the seeded stream of 2,000 with
    "malformed_header", "frame_mismatch", "bad_version", "bad_kind", "bad_meta", "bad_dtype",
    "non_finite", "unknown_sender", "unsolicited",
}  # fmt: skip
OPEN_KINDS = ("join", "info_request")  # answered for anyone: not malformed when well-formed

_VALUES: list[Any] = [
    None, True, -1, 0, 1, 2**31, 2**63 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300,
    "float32", "params", [], [1], ["float32", [3]], ["float64", [2**40]], {}, {"a": 1}, b"\x00",
]  # fmt: skip


def _base(rng: random.Random) -> list[bytes]:
    """A valid message of a random kind with 0-3 arrays, as plain byte frames."""
    arrays = [
        np.arange(rng.randint(0, 40), dtype=rng.choice(["float32", "int32", "uint8", "float16"]))
        for _ in range(rng.randint(0, 3))
    ]
    meta = rng.choice([{}, {"step": 0, "piece": 0}, {"address": "tcp://127.0.0.1:1"}])
    kind = rng.choice(sorted(KINDS))
    frames = encode(kind, rng.randint(-2, 99), rng.randint(0, 9), 0, arrays, meta, "none")
    return [bytes(f) for f in frames]


def _mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One random mutation: flip bytes, truncate or extend a frame, rewrite a header field,
    drop, duplicate or add frames, or replace everything by noise."""
    frames = list(frames)
    choice = rng.randrange(8)
    i = rng.randrange(len(frames))
    if choice == 0 and frames[i]:
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        frames[i] = bytes(data)
    elif choice == 1:
        frames[i] = frames[i][: rng.randint(0, max(0, len(frames[i]) - 1))]
    elif choice == 2:
        frames[i] = frames[i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif choice == 3:
        try:
            header = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            header = {}
        if isinstance(header, dict) and header:
            header[rng.choice(sorted(header))] = rng.choice(_VALUES)
        frames[0] = msgpack.packb(header, use_bin_type=True)
    elif choice == 4 and len(frames) > 1:
        del frames[rng.randrange(1, len(frames))]
    elif choice == 5:
        frames.insert(rng.randrange(len(frames) + 1), frames[i])
    elif choice == 6:
        frames.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
    else:
        frames = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
                  for _ in range(rng.randint(1, 4))]  # fmt: skip
    return frames


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=EXAMPLES, deadline=None)
def test_the_decoder_survives_30k_random_and_mutated_messages(seed: int) -> None:
    rng = random.Random(seed)
    frames = _base(rng)
    for _ in range(MUTATIONS_PER_EXAMPLE):
        frames = _mutate(frames, rng) if rng.random() < 0.8 else _mutate(_base(rng), rng)
        try:
            message = decode(frames, LIMIT)
        except WireError as exc:
            assert exc.reason and exc.detail
        else:
            assert message.kind in KINDS and message.nbytes == sum(len(f) for f in frames)


def test_a_live_peer_drops_2k_fuzzed_messages_counts_each_and_keeps_training(
    tmp_path: Path,
) -> None:
    """Messages from a stranger (ids no member has): each one is refused with a reason, and
    the first 2,000 of the seeded stream already reach every reason a stranger can hit."""
    # 20x slower steps (sleeping): training goes on without burning the CPU the test needs
    config = small_config(tmp_path, peers=2, steps=1_000_000, slowdown="0:20,1:20")
    path = write_config(tmp_path / "fuzz.toml", config)
    out = tmp_path / "run"
    first, address = start_peer("--config", str(path), "--rank", "0", "--out", str(out),
                                log=tmp_path / "p0.log")  # fmt: skip
    second, _ = start_peer("--config", str(path), "--rank", "1", "--bootstrap", address,
                           "--out", str(out), log=tmp_path / "p1.log")  # fmt: skip
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    try:
        wait_for(lambda: (last_record(out / "peers" / "0.jsonl") or {}).get("step", 0) >= 10,
                 60, "the swarm to train")  # fmt: skip
        before = last_record(out / "peers" / "0.jsonl")["step"]
        dealer.connect(address)
        rng = random.Random(1)
        sent = 0
        while sent < LIVE_MESSAGES:
            frames = _mutate(_base(rng), rng)
            try:  # a stranger: no member's id, and no well-formed join (anyone may join
                header = msgpack.unpackb(frames[0], raw=False)  # until CURVE allow-lists)
                if isinstance(header, dict) and (
                    header.get("sender") in (0, 1) or header.get("kind") in OPEN_KINDS
                ):
                    continue
            except Exception:
                pass
            dealer.send_multipart(frames)
            sent += 1

        def counted() -> dict[str, Any] | None:
            record = last_record(out / "peers" / "0.jsonl")
            return record if record and record["messages_dropped"] >= sent else None

        record = wait_for(counted, 120, "the peer to count every fuzzed message")
        assert record["messages_dropped"] == sent, record["dropped_reasons"]
        assert set(record["dropped_reasons"]) >= STRANGER_REASONS, record["dropped_reasons"]
        assert record["step"] > before  # still training
        first.send_signal(signal.SIGINT)
        second.send_signal(signal.SIGINT)
        assert first.wait(60) == second.wait(60) == 130  # 128 + SIGINT, after an orderly stop
        final = json.loads((out / "peers" / "0.jsonl").read_text().splitlines()[-1])
        assert final["final"] and final["messages_dropped"] == sent
    finally:
        dealer.close()
        ctx.term()
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
