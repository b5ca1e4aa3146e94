"""What makes a large simulated swarm cheap must not change what it computes.

A broadcast is decoded once for all its receivers (``SharedDecodes``), mailboxes ask who
left only about who has not sent, topologies keep their rows, the wire and the codecs look
dtypes up instead of asking numpy for their names; and the scale benchmark's MNIST-1D is
generated at the size it asks for (``mnist1d:N``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_files, small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipdl.averaging import (
    Arrival,
    Averager,
    Broadcast,
    Choco,
    DenseGossip,
    Round,
    SharedDecodes,
)
from gossipdl.compression import CodecError, Payload
from gossipdl.compression import base as compression_base
from gossipdl.compression.indices import _gaps, _steps
from gossipdl.data import DataError, load_dataset, sized_dataset
from gossipdl.data import datasets as datasets_module
from gossipdl.experiments.simulated import simulate
from gossipdl.protocol.mailbox import Mailbox
from gossipdl.sim.clock import Scheduler
from gossipdl.topologies import build_topology
from gossipdl.transport import wire

CPU = torch.device("cpu")


# ----------------------------------------------------------------- shared decodes
def _update(codec: str = "topk:0.1", seed: int = 0, n: int = 200) -> tuple[Choco, Payload]:
    averager = Choco(codec)
    generator = torch.Generator().manual_seed(seed)
    payload, _ = averager.codec.encode(torch.randn(n, generator=generator))
    return averager, payload


def test_receivers_of_one_payload_share_the_tensor_their_own_decode_would_give() -> None:
    shared = SharedDecodes()
    first, payload = _update()
    other = Choco("topk:0.1")
    copy = Payload(
        tuple(np.frombuffer(a.tobytes(), a.dtype) for a in payload.arrays), dict(payload.meta)
    )  # fmt: skip  (what another receiver decodes: a copy)
    x = shared.decode(first, payload, False, 200, CPU)
    y = shared.decode(other, copy, False, 200, CPU)
    alone = first.decode(payload, False, 200, CPU)  # CHOCO keeps top-k sparse
    assert x is y and torch.equal(x.indices, alone.indices) and torch.equal(x.values, alone.values)
    assert (shared.hits, shared.misses) == (1, 1)
    _, different = _update(seed=1)
    assert shared.decode(first, different, False, 200, CPU) is not x
    dense = Payload((np.arange(200, dtype=np.float32),), {})
    assert torch.equal(shared.decode(first, dense, True, 200, CPU), torch.arange(200.0))


def test_what_tells_payloads_apart_keeps_them_apart() -> None:
    """A meta that differs only in type (1 against 1.0) is a different payload: the second
    is refused as its own decode would refuse it, whatever the first gave."""
    shared = SharedDecodes()
    averager, payload = _update()
    shared.decode(averager, payload, False, 200, CPU)
    floated = Payload(payload.arrays, {**payload.meta, "k": float(payload.meta["k"])})
    with pytest.raises(CodecError):
        shared.decode(averager, floated, False, 200, CPU)
    with pytest.raises(CodecError):  # another size, another decode
        shared.decode(averager, payload, False, 300, CPU)


def test_averagers_that_may_write_what_arrived_decode_alone() -> None:
    class Writes(Choco):
        arrivals_read_only = False

    class OwnDecode(Choco):
        def decode(self, payload: Payload, dense: bool, numel: int, device: Any) -> Any:
            return super().decode(payload, dense, numel, device)  # its own: not shared

    shared = SharedDecodes()
    for cls in (Writes, OwnDecode):
        _, payload = _update()
        averager = cls("topk:0.1")
        one = shared.decode(averager, payload, False, 200, CPU)
        assert shared.decode(averager, payload, False, 200, CPU) is not one
    assert shared.hits == shared.misses == 0


def test_the_cache_keeps_few_tensors_beyond_what_receivers_hold() -> None:
    shared = SharedDecodes(keep=2)
    averager, _ = _update()
    for seed in range(6):
        _, payload = _update(seed=seed)
        shared.decode(averager, payload, False, 200, CPU)
    assert len(shared._recent) == 2
    tiny = SharedDecodes(keep_bytes=100)  # a tensor larger than the budget is not kept
    tiny.decode(averager, payload, False, 200, CPU)
    assert len(tiny._recent) == 0


@pytest.mark.parametrize(
    ("cls", "codec"), [(Choco, "topk:0.1"), (DenseGossip, "qsgd:16"), (Broadcast, "topk:0.1")]
)
def test_the_built_in_averagers_only_read_what_arrived(cls: type[Averager], codec: str) -> None:
    """They declare ``arrivals_read_only``, so a tensor shared with other peers must come out
    of every kind of round as it went in: resync, ordinary, late (dense gossip with a
    quantizer: it refuses a sparsifier)."""
    assert cls.arrivals_read_only
    torch.manual_seed(0)
    averager = cls(codec)
    x = torch.randn(50)
    weights = {1: 0.25, 2: 0.25}
    averager.outgoing(x, Round(0, weights, 0.5, resync=True))
    for rnd, dense in (
        (Round(0, weights, 0.5, resync=True), True),
        (Round(1, weights, 0.5), False),
    ):
        arrived = {j: Arrival(w, torch.randn(50), rnd.index, dense) for j, w in weights.items()}
        late = [(1, Arrival(0.25, torch.randn(50), rnd.index - 1, False))]
        before = [a.value.clone() for a in (*arrived.values(), late[0][1])]
        x = averager.incoming(x, rnd, arrived, [], late)
        after = [a.value for a in (*arrived.values(), late[0][1])]
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
        averager.outgoing(x, Round(rnd.index + 1, weights, 0.5))


def test_a_swarm_that_shares_its_decodes_computes_what_one_that_does_not_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharing is invisible in the run: byte-identical metrics with and without it, here on
    lossy links (resyncs, late updates) with dense public copies and sparse updates."""
    profile = {"peers": "*", "up": "2mbit", "down": "4mbit", "latency": "20ms",
               "jitter": "5ms", "loss": 0.05, "step_time": "100ms"}  # fmt: skip
    values: dict[str, Any] = dict(
        peers=6, codec="topk:0.05", steps=30, eval_every=10, log_every=5,
        profiles={"edge": profile}, topology="exponential",
    )  # fmt: skip
    shared = simulate(small_config(tmp_path, out=str(tmp_path / "shared"), **values))

    def alone(self: SharedDecodes, averager: Averager, payload: Payload, *args: Any) -> Any:
        self.misses += 1
        return averager.decode(payload, *args)

    monkeypatch.setattr(SharedDecodes, "decode", alone)
    simulate(small_config(tmp_path, out=str(tmp_path / "alone"), **values))
    assert shared["network"]["link_loss"] > 0
    assert run_files(tmp_path / "shared") == run_files(tmp_path / "alone")


