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

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ForkedRanks, gossipdl_cmd, last_record, peer_pids, small_config, wait_for

from gossipdl.config import ConfigError, load_config
from gossipdl.coordinator import ServerWorker, ShardServer, Staleness, fedavg_pick, serve
from gossipdl.coordinator.ring import chunk_bounds
from gossipdl.experiments.launcher import LaunchError, Swarm, launch
from gossipdl.rundir import RunDir
from gossipdl.transport import Message, WireError
from gossipdl.transport.wire import decode

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
    later = {**ok, "clock": 2}  # the next push's step: the same step again is a copy
    for bad, reason in [
        (push(sender=2), "unknown_sender"),
        (push(meta={"clock": 2}), "bad_address"),
        (push(meta={**ok, "clock": -1}), "bad_meta"),
        (push(meta=later, arrays=[torch.ones(3).numpy()]), "bad_payload"),
        (push(meta=later, codec="fp16"), "bad_codec"),
        (push(), "duplicate"),
        (Message("params", 0, 0, 0, "none", [], later), "unexpected"),
        (Message("push", 0, 0, 0, "none", [torch.ones(4).numpy()], later, key="K" * 40),
         "wrong_key"),
    ]:  # fmt: skip
        with pytest.raises(WireError) as err:
            server.handle(bad, 0.0)
        assert err.value.reason == reason
    assert torch.equal(server.x, torch.ones(4))  # only the good push was applied
    assert server.known[0].clock == 1 and server.known[0].address == ok["address"]


def _from(worker: int, kind: str, round: int = 0, value: float | None = None) -> Message:
    meta = {"address": f"tcp://127.0.0.1:{6000 + worker}", "clock": 1}
    arrays = [] if value is None else [np.full(2, value, np.float32)]
    return Message(kind, worker, 0, round, "none", arrays, meta)


def test_a_shard_takes_only_the_pushes_its_round_waits_for() -> None:
    """FedAvg: an update from a worker not picked this round; sync: one from a worker that
    left. Both were folded into the round's mean."""
    fedavg = ShardServer(torch.zeros(2), rule="fedavg", workers=4, fraction=0.5, rounds=5)
    picked = fedavg_pick(0, 0, 4, 0.5)
    outsider = next(w for w in range(4) if w not in picked)
    with pytest.raises(WireError, match="not picked this round"):
        fedavg.handle(_from(outsider, "push", 0, 1000.0), 0.0)
    sync = ShardServer(torch.zeros(2), rule="sync", workers=2)
    sync.handle(_from(1, "leave"), 0.0)
    with pytest.raises(WireError, match="which left"):
        sync.handle(_from(1, "push", 0, 1000.0), 0.0)
    for server, pushers in ((fedavg, picked), (sync, [0])):
        for worker in pushers:
            server.handle(_from(worker, "push", 0, 1.0), 0.0)
        server.tick(0.0)
        assert server.round == 1 and torch.equal(server.x, torch.ones(2))


def test_a_shard_owes_each_worker_one_reply_and_a_refused_message_changes_nothing() -> None:
    """Pulls for rounds the shard never reaches each held a reply owed for good (200,000 of
    them: 20 MB and a 77 ms tick); a message refused as unexpected brought a dead worker
    back and sent its replies elsewhere."""
    server = ShardServer(torch.zeros(2), rule="sync", workers=2, timeout=1.0)
    for r in range(1000):
        server.handle(_from(0, "pull", 10**15 + r), 0.0)
    assert len(server.pending) == 1
    server.handle(_from(1, "alive"), 0.0)
    server.tick(5.0)  # both silent past the timeout: dead
    stranger = Message("params", 1, 0, 0, "none", [], {"address": "tcp://192.0.2.9:9"})
    with pytest.raises(WireError, match="unexpected"):
        server.handle(stranger, 5.1)
    assert not server.known[1].alive and server.known[1].address == "tcp://127.0.0.1:6001"


def _refused(server: ShardServer, msg: Message, now: float = 0.0) -> str:
    """The drop reason of ``msg`` at ``server`` ("" if it was taken); ticks it after."""
    try:
        server.handle(msg, now)
    except WireError as exc:
        return exc.reason
    finally:
        server.tick(now)
    return ""


