"""Ring all-reduce: exact means between real processes, the ring mode of a swarm, a dead member."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import last_record, small_config, start_peer, wait_for, write_config

from gossipdl.config import ConfigError, load_config
from gossipdl.coordinator import (
    RingAllReduce,
    RingError,
    RingGroup,
    check_ring_codec,
    chunk_bounds,
)
from gossipdl.coordinator.ring_powersgd import LowRankAllReduce
from gossipdl.experiments.launcher import launch, preflight
from gossipdl.transport import Message, WireError

SIZES = (1_000_003, 7, 3)  # not divisible by 2..5; 3 < N leaves some chunks empty


def _free_addresses(n: int) -> list[str]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    addresses = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    for s in sockets:
        s.close()
    return addresses


def _values(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel))


def _rank_main(rank: int, rings: list[tuple[int, str, int, list[str]]], results: Any) -> None:
    """One process: take part in every ring that has this rank, report the means."""
    torch.set_num_threads(1)
    for n, codec, numel, addresses in rings:
        if rank < n:
            with RingGroup(rank, addresses, numel, codec=codec, piece=100_000) as ring:
                mean = ring.allreduce_mean(_values(rank, numel)).numpy()
            results.put((n, codec, numel, rank, mean))


def test_ring_allreduce_is_the_exact_mean_for_2_to_5_processes() -> None:
    """Real processes, real sockets; pieces smaller than chunks, so the pipeline is exercised."""
    kinds = [(n, "none") for n in (2, 3, 4, 5)] + [(4, "fp16")]
    rings = [(n, codec, numel, _free_addresses(n)) for n, codec in kinds for numel in SIZES]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, rings, results)) for r in range(5)]
    for p in procs:
        p.start()
    expected_count = sum(n for n, *_ in rings)
    got: dict[tuple[int, str, int], dict[int, np.ndarray]] = {}
    for _ in range(expected_count):
        n, codec, numel, rank, mean = results.get(timeout=120)
        got.setdefault((n, codec, numel), {})[rank] = mean
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for (n, codec, numel), by_rank in got.items():
        exact = torch.stack([_values(r, numel) for r in range(n)]).double().mean(0).numpy()
        assert sorted(by_rank) == list(range(n))
        for mean in by_rank.values():
            assert mean.shape == (numel,) and mean.dtype == np.float32
            assert np.array_equal(mean, by_rank[0]), "every rank must end with the same values"
            # fp16 rounds each of the N-1 partial sums it sends; float32 only the additions
            tolerance = 5e-3 * n if codec == "fp16" else 1e-6
            np.testing.assert_allclose(mean, exact, atol=tolerance, rtol=0)


SHAPES = [(30, 20), (20,), (7, 3, 4), (5,)]


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


def _low_rank_main(rank: int, addresses: list[list[str]], results: Any) -> None:
    torch.set_num_threads(1)
    groups: list[RingGroup] = []

    def make_ring(numel: int) -> RingAllReduce:
        groups.append(RingGroup(rank, addresses[0], numel))
        return groups[-1].ring

    reducer = LowRankAllReduce(SHAPES, 1, make_ring, seed=3)
    out = [reducer.allreduce_mean_(_low_rank_values(rank, step)).numpy() for step in range(3)]
    results.put((rank, out, reducer.error.abs().max().item(), groups[0].ring.numel))
    for group in groups:
        group.close()


def test_powersgd_over_the_ring_is_exact_for_a_low_rank_mean_and_equal_on_every_rank() -> None:
    n = 3
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addresses = [_free_addresses(n)]
    procs = [ctx.Process(target=_low_rank_main, args=(r, addresses, results)) for r in range(n)]
    for p in procs:
        p.start()
    got = {
        rank: (out, error, length)
        for rank, out, error, length in (results.get(timeout=120) for _ in range(n))
    }
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for step in range(3):
        exact = torch.stack([_low_rank_values(r, step) for r in range(n)]).mean(0).numpy()
        for rank in range(n):
            np.testing.assert_allclose(got[rank][0][step], exact, atol=1e-3, rtol=1e-3)
            assert np.array_equal(got[rank][0][step], got[0][0][step])
    assert all(error < 1e-3 for _, error, _ in got.values())
    # P (30 + 7 rows, rank 1) and the 25 vector values, or Q (20 + 12 cols): 62 < 770 values
    assert got[0][2] == 30 + 7 + 20 + 5


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


def test_a_non_finite_partial_sum_stops_the_rank_that_completes_the_chunk() -> None:
    """Reduce-scatter pieces are checked once, as a finished sum: NaN survives the addition."""
    sent: list[Any] = []
    ring = RingAllReduce(0, [0, 1], 4, lambda j, frames: sent.append(frames), timeout=5)
    poisoned = np.array([1.0, np.nan], np.float32)  # rank 0 receives chunk 1 (values 2..3)
    ring.deliver(Message("chunk", 1, 0, 0, "none", [poisoned], {"step": 0, "piece": 0}))
    with pytest.raises(RingError, match="mean of chunk 1 is not finite"):
        ring.allreduce_mean_(torch.zeros(4))
    assert len(sent) == 1  # only its own chunk went out; the poisoned sum never did


def test_ring_mode_trains_identical_models_with_2_n_minus_1_over_n_of_the_model_per_step(
    tmp_path: Path,
) -> None:
    """Gradients every step: every peer holds the same model; bytes match the ring's formula."""
    config = small_config(tmp_path, mode="ring", peers=3, steps=40)
    summary = launch(config, progress=False)
    assert summary["peers_finished"] == 3
    assert summary["consensus_distance"] == 0
    accuracies = {p["accuracy"] for p in summary["peers"]}
    assert len(accuracies) == 1 and accuracies.pop() > 0.5
    numel = preflight(config)
    sent = 0
    for peer in range(3):
        path = Path(config.out) / "peers" / f"{peer}.jsonl"
        last = json.loads(path.read_text().splitlines()[-1])
        sent += last["bytes_sent"] - last["header_bytes_sent"]
    # per all-reduce each chunk crosses each of the 2(N-1) steps once: 2(N-1) float32 models
    payload = 40 * 2 * (3 - 1) * 4 * numel
    assert payload <= sent <= payload * 1.01 + 3000  # + start-up and leave messages


