"""The all-reduce through shared memory that ranks on one host use: exact means over real
processes, a rank that dies or stalls named at once, a non-finite mean stopping every rank,
mismatched settings refused, when a ring group takes it, and a GPU region's description
checked (the GPU path itself: tests/test_gpu.py)."""

from __future__ import annotations

import os
import struct
import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ForkedRanks, free_addresses, in_threads

from gossipdl.coordinator import RingError, RingGroup
from gossipdl.coordinator.cuda_ipc import CudaIpcError, open_shared
from gossipdl.coordinator.shared_reduce import SharedAllReduce, SharedReduceError

SIZES = (100_003, 5, 2)  # not divisible by the ranks or the piece; 2 < N leaves shares empty
PIECE = 4_001  # many pieces, alternating halves of the region


def _values(rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(numel).astype(np.float32)


def _in_threads(groups: list[SharedAllReduce], xs: list[Any]) -> list[BaseException]:
    """Each group averages its vector on a thread of its own; the errors they raised."""

    def reduce(rank: int) -> None:
        try:
            groups[rank].allreduce_mean_(xs[rank])
        except BaseException:
            groups[rank].close()  # as a process that stops on it lets go
            raise

    return in_threads(reduce, range(len(groups)))


def _rank_main(rank: int, addresses: list[str], results: Any, dies: int) -> None:
    """One process: the mean of every size, then (but rank ``dies``, which crashes) one more."""
    torch.set_num_threads(1)
    group = RingGroup(rank, addresses, max(SIZES), timeout=20.0)
    results.put(("shared", rank, group.shared is not None))
    for numel in SIZES:
        small = SharedAllReduce(rank, len(addresses), numel, f"{addresses}|{numel}", piece=PIECE)
        results.put(("mean", rank, numel, small.allreduce_mean_(_values(rank, numel))))
        small.close()
    group.allreduce_mean_(torch.ones(max(SIZES)))
    if rank == dies:  # what it put must reach the test first: os._exit skips the queue's flush
        results.close()
        results.join_thread()
        os._exit(3)  # a crash: no close, the kernel drops its sockets and mapping
    started = time.monotonic()
    try:
        group.allreduce_mean_(torch.ones(max(SIZES)))
        results.put(("after", rank, "", 0.0))
    except RingError as exc:
        results.put(("after", rank, str(exc), time.monotonic() - started))
    group.close()


@pytest.mark.parametrize("dies", [2, 0])
def test_ranks_on_one_host_average_through_shared_memory_and_name_one_that_dies(
    dies: int, forked_ranks: ForkedRanks
) -> None:
    """Three real processes on loopback addresses: their ring group takes shared memory;
    every rank ends with the exact mean of every size (the same values on each), and when
    one crashes the others stop at once with an error naming it, not at their timeout."""
    addresses = free_addresses(3)
    for rank in range(3):
        forked_ranks.start(_rank_main, rank, addresses, forked_ranks.results, dies)
    got: dict[str, list[Any]] = {"shared": [], "mean": [], "after": []}
    for _ in range(3 + 3 * len(SIZES) + 2):
        kind, *item = forked_ranks.get(timeout=120)
        got[kind].append(item)
    codes = forked_ranks.join(30)
    assert codes == [3 if r == dies else 0 for r in range(3)], forked_ranks.report()
    assert all(shared for _, shared in got["shared"])
    for numel in SIZES:
        exact = np.mean([_values(r, numel).astype(np.float64) for r in range(3)], 0)
        means = [mean for _, n, mean in got["mean"] if n == numel]
        assert len(means) == 3 and all(np.array_equal(m, means[0]) for m in means)
        np.testing.assert_allclose(means[0], exact, atol=1e-6, rtol=0)
    for rank, error, waited in got["after"]:
        assert rank != dies and f"rank {dies}" in error and waited < 10.0, (rank, error)


def test_a_mean_that_is_not_finite_stops_every_rank() -> None:
    key = uuid.uuid4().hex
    groups = [SharedAllReduce(r, 3, 50, key, piece=16) for r in range(3)]
    xs = [_values(r, 50) for r in range(3)]
    xs[1][37] = np.nan
    errors = _in_threads(groups, xs)
    assert len(errors) == 3 and all("not finite" in str(e) for e in errors), errors


def test_a_rank_that_stalls_is_named_at_the_timeout() -> None:
    """Rank 2 never comes: rank 0 names it after its timeout, rank 1 hears it from rank 0."""
    key = uuid.uuid4().hex
    groups = [SharedAllReduce(r, 3, 10, key, timeout=0.5) for r in range(2)]
    errors = _in_threads(groups, [_values(r, 10) for r in range(2)])
    messages = sorted(str(e) for e in errors)
    assert len(messages) == 2, messages
    assert "rank 2 did not come within 0.5s" in messages[0]
    # rank 1 times out too, or hears rank 0 close first
    assert messages[1].startswith("rank 1"), messages[1]
    assert "rank 0 left" in messages[1] or "nothing from rank 0" in messages[1], messages[1]


def test_a_rank_that_stalls_mid_run_is_the_one_every_rank_names() -> None:
    """Rank 2 stops coming after one all-reduce; rank 1 arrives before rank 0. Rank 0 waits
    its timeout for rank 2 and says so: rank 1, which waited the same timeout from an
    earlier start, gave up first and blamed rank 0, alive and waiting."""
    key, timeout = uuid.uuid4().hex, 1.0
    groups = [SharedAllReduce(r, 3, 10, key, timeout=timeout) for r in range(3)]
    errors: dict[int, str] = {}

    def work(rank: int) -> None:
        groups[rank].allreduce_mean_(_values(rank, 10))
        if rank == 2:  # stalls: it comes back only after the others gave up
            time.sleep(3 * timeout)
        else:
            time.sleep(0.3 if rank == 0 else 0.0)
            try:
                groups[rank].allreduce_mean_(_values(rank, 10))
            except SharedReduceError as exc:
                errors[rank] = str(exc)
        groups[rank].close()

    assert not in_threads(work, range(3))
    assert sorted(errors) == [0, 1], errors
    assert "nothing from rank 2" in errors[0] and "rank 2 left or stalled" in errors[1], errors


def test_a_rank_with_other_settings_is_refused_naming_both() -> None:
    key = uuid.uuid4().hex
    groups = [SharedAllReduce(0, 2, 10, key, timeout=5.0), SharedAllReduce(1, 2, 12, key)]
    errors = _in_threads(groups, [_values(0, 10), _values(1, 12)])
    messages = sorted(str(e) for e in errors)
    ours, theirs = "sent settings (2, 10, 10, 120, 0)", "(2, 12, 12, 144, 0)"
    assert any(ours in m and theirs in m for m in messages), messages
    assert any("rank 1 left" in m for m in messages), messages  # it stopped: rank 0 too


def test_a_ring_group_takes_shared_memory_only_where_it_can() -> None:
    local = free_addresses(2)
    with RingGroup(0, local, 10) as group:
        assert group.shared is not None and group.transport is None  # no TCP endpoint
    for kwargs in ({"codec": "fp16"}, {"shared": False}):
        with RingGroup(0, free_addresses(2), 10, **kwargs) as group:
            assert group.shared is None
    far = [local[0], "tcp://192.0.2.7:5600"]  # another host's address
    with RingGroup(0, far, 10) as group:
        assert group.shared is None
    with pytest.raises(ValueError, match="shared memory takes codec none"):
        RingGroup(0, free_addresses(2), 10, codec="fp16", shared=True)
    with pytest.raises(SharedReduceError, match="rank 1 did not come"):
        SharedAllReduce(0, 2, 4, uuid.uuid4().hex, timeout=0.2).allreduce_mean_(_values(0, 4))


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        (b"\x00" * 8, "too short"),
        (struct.pack("<4q", 4096, 0, 0, 0), "cut short"),
        (struct.pack("<4q", 4096, 0, 0, 0) + struct.pack("<i", 1 << 20), "field of 1048576"),
        (struct.pack("<4q", 4096, 0, 0, 0) + struct.pack("<i", 5) + b"ab", "field of 5"),
        (struct.pack("<4q", 4096, 0, 0, 0) + struct.pack("<i", -1) * 4, "malformed"),
        (struct.pack("<4q", 4096, 0, 0, 0) + struct.pack("<i", 0) * 4 + b"x", "malformed"),
        (struct.pack("<4q", 40, 0, 0, 0) + struct.pack("<i", 0) * 4, "holds 40 bytes"),
    ],
)
def test_a_malformed_gpu_region_description_is_refused_before_cuda(blob: bytes, says: str) -> None:
    """What a rank takes from rank 0 for a GPU region is checked field by field before
    anything reaches CUDA (on any machine)."""
    with pytest.raises(CudaIpcError, match=says):
        open_shared(blob, 100)


def test_a_shared_ring_group_returns_a_new_mean_and_keeps_its_input() -> None:
    """``allreduce_mean`` goes through shared memory too, into a new tensor."""
    addresses = free_addresses(2)
    groups = [RingGroup(r, addresses, 5) for r in range(2)]
    xs = [torch.arange(5.0) * (r + 1) for r in range(2)]
    means: dict[int, torch.Tensor] = {}
    try:
        errors = in_threads(lambda r: means.update({r: groups[r].allreduce_mean(xs[r])}), range(2))
    finally:
        for group in groups:
            group.close()
    assert not errors, errors
    for r in range(2):
        assert torch.equal(means[r], torch.arange(5.0) * 1.5)
        assert torch.equal(xs[r], torch.arange(5.0) * (r + 1))