def test_a_shard_answers_a_named_address_once_until_a_request_echoes_its_ticket() -> None:
    """Without CURVE anyone can claim a worker id: 200 pulls (20 KB) naming a third party's
    address made a shard send that address 200 copies of its slice (763 MiB of a 4 MB
    slice), and a message naming another address took a live worker's answers."""
    victim = {"address": "tcp://192.0.2.66:9", "clock": 0}
    server = ShardServer(torch.zeros(2), rule="sync", workers=2)
    reasons = [_refused(server, Message("pull", 0, 0, 0, "none", [], victim)) for _ in range(200)]
    assert [a for a, _ in server.outbox] == [victim["address"]]  # one answer, not 200
    assert reasons == [""] + ["bad_ticket"] * 199
    ((_, frames),) = server.outbox
    server.outbox.clear()
    ticket = decode([bytes(memoryview(f)) for f in frames], 1 << 20).seq  # its sequence number
    assert ticket == server.known[0].ticket > 0
    echo = Message("pull", 0, ticket, 0, "none", [], victim)
    assert _refused(server, echo) == "" and len(server.outbox) == 1  # whoever receives them
    # a live worker's address is bound: another one is refused, even with its ticket
    server.outbox.clear()
    own = {"address": "tcp://127.0.0.1:6001", "clock": 0}
    assert _refused(server, Message("alive", 1, 0, 0, "none", [], own)) == ""
    for kind in ("alive", "pull", "push", "leave"):
        hijack = Message(kind, 1, 0, 0, "none", [np.ones(2, np.float32)], victim)
        assert _refused(server, hijack) == "bad_address"
    assert server.known[1].address == own["address"] and server.known[1].alive
    assert not server.outbox and torch.equal(server.x, torch.zeros(2))


def test_a_worker_declared_dead_may_come_back_at_a_new_address_and_is_answered_there() -> None:
    """A restarted process (a new life) binds its new address; its old life's ticket is
    not asked of it, and once answered only the new ticket is taken."""
    server = ShardServer(torch.zeros(2), rule="fedavg", workers=2, rounds=3, timeout=1.0)
    first = {"address": "tcp://127.0.0.1:6000", "clock": 0}
    assert _refused(server, Message("pull", 0, 0, 0, "none", [], first)) == ""
    assert len(server.outbox) == 1 and server.known[0].ticket
    server.outbox.clear()
    server.tick(5.0)
    assert not server.known[0].alive  # silent past the timeout
    again = {"address": "tcp://127.0.0.1:7000", "clock": 0}
    assert _refused(server, Message("pull", 0, 0, 0, "none", [], again), 5.0) == ""
    assert [a for a, _ in server.outbox] == [again["address"]] and server.known[0].alive
    assert _refused(server, Message("pull", 0, 0, 0, "none", [], again), 5.0) == "bad_ticket"
    assert _refused(server, Message("pull", 0, 0, 0, "none", [], first), 5.0) == "bad_address"


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


def test_a_server_shard_that_dies_fails_the_run_naming_it_even_where_workers_may_die(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async and FedAvg runs carry on without a dead worker, but no worker goes on without
    its shard: the launcher stops the swarm and names the shard and its log (it returned
    normally, saying the others carried on when none did)."""
    swarms: list[Swarm] = []
    start = Swarm.start
    monkeypatch.setattr(Swarm, "start", lambda self, *a: swarms.append(self) or start(self, *a))
    config = small_config(tmp_path, mode="ps", ps="async", peers=2, steps=1_000_000,
                          round_timeout=3.0)  # fmt: skip

    def kill_the_shard(run: RunDir) -> bool:
        shard = swarms[0].servers[0]
        if (last_record(run.metrics(0)) or {}).get("step", 0) >= 5 and shard.poll() is None:
            shard.kill()
        return False

    with pytest.raises(LaunchError, match=r"server shard 0 exited with code -9; its log .*0"):
        launch(config, progress=False, until=kill_the_shard)


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