def test_ring_mode_with_powersgd_trains_identical_models_on_fewer_bytes(tmp_path: Path) -> None:
    config = small_config(tmp_path, mode="ring", peers=3, steps=60, model="mlp", hidden=(32,))
    dense = launch(config.replace(out=str(tmp_path / "dense")), progress=False)
    low = launch(config.replace(codec="powersgd:1", out=str(tmp_path / "low")), progress=False)
    assert low["peers_finished"] == 3 and low["consensus_distance"] == 0
    assert low["mean_accuracy"] > 0.6
    assert low["total_bytes_sent"] < dense["total_bytes_sent"] / 2


def test_a_dead_member_stops_the_ring_within_its_timeout_naming_it(tmp_path: Path) -> None:
    """kill -9 one of three peers: both others exit with an error naming it, never hang."""
    config = small_config(tmp_path, mode="ring", peers=3, steps=1_000_000, round_timeout=3.0)
    path = write_config(tmp_path / "ring.toml", config)
    out = tmp_path / "run"
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    first, address = start_peer(
        "--config", str(path), "--rank", "0", "--out", str(out), log=logs[0]
    )
    procs = [first] + [
        start_peer("--config", str(path), "--rank", str(i), "--bootstrap", address,
                   "--out", str(out), log=logs[i])[0]
        for i in (1, 2)
    ]  # fmt: skip
    try:
        wait_for(lambda: (last_record(out / "peers" / "2.jsonl") or {}).get("step", 0) >= 20,
                 60, "the ring to train")  # fmt: skip
        os.kill(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        for i in (0, 2):
            assert procs[i].wait(timeout=config.round_timeout + 20) != 0
        assert time.monotonic() - killed < config.round_timeout + 20
        text = {i: " ".join(logs[i].read_text().split()) for i in (0, 2)}
        assert "error: peer 2, ring all-reduce" in text[2]
        assert "nothing from peer 1 (its predecessor)" in text[2]
        # peer 0 waits on peer 2, which waits on the dead one: its error still names peer 1
        assert re.search(r"error: peer 0, ring all-reduce \d+: .*\bpeer 1\b", text[0]), text[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