# ----------------------------------------------------------------- mailbox and clock
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), max_size=20),
    st.dictionaries(st.integers(0, 5), st.integers(-1, 5), max_size=6),
    st.integers(0, 4),
    st.sets(st.integers(0, 5)),
)
def test_who_a_round_waits_for_is_what_complete_always_meant(
    puts: list[tuple[int, int]], said: dict[int, int], round: int, expected: set[int]
) -> None:
    box = Mailbox(max_pending=64)
    for sender, r in puts:
        if sender not in box._rounds.get(r, {}):
            box.put(sender, r, None)
    for sender, r in said.items():
        box.sent(sender, r)
    later = {s for r, slot in box._rounds.items() if r > round for s in slot}
    ahead = later | {s for s, r in box._sent_by.items() if r >= round}
    reference = expected - (box._rounds.get(round, {}).keys() | ahead)
    assert box.waiting_for(round, expected) == reference
    assert box.complete(round, expected) == (not reference)


def test_the_clock_runs_events_in_time_then_scheduling_order_and_skips_cancelled() -> None:
    clock, seen = Scheduler(), []
    timers = [clock.at(t, lambda t=t, i=i: seen.append((t, i))) for i, t in enumerate([2, 1, 2, 1])]
    timers[2].cancel()
    assert timers[0].at == 2.0 and clock.pending == 4
    assert clock.run(max_events=1) == 1 and seen == [(1, 1)]
    assert clock.run() == 2 and seen == [(1, 1), (1, 3), (2, 0)]
    timers[0].cancel()  # after it ran: nothing happens


# ----------------------------------------------------------------- wire, codecs, topologies
@pytest.mark.parametrize(
    "spec", [*wire.DTYPES, ">f4", ">i8", "q", "l", "?", "c8", "U3", "M8[s]", [("a", "f4")]]
)
def test_dtype_names_are_numpy_s(spec: Any) -> None:
    dtype = np.dtype(spec)
    assert wire.dtype_name(dtype) == compression_base.dtype_name(dtype) == dtype.name


