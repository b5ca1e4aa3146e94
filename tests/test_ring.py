"""Ring all-reduce between real processes: exact means, PowerSGD, a silent member named; the
checks on what arrives, and the codecs a ring refuses.

The ring mode of a swarm (identical models, bytes per step, PowerSGD's fewer bytes, a dead
member named) runs the same protocol core on the simulator: test_sim_ring, whose one real
ring checks the simulator against real peers."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ForkedRanks, free_addresses, in_threads, small_config

from gossipdl.config import ConfigError, load_config
from gossipdl.coordinator import (
    RingAllReduce,
    RingError,
    RingGroup,
    check_ring_codec,
    chunk_bounds,
)
from gossipdl.coordinator.ring_powersgd import LowRankAllReduce
from gossipdl.experiments.launcher import launch
from gossipdl.transport import Message, WireError

SIZES = (100_003, 7, 2)  # not divisible by 2 or 3; 2 < N = 3 leaves a chunk empty
PIECE = 10_000  # smaller than the chunks of 100_003 values: the pipeline is exercised
RINGS = [(2, "none"), (3, "none"), (3, "fp16")]
SHAPES = [(30, 20), (20,), (7, 3, 4), (5,)]
SILENT_TIMEOUT = 3.0


def _values(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel))


def _low_rank_values(rank: int, step: int) -> torch.Tensor:
    """Every matrix is (scale_rank · u vᵀ), rank 1 with the same u, v on every rank, so the
    mean is rank 1 too; the vectors are arbitrary."""
    g = torch.Generator().manual_seed(step)
    parts = []
    for shape in SHAPES:
        if len(shape) >= 2:
            rows, cols = shape[0], int(np.prod(shape[1:]))
            u, v = torch.randn(rows, 1, generator=g), torch.randn(1, cols, generator=g)
            parts.append(((rank + 1) * (u @ v)).reshape(-1))
        else:
            parts.append(torch.randn(shape, generator=torch.Generator().manual_seed(rank + 99)))
    return torch.cat(parts)


def _rank_main(
    rank: int,
    rings: list[tuple[int, str, int, list[str]]],
    low_rank: list[str],
    silent: list[str],
    results: Any,
) -> None:
    """One process: take part in every ring that has this rank and report the means; then
    PowerSGD over a ring of all three; then a ring whose rank 2 never speaks."""
    torch.set_num_threads(1)
    for n, codec, numel, addresses in rings:
        if rank < n:
            with RingGroup(rank, addresses, numel, codec=codec, piece=PIECE, shared=False) as ring:
                mean = ring.allreduce_mean(_values(rank, numel)).numpy()
            results.put(("mean", (n, codec, numel, rank, mean)))
    groups: list[RingGroup] = []

    def make_ring(numel: int) -> RingAllReduce:
        groups.append(RingGroup(rank, low_rank, numel, shared=False))
        return groups[-1].ring

    reducer = LowRankAllReduce(SHAPES, 1, make_ring, seed=3)
    out = [reducer.allreduce_mean_(_low_rank_values(rank, step)).numpy() for step in range(3)]
    results.put(("low_rank", (rank, out, reducer.error.abs().max().item(), groups[0].ring.numel)))
    for group in groups:
        group.close()
    if rank < 2:  # rank 2 stays silent: it never even listens
        group = RingGroup(rank, silent, 10, timeout=SILENT_TIMEOUT, shared=False)
        try:
            group.allreduce_mean(torch.ones(10))
            results.put(("silent", (rank, "")))
        except RingError as exc:
            results.put(("silent", (rank, str(exc))))
        finally:
            group.transport.close(flush_timeout=0.5)


def test_ring_allreduce_over_real_processes(forked_ranks: ForkedRanks) -> None:
    """Three real processes, real sockets, the threaded driver on the wall clock:

    - the exact mean for rings of 2 and 3 (float32, and fp16 on the wire), with pieces
      smaller than chunks so the pipeline is exercised, and an empty chunk;
    - PowerSGD over the ring is exact for a low-rank mean and equal on every rank;
    - a member that never speaks stops both others within their timeout, with an error
      naming it (the protocol's timeouts and notices are in test_sim_ring)."""
    rings = [(n, codec, numel, free_addresses(n)) for n, codec in RINGS for numel in SIZES]
    low_rank, silent = free_addresses(3), free_addresses(3)
    for rank in range(3):
        forked_ranks.start(_rank_main, rank, rings, low_rank, silent, forked_ranks.results)
    expected_count = sum(n for n, *_ in rings) + 3 + 2
    got: dict[str, list[Any]] = {"mean": [], "low_rank": [], "silent": []}
    for _ in range(expected_count):
        kind, item = forked_ranks.get(timeout=120)
        got[kind].append(item)
    assert forked_ranks.join(30) == [0, 0, 0], forked_ranks.report()

    means: dict[tuple[int, str, int], dict[int, np.ndarray]] = {}
    for n, codec, numel, rank, mean in got["mean"]:
        means.setdefault((n, codec, numel), {})[rank] = mean
    assert sorted(means) == sorted((n, codec, numel) for n, codec, numel, _ in rings)
    for (n, codec, numel), by_rank in means.items():
        exact = torch.stack([_values(r, numel) for r in range(n)]).double().mean(0).numpy()
        assert sorted(by_rank) == list(range(n))
        for mean in by_rank.values():
            assert mean.shape == (numel,) and mean.dtype == np.float32
            assert np.array_equal(mean, by_rank[0]), "every rank must end with the same values"
            # fp16 rounds each of the N-1 partial sums it sends; float32 only the additions
            tolerance = 5e-3 * n if codec == "fp16" else 1e-6
            np.testing.assert_allclose(mean, exact, atol=tolerance, rtol=0)

    low = {rank: (out, error, length) for rank, out, error, length in got["low_rank"]}
    assert sorted(low) == [0, 1, 2]
    for step in range(3):
        exact = torch.stack([_low_rank_values(r, step) for r in range(3)]).mean(0).numpy()
        for rank in range(3):
            np.testing.assert_allclose(low[rank][0][step], exact, atol=1e-3, rtol=1e-3)
            assert np.array_equal(low[rank][0][step], low[0][0][step])
    assert all(error < 1e-3 for _, error, _ in low.values())
    # P (30 + 7 rows, rank 1) and the 25 vector values, or Q (20 + 12 cols): 62 < 770 values
    assert low[0][2] == 30 + 7 + 20 + 5

    errors = dict(got["silent"])
    assert sorted(errors) == [0, 1]
    assert "nothing from peer 2 (its predecessor)" in errors[0], errors[0]
    # rank 1 waits on rank 0, which waits on the silent one; whether rank 1's error also
    # names peer 2 depends on a notice's timing here (test_sim_ring checks it on virtual time)
    assert "nothing from peer 0 (its predecessor)" in errors[1], errors[1]


def ring_means_in_threads(tensors: list[torch.Tensor], shared: bool | None = None) -> None:
    """Average ``tensors`` in place over a ring of ``len(tensors)`` ranks in this process,
    one thread each (real sockets; for the copies a tensor that is not a contiguous float32
    CPU vector goes through); ``shared`` as :class:`RingGroup` takes it."""
    addresses = free_addresses(len(tensors))
    n = tensors[0].numel()
    groups = [RingGroup(r, addresses, n, shared=shared) for r in range(len(tensors))]
    try:
        errors = in_threads(lambda r: groups[r].allreduce_mean_(tensors[r]), range(len(tensors)))
    finally:
        for group in groups:
            group.close()
    assert not errors, errors


def test_a_strided_or_double_tensor_is_averaged_in_place_through_a_copy() -> None:
    """A transposed float32 matrix and a float64 one: reduced through one host copy each
    and written back into the caller's tensor."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(30, 40, generator=g).t(), torch.randn(40, 30, generator=g).double()
    want = (a.double() + b) / 2
    ring_means_in_threads([a, b])
    assert not a.is_contiguous() and b.dtype == torch.float64
    torch.testing.assert_close(a.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(b, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["tcp://localhost", "ipc://"])
def test_a_tcp_ring_over_a_host_name_or_ipc_addresses_averages(kind: str, tmp_path: Path) -> None:
    """Both are local forms the ring documents; once peers stopped dialling host names, every
    piece to ``tcp://localhost:`` or ``ipc://`` was dropped and the ring timed out."""
    if kind == "ipc://":
        addresses = [f"ipc://{tmp_path}/r{r}" for r in range(2)]
    else:
        addresses = [a.replace("127.0.0.1", "localhost") for a in free_addresses(2)]
    groups = [RingGroup(r, addresses, 8, shared=False, timeout=10.0) for r in range(2)]
    xs = [torch.full((8,), float(r)) for r in range(2)]
    try:
        errors = in_threads(lambda r: groups[r].allreduce_mean_(xs[r]), range(2))
    finally:
        for group in groups:
            group.close()
    assert not errors, errors
    assert all(torch.equal(x, torch.full((8,), 0.5)) for x in xs)


def test_chunks_cover_the_vector_with_sizes_within_one() -> None:
    for numel in (0, 1, 7, 10, 1_000_003):
        for parts in (1, 2, 3, 5, 8):
            bounds = chunk_bounds(numel, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel and len(bounds) == parts
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("codec", ["topk:0.01", "sign", "qsgd:16", "randomk:0.1"])
def test_a_sparse_or_quantized_codec_is_refused_with_the_reason(codec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="re-compressed at every hop"):
        check_ring_codec(codec)
    with pytest.raises(ConfigError, match=f"codec = '{codec}'.*none, fp16"):
        load_config(None, mode="ring", codec=codec)


def test_a_malformed_chunk_is_dropped_with_a_reason() -> None:
    ring = RingAllReduce(1, [0, 1, 2], 10, lambda j, f: None)
    good = {"step": 0, "piece": 0}
    piece = np.zeros(4, np.float32)  # rank 1 receives chunk 0 (values 0..3) at step 0

    def chunk(sender: int = 0, meta: Any = good, arrays: Any = (piece,), rnd: int = 0) -> Message:
        return Message("chunk", sender, 0, rnd, "none", list(arrays), meta)

    ring.deliver(chunk())  # accepted
    for bad, reason in [
        (chunk(sender=2), "unexpected"),
        (chunk(meta={"step": "0", "piece": 0}), "bad_meta"),
        (chunk(meta={"step": 4, "piece": 0}), "bad_meta"),
        (chunk(meta={"step": 0, "piece": 1}), "bad_meta"),
        (chunk(arrays=(np.zeros(3, np.float32),)), "bad_payload"),
        (chunk(arrays=(np.zeros(4, np.float16),)), "bad_payload"),
        (chunk(arrays=()), "bad_payload"),
        (chunk(rnd=5), "unexpected"),
        # all-gather step 2: rank 1 receives the finished chunk 1 (values 4..6)
        (
            chunk(meta={"step": 2, "piece": 0}, arrays=(np.full(3, np.nan, np.float32),)),
            "non_finite",
        ),
    ]:
        with pytest.raises(WireError) as err:
            ring.deliver(bad)
        assert err.value.reason == reason


@pytest.mark.parametrize(
    ("codec", "own", "received"),
    [
        ("none", [0.0, 0.0, 0.0, 0.0], [1.0, np.nan]),  # NaN survives the addition
        ("fp16", [0.0, 0.0, 0.0, 2e5], [0.0, 0.0]),  # a finite mean past float16's range
    ],
)
def test_a_non_finite_partial_sum_stops_the_rank_that_completes_the_chunk(
    codec: str, own: list[float], received: list[float]
) -> None:
    """Reduce-scatter pieces are checked once, as a finished mean in what goes on the wire.
    An fp16 mean that overflowed in the cast was kept by the finishing rank as its result,
    and its successor refused it and timed out blaming it."""
    sent: list[Any] = []
    ring = RingAllReduce(0, [0, 1], 4, lambda j, frames: sent.append(frames), codec=codec,
                         timeout=5)  # fmt: skip
    wire = np.float16 if codec == "fp16" else np.float32
    partial = np.array(received, wire)  # rank 0 receives chunk 1 (values 2..3)
    ring.deliver(Message("chunk", 1, 0, 0, codec, [partial], {"step": 0, "piece": 0}))
    with pytest.raises(RingError, match="mean of chunk 1 is not finite"):
        ring.allreduce_mean_(torch.tensor(own))
    assert len(sent) == 1  # only its own chunk went out; the poisoned sum never did


@pytest.mark.parametrize("codec", ["none", "powersgd:1"])
def test_a_local_swarm_ring_through_shared_memory_ends_where_the_tcp_ring_does(
    tmp_path: Path, codec: str
) -> None:
    """Two real peer processes (``gossipdl run --mode ring``): with ``shared_memory`` the
    same final losses and accuracies as over TCP (a + b is one sum both ways), and none of
    the all-reduce's bytes on the wire (heartbeats and forming only)."""
    check_shared_ring_runs_as_the_tcp_ring(tmp_path, codec=codec)


def check_shared_ring_runs_as_the_tcp_ring(
    tmp_path: Path, rel: float = 0.0, **changes: Any
) -> None:
    """Two-peer ring swarms over TCP and through shared memory end on the same losses and
    accuracies (within ``rel``: a GPU's kernels need not repeat bit for bit); the shared
    one sends no all-reduce message."""
    summaries = {}
    for shared in (False, True):
        config = small_config(
            tmp_path, mode="ring", peers=2, steps=30, shared_memory=shared,
            out=str(tmp_path / f"shared-{shared}"), **changes,
        )  # fmt: skip
        summaries[shared] = launch(config, progress=False)
        assert summaries[shared]["peers_finished"] == 2
    tcp, shared_ = summaries[False], summaries[True]
    for key in ("loss", "accuracy"):
        want = [p[key] for p in tcp["peers"]]
        assert [p[key] for p in shared_["peers"]] == pytest.approx(want, rel=rel, abs=rel), key
    assert [p["device"] for p in shared_["peers"]] == [p["device"] for p in tcp["peers"]]
    assert shared_["total_messages_sent"] == 0 < tcp["total_messages_sent"]
    assert shared_["total_bytes_sent"] < tcp["total_bytes_sent"] / 10
