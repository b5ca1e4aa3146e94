"""Parameter server: sync equals big-batch SGD over real sockets, the shard's and worker's
checks, and the real launcher with a dead async worker or a run ended early.

Staleness and the SSP bound, a killed worker under every rule and the bytes of a sparse
codec are protocol behaviour: test_sim_ps runs the same shard and worker cores on the
simulator."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ForkedRanks, gossipdl_cmd, last_record, peer_pids, small_config, wait_for

from gossipdl.config import ConfigError, load_config
from gossipdl.coordinator import ServerWorker, ShardServer, Staleness, fedavg_pick, serve
from gossipdl.coordinator.ring import chunk_bounds
from gossipdl.experiments.launcher import launch
from gossipdl.transport import Message, WireError

WORKERS, STEPS, BATCH = 3, 12, 8


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _serve_shard(shard: int, shards: int, address: str) -> None:
    torch.set_num_threads(1)
    flat = torch.nn.utils.parameters_to_vector(_model().parameters()).detach()
    a, b = chunk_bounds(flat.numel(), shards)[shard]
    serve(ShardServer(flat[a:b], rule="sync", workers=WORKERS, shard=shard), address)


def _work(rank: int, servers: list[str], results: Any) -> None:
    torch.set_num_threads(1)
    model = _model()
    optimizer = _optimizer(model)
    with ServerWorker(model, optimizer, rank=rank, servers=servers, rule="sync") as worker:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            worker.step()
    results.put((rank, torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()))


def test_ps_sync_every_step_is_sgd_on_the_global_batch(forked_ranks: ForkedRanks) -> None:
    """Averaging parameters after every local SGD step (momentum, weight decay) is linear, so it
    equals one process taking the same steps on all workers' batches at once. Two shards and
    three workers, each its own process over real sockets (threads of one process once gave
    a sync shard a worker too slow to wait for, under the parallel suite)."""
    shards = 2
    servers = [_free_address() for _ in range(shards)]
    for k, address in enumerate(servers):
        forked_ranks.start(_serve_shard, k, shards, address)
    for rank in range(WORKERS):
        forked_ranks.start(_work, rank, servers, forked_ranks.results)
    finals = dict(forked_ranks.get(timeout=180) for _ in range(WORKERS))
    assert forked_ranks.join(60) == [0] * (shards + WORKERS), forked_ranks.report()
    model = _model()
    optimizer = _optimizer(model)
    for step in range(STEPS):
        batches = [_batch(w, step) for w in range(WORKERS)]
        optimizer.zero_grad()
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert not torch.allclose(expected, torch.nn.utils.parameters_to_vector(_model().parameters()))
    for final in finals.values():
        torch.testing.assert_close(torch.from_numpy(final), expected, atol=1e-5, rtol=1e-4)


def test_staleness_rules() -> None:
    assert Staleness("scale").weight(0) == 1.0 and Staleness("scale").weight(5) == 0.2
    assert Staleness("soft", 3).weight(5) == 1.0
    assert Staleness("ssp", 1).holds(3, 1) and not Staleness("ssp", 1).holds(2, 1)
    assert not Staleness("scale").holds(100, 0)
    picks = [fedavg_pick(0, r, 10, 0.3) for r in range(20)]
    assert all(len(p) == 3 for p in picks) and len({tuple(p) for p in picks}) > 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ps": "gossip"}, "ps = 'gossip'; choose one of sync, async, fedavg"),
        ({"staleness": "soft:0"}, "soft sync needs S >= 1"),
        ({"staleness": "late"}, "use none, scale, soft:S"),
        ({"fraction": 0.0}, "fraction = 0.0; must be in"),
        ({"ps_shards": 0}, "ps_shards = 0"),
        ({"trigger": "dynamic:1%"}, "combines every worker's model"),
    ],
)
def test_bad_ps_settings_fail_before_start(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, mode="ps", **change)


def test_a_shard_drops_malformed_pushes_and_keeps_its_model() -> None:
    server = ShardServer(torch.zeros(4), rule="async", workers=2)
    ok = {"address": "tcp://127.0.0.1:1", "clock": 1}

    def push(sender: int = 0, meta: Any = ok, arrays: Any = None, codec: str = "none") -> Message:
        arrays = [torch.ones(4).numpy()] if arrays is None else arrays
        return Message("push", sender, 0, 0, codec, arrays, meta)

    server.handle(push(), 0.0)
    for bad, reason in [
        (push(sender=2), "unknown_sender"),
        (push(meta={"clock": 1}), "bad_address"),
        (push(meta={**ok, "clock": -1}), "bad_meta"),
        (push(arrays=[torch.ones(3).numpy()]), "bad_payload"),
        (push(codec="fp16"), "bad_codec"),
        (Message("params", 0, 0, 0, "none", [], ok), "unexpected"),
        (Message("push", 0, 0, 0, "none", [torch.ones(4).numpy()], ok, key="K" * 40), "wrong_key"),
    ]:
        with pytest.raises(WireError) as err:
            server.handle(bad, 0.0)
        assert err.value.reason == reason
    assert torch.equal(server.x, torch.ones(4))  # only the good push was applied


def test_fedavg_weights_updates_by_sample_count_and_picks_the_same_workers_per_round() -> None:
    server = ShardServer(torch.zeros(2), rule="fedavg", workers=2, rounds=3)
    meta = {"address": "tcp://127.0.0.1:1", "clock": 4}
    for worker in range(2):
        server.handle(Message("pull", worker, 0, 0, "none", [], meta), 0.0)
    server.tick(0.0)
    assert [f.meta["picked"] for f in _replies(server)] == [True, True]
    for worker, (value, samples) in enumerate([(1.0, 1), (5.0, 3)]):
        update = torch.full((2,), value).numpy()
        server.handle(
            Message("push", worker, 0, 0, "none", [update], {**meta, "samples": samples}), 0.0
        )
    server.tick(0.0)
    assert torch.allclose(server.x, torch.full((2,), (1.0 * 1 + 5.0 * 3) / 4))
    assert server.round == 1


def _replies(server: ShardServer) -> list[Message]:
    from gossipdl.transport import decode

    replies = [decode(frames, 1 << 20) for _, frames in server.outbox]
    server.outbox.clear()
    return replies


def test_gossipdl_run_carries_on_when_an_async_worker_dies(tmp_path: Path) -> None:
    """The launcher stops a gossip swarm when a peer dies; an async parameter server drops the
    dead worker instead, and the run ends normally with the other finished (real processes:
    the launcher, the shard and two workers; every rule's dead worker is in test_sim_ps)."""
    out = tmp_path / "run"  # 20 ms a step, idling: the kill lands mid-run on any host
    proc = subprocess.Popen(
        gossipdl_cmd(
            "run", "--mode", "ps", "--ps", "async", "--peers", "2", "--dataset", "synthetic",
            "--model", "logistic", "--steps", "300", "--eval-every", "0", "--threads", "1",
            "--set", 'profiles={paced = {peers = "*", step_time = "20ms"}}',
            "--round-timeout", "3", "--out", str(out),
            "--no-progress",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: (last_record(out / "peers" / "1.jsonl") or {}).get("step", 0) >= 20,
                 60, "worker 1 to train")  # fmt: skip
        os.kill(peer_pids(out)[1], signal.SIGKILL)
        _stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "worker(s) [1] died; the others carried on (1 of 2 finished)" in " ".join(stderr.split())
    summary = json.loads((out / "summary.json").read_text())
    finished = {p["id"] for p in summary["peers"] if p["finished"]}
    assert finished == {0} and 1 in summary["servers"][0]["dead_workers"]


def test_a_sync_run_ended_early_lets_every_worker_finish_its_step_and_report(
    tmp_path: Path,
) -> None:
    """Ending a run (Ctrl-C, or ``until`` as the edge benchmark does) stops the workers before
    the shard: a sync worker finishing its step needs the shard's answer, so a shard stopped
    first left it waiting until it was killed, without its final line."""
    config = small_config(  # 200 ms each way: the stop lands while the workers wait
        tmp_path, mode="ps", ps="sync", peers=2, steps=1_000_000, round_timeout=60.0,
        link="latency=200ms",
    )  # fmt: skip
    reached = lambda run: any(  # noqa: E731
        (last_record(run.metrics(i)) or {}).get("step", 0) >= 2 for i in range(2)
    )
    summary = launch(config, progress=False, until=reached)
    assert len(summary["peers"]) == 2
    for i in range(2):
        last = last_record(Path(config.out) / "peers" / f"{i}.jsonl")
        assert last is not None and last["final"] and last["stopped_early"]


def test_a_fedavg_worker_starts_each_round_with_a_fresh_optimizer_state() -> None:
    """McMahan et al.'s ClientUpdate starts from the global model alone: momentum built up in
    one round must not push the next round's local steps."""
    address = _free_address()
    flat = torch.nn.utils.parameters_to_vector(_model().parameters()).detach()
    server = ShardServer(flat, rule="fedavg", workers=1, rounds=3)
    thread = threading.Thread(target=serve, args=(server, address), daemon=True)
    thread.start()
    model = _model()
    optimizer = _optimizer(model)
    momentum_seen = []
    with ServerWorker(
        model, optimizer, rank=0, servers=[address], rule="fedavg", local_steps=2
    ) as worker:
        for step in range(6):
            x, y = _batch(0, step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            worker.step()
            momentum_seen.append(len(optimizer.state))
    thread.join(30)
    assert not thread.is_alive()
    # After the first local step of a round the buffers exist; a round's last step ends in a
    # new global model, and the state goes with the old one.
    assert momentum_seen == [4, 0, 4, 0, 4, 0]