def test_a_dtype_that_is_no_name_is_refused_not_a_crash() -> None:
    import msgpack

    header = {"v": wire.PROTOCOL_VERSION, "kind": "params", "sender": 1, "seq": 1,
              "round": 0, "codec": "none", "arrays": [[["float32"], [3]]], "frames": [],
              "meta": {}}  # fmt: skip
    with pytest.raises(wire.WireError) as refused:
        wire.decode([msgpack.packb(header)], 1 << 20)
    assert refused.value.reason == "bad_dtype"


@pytest.mark.parametrize("shape", [(3,), (2, 3), (), (0,)])
def test_frames_round_trip_arrays_of_any_shape(shape: tuple[int, ...]) -> None:
    arrays = [np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape),
              np.arange(5, dtype=np.uint8)]  # fmt: skip
    frames = [bytes(memoryview(f)) for f in wire.encode("params", 1, 1, 0, arrays)]
    got = wire.decode(frames, 1 << 20).arrays
    assert got[0].shape == shape and np.array_equal(got[0], arrays[0])
    assert np.array_equal(got[1], arrays[1])


@pytest.mark.parametrize("dtype", [*wire.DTYPES, ">f4", ">i8"])
def test_a_frame_is_the_array_s_bytes(dtype: str) -> None:
    array = (np.arange(12) * 7).astype(dtype).reshape(3, 4)
    assert bytes(wire._bytes_of(array)) == array.tobytes()
    assert len(wire._bytes_of(array)) == array.nbytes


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=300))
def test_gaps_are_numpy_s_differences(values: list[int]) -> None:
    indices = np.array(sorted(values), dtype=np.int64)
    expected = np.diff(indices, prepend=-1) - 1
    assert np.array_equal(_gaps(indices), expected) and _gaps(indices).dtype == expected.dtype
    assert np.array_equal(_steps(indices), expected)


def test_a_topology_row_is_read_once_and_handed_out_as_a_copy() -> None:
    topology = build_topology("exponential", 16, 0)
    fresh = build_topology("exponential", 16, 0)
    row = topology.weights(3, 0)
    row[99] = 1.0
    assert topology.weights(3, 0) == fresh.weights(3, 0) and 99 not in topology.weights(3, 0)
    assert sum(topology.weights(5, 7).values()) == pytest.approx(1.0)


# ----------------------------------------------------------------- MNIST-1D at any size
def test_a_sized_dataset_spec_names_a_generated_built_in_and_its_size() -> None:
    assert sized_dataset("mnist1d:64000") == ("mnist1d", 64000)
    for other in ("mnist1d", "digits:100", "mnist1d:x", "mod.path:fn", "mnist1d:-5", "mnist1d:²"):
        assert sized_dataset(other) is None
    for bad in ("mnist1d:0", f"mnist1d:{datasets_module.MNIST1D_MAX_TRAIN + 1}"):
        with pytest.raises(DataError, match="training samples"):
            load_dataset(bad)


class _FakeMakeDataset:
    """mnist1d's make_dataset in miniature: args.num_samples samples, split as it splits."""

    def __init__(self) -> None:
        self.args: list[Any] = []

    def __call__(self, args: Any) -> dict[str, np.ndarray]:
        self.args.append(args)
        n = args.num_samples // 10 * 10
        rng = np.random.default_rng(n)
        np.random.seed(0)
        random.seed(0)
        x, y = rng.standard_normal((n, 40)), np.repeat(np.arange(10), n // 10)
        split = int(n * args.train_split)
        return {"x": x[:split], "y": y[:split], "x_test": x[split:], "y_test": y[split:]}


def test_mnist1d_of_n_samples_is_generated_once_at_that_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mnist1d.data

    monkeypatch.setenv("GOSSIPDL_CACHE", str(tmp_path))
    fake = _FakeMakeDataset()
    monkeypatch.setattr(mnist1d.data, "make_dataset", fake)
    sized = load_dataset("mnist1d:2345")
    assert sized.name == "mnist1d:2345" and sized.input_shape == (40,)
    assert sized.x_train.shape == (2345, 40) and sized.x_test.shape == (1000, 40)
    assert fake.args[0].num_samples == 3350 and fake.args[0].seed == 42  # the standard seed
    standard = load_dataset("mnist1d")
    assert standard.x_train.shape == (4000, 40) and standard.x_test.shape == (1000, 40)
    assert fake.args[1].num_samples == 5000 and fake.args[1].train_split == 0.8
    assert len(list(tmp_path.iterdir())) == 2  # one cache file each
    again = load_dataset("mnist1d:2345")
    assert len(fake.args) == 2 and np.array_equal(again.x_test, sized.x_test)
