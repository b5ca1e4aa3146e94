"""On a GPU: peers train there and codecs keep their work there (skipped without CUDA:
this project's CI machines have none; run them where ``torch.cuda.is_available()``)."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import free_addresses, small_config
from test_peer_api import OVERLAP_CASES, train_a_ring, two_steps_of_a_w
from test_ring import check_shared_ring_runs_as_the_tcp_ring, ring_means_in_threads
from test_robust import check_clipping_shrugs_off_a_byzantine_peer_process
from test_shared_reduce import _in_threads, _values

from gossipdl.averaging.robust import parse_defence
from gossipdl.compression import CodecError, Payload, build_codec
from gossipdl.compression._kernels import from_host, to_host
from gossipdl.coordinator import RingGroup
from gossipdl.coordinator.shared_reduce import SharedAllReduce
from gossipdl.experiments.launcher import launch
from gossipdl.peers.device import pick_device
from gossipdl.rundir import RunDir

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"
)


@pytest.mark.parametrize("overlap", [False, True])
def test_local_peers_train_on_the_gpu_and_say_so(tmp_path: Path, overlap: bool) -> None:
    """Each peer's final line names the GPU its model trained on (with overlap too: the
    round's thread works on the same GPU)."""
    config = small_config(tmp_path, peers=2, steps=20, device="auto", algorithm="choco",
                          codec="topk:0.1+raw", overlap=overlap)  # fmt: skip
    summary = launch(config, progress=False)
    assert summary["peers_finished"] == 2
    run = RunDir(config.out)
    for i in range(2):
        final = list(run.records(i))[-1]
        assert final["device"].startswith("cuda"), final["device"]


@pytest.mark.parametrize(
    "spec", ["none", "fp16", "sign", "qsgd:16", "qsgd:16:trits", "topk:0.01+raw", "ternary"]
)
def test_a_codec_leaves_its_tensors_on_the_gpu(spec: str) -> None:
    """The sender's estimate and the decoded tensor stay on the device; only the payload
    is on the host (the wire's bytes)."""
    x = torch.randn(100_000, device="cuda")
    codec = build_codec(spec)
    payload, estimate = codec.encode(x)
    decoded = codec.decode(payload, x.numel(), x.device)
    assert estimate.device == x.device and decoded.device == x.device
    torch.testing.assert_close(decoded, estimate)


def test_delta_golomb_indices_built_on_the_gpu_are_the_hosts_bytes() -> None:
    """Top-1% with delta-golomb indices: the streams built on the GPU are the bytes the
    host builds from the same indices, and decode to them."""
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(4))
    codec = build_codec("topk:0.01")
    on_gpu, _ = codec.encode(x.cuda())
    on_host, _ = codec.encode(x)
    assert on_gpu.meta == on_host.meta
    for got, want in zip(on_gpu.arrays, on_host.arrays, strict=True):
        assert np.array_equal(got, want)
    torch.testing.assert_close(codec.decode(on_gpu, x.numel()), codec.decode(on_host, x.numel()))


def test_a_bad_qsgd_code_is_refused_before_it_reaches_the_gpu() -> None:
    """QSGD's decoder checks its codes on the host (no sync): a code over 2·LEVELS raises."""
    codec = build_codec("qsgd:4:0")
    payload, _ = codec.encode(torch.randn(100, device="cuda"))
    packed = payload.arrays[0].copy()
    packed[0] = 255
    bad = Payload((packed, *payload.arrays[1:]), payload.meta)
    with pytest.raises(CodecError, match="2·LEVELS"):
        codec.decode(bad, 100, torch.device("cuda", 0))


def test_cuda_without_an_index_names_the_peers_gpu() -> None:
    """``--device cuda`` gives an indexed device, which ``torch.cuda.set_device`` needs."""
    device = pick_device("cuda", local_index=torch.cuda.device_count())
    assert device == torch.device("cuda", 0)
    torch.cuda.set_device(device)


@pytest.mark.parametrize(("overlap", "expected"), OVERLAP_CASES)
def test_overlap_on_the_gpu_takes_the_gradient_at_the_model_it_sent(
    overlap: bool, expected: float
) -> None:
    """The hand-worked two steps of test_peer_api on the GPU, where the round and the
    receive thread queue their work on a stream of their own."""
    assert two_steps_of_a_w(overlap, "cuda") == [pytest.approx(expected)] * 2


def test_a_ring_on_the_gpu_sends_gradient_buckets_during_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """test_peer_api's overlapped ring on the GPU: hooks on autograd's device thread, the
    buckets through pinned memory; the same parameters as the one-shot average (on CPU)."""
    import gossipdl.peers.peer as peer_module

    monkeypatch.setattr(peer_module, "GRADIENT_BUCKET_NUMEL", 10)
    overlapped, early = train_a_ring(overlap=True, device="cuda")
    whole, _ = train_a_ring(overlap=False)
    assert all(torch.equal(m, overlapped[0]) for m in overlapped)
    torch.testing.assert_close(overlapped[0], whole[0], rtol=0, atol=1e-5)
    assert min(early) >= 1


def test_a_local_swarm_ring_through_shared_memory_averages_on_the_gpu(tmp_path: Path) -> None:
    """``--mode ring --shared-memory`` with GPU peers (their region on the GPU, by CUDA IPC
    between the peer processes) ends on the TCP ring's losses, every peer on a GPU."""
    check_shared_ring_runs_as_the_tcp_ring(tmp_path, rel=0.02, device="auto")
    run = RunDir(tmp_path / "shared-True")
    assert all(list(run.records(i))[-1]["device"].startswith("cuda") for i in range(2))


def test_a_shared_memory_ring_on_the_gpu_sends_gradient_buckets_during_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The overlapped buckets through shared memory on the GPU: the TCP ring's parameters."""
    import gossipdl.peers.peer as peer_module

    monkeypatch.setattr(peer_module, "GRADIENT_BUCKET_NUMEL", 10)
    shared, _ = train_a_ring(overlap=True, device="cuda", shared_memory=True)
    tcp, _ = train_a_ring(overlap=False)
    assert all(torch.equal(m, shared[0]) for m in shared)
    torch.testing.assert_close(shared[0], tcp[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_the_ring_averages_gpu_tensors_in_place(shared: bool) -> None:
    """The all-reduce takes GPU tensors, through shared memory and through the TCP ring:
    down through pinned memory, the mean written back on the device."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(100_003, generator=g).cuda() for _ in range(3)]
    want = torch.stack(xs).mean(0)
    ring_means_in_threads(xs, shared=shared)
    for x in xs:
        assert x.is_cuda
        torch.testing.assert_close(x, want, rtol=0, atol=1e-5)


def test_payloads_cross_to_the_host_through_pinned_memory() -> None:
    """A payload leaves the GPU into pinned memory and comes back equal."""
    x = torch.randn(1000, device="cuda")
    host = to_host(x)
    assert torch.from_numpy(host).is_pinned()
    back = from_host(host, x.device)
    torch.testing.assert_close(back, x)


def _gpu_rank(rank: int, addresses: list[str], results: Any) -> None:
    """One process: GPU vectors averaged by a ring group and by a small-piece shared
    all-reduce (every rank on cuda:0, its region opened by CUDA IPC)."""
    torch.cuda.set_device(0)
    x = torch.from_numpy(_values(rank, 100_003)).cuda()
    with RingGroup(rank, addresses, x.numel(), timeout=30.0) as group:
        group.allreduce_mean_(x)
    small = SharedAllReduce(rank, 3, 50_001, f"{addresses}|small", piece=4_001)
    y = small.allreduce_mean_(torch.from_numpy(_values(rank, 50_001)).cuda())
    results.put((rank, x.is_cuda and y.is_cuda, x.cpu().numpy(), y.cpu().numpy()))
    small.close()


def test_processes_average_gpu_tensors_on_the_gpu() -> None:
    """Three processes on one GPU average through a region on it (CUDA IPC): every rank
    ends with the same exact mean, left on the GPU."""
    addresses = free_addresses(3)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gpu_rank, args=(r, addresses, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    for which, numel in ((2, 100_003), (3, 50_001)):
        exact = np.mean([_values(r, numel).astype(np.float64) for r in range(3)], 0)
        means = [item[which] for item in got]
        assert all(np.array_equal(m, means[0]) for m in means)
        np.testing.assert_allclose(means[0], exact, atol=1e-6, rtol=0)
    assert all(item[1] for item in got)


def test_on_the_gpu_a_mean_that_is_not_finite_stops_every_rank() -> None:
    key = uuid.uuid4().hex
    groups = [SharedAllReduce(r, 3, 50, key, piece=16) for r in range(3)]
    xs = [torch.from_numpy(_values(r, 50)).cuda() for r in range(3)]
    xs[1][37] = float("nan")
    errors = _in_threads(groups, xs)
    assert len(errors) == 3 and all("not finite" in str(e) for e in errors), errors


def test_a_gpu_rank_and_a_host_rank_are_refused_naming_both() -> None:
    key = uuid.uuid4().hex
    groups = [SharedAllReduce(r, 2, 10, key, timeout=5.0) for r in range(2)]
    errors = _in_threads(groups, [torch.from_numpy(_values(0, 10)).cuda(), _values(1, 10)])
    messages = [str(e) for e in errors]
    assert any("(2, 10, 10, 120, 1)" in m and "(2, 10, 10, 120, 0)" in m for m in messages)


@pytest.mark.parametrize("spec", ["clip:1", "trimmed:1", "median", "balance:0.5:3"])
def test_a_defence_judges_on_the_gpu_as_on_the_host(spec: str) -> None:
    """Each defence, given a peer's model and five neighbours' (one of them blown up) on
    the GPU, returns the host's model, distances, shares set aside and evidence, and
    leaves the model on the GPU."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(10_007, generator=g)
    neighbours = x + 0.1 * torch.randn(5, 10_007, generator=g)
    neighbours[2] *= 1e3
    weights = torch.full((5,), 1 / 6, dtype=torch.float64)
    defence = parse_defence(spec)
    assert defence is not None
    host = defence.judge(x, neighbours, weights, 1 / 6)
    gpu = defence.judge(x.cuda(), neighbours.cuda(), weights.cuda(), 1 / 6)
    assert gpu.model.is_cuda
    assert host.aside[2] > 0.5 and host.evidence[2] > 0  # the bad one is set aside
    for got, want in zip(gpu, host, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_real_gpu_peers_with_clipping_shrug_off_a_byzantine_peer_process(tmp_path: Path) -> None:
    """test_robust's four real peer processes, one of them Byzantine, with clipping, on the
    GPU: the honest three train, name the liar, and every peer ran on a GPU."""
    check_clipping_shrugs_off_a_byzantine_peer_process(tmp_path, device="auto")
