"""The parameter server as state machines (shard and worker), and mode ps on the simulated
engine: the real run's bytes and accuracy, every rule, dead workers, determinism."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_files, small_config

from gossipdl.config import Config
from gossipdl.experiments.launcher import launch
from gossipdl.experiments.simulated import simulate
from gossipdl.protocol.ps_server import ShardServer
from gossipdl.protocol.ps_worker import WorkerCore, WorkerSettings
from gossipdl.protocol.ring import chunk_bounds
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import SimulationError, simulation_for
from gossipdl.sim.ps import PsSimulation
from gossipdl.training import last_steps
from gossipdl.transport.wire import Message, WireError, decode


def _wire(frames: list[Any]) -> Message:
    """What the receiver decodes: the bytes as they were when sent."""
    return decode([bytes(memoryview(f)) for f in frames], 1 << 20)


# ----------------------------------------------------------------- the state machines
def test_two_workers_and_two_shards_average_their_updates_with_no_io() -> None:
    """Events in, actions out: each worker's push reaches its shards, each shard closes the
    round once both are in, and both workers adopt the mean, slice by slice."""
    start = torch.zeros(5)
    shards = [ShardServer(start[a:b], rule="sync", workers=2, shard=k)
              for k, (a, b) in enumerate(chunk_bounds(5, 2))]  # fmt: skip
    workers = [
        WorkerCore(i, 2, start, WorkerSettings(), address=f"tcp://10.0.0.{i}:1") for i in (0, 1)
    ]
    for worker, value in zip(workers, (1.0, 3.0), strict=True):
        assert worker.step(0.0)  # period 1: every step pushes
        for send in worker.push(0.0, torch.full((5,), value)):
            shards[send.to].handle(_wire(send.frames), 0.0)
    assert all(w.waiting == "push" and not w.complete for w in workers)
    for shard in shards:
        shard.tick(0.1)
        for address, frames in shard.outbox:
            workers[int(address[13])].receive(_wire(frames))  # tcp://10.0.0.I:1
    for worker in workers:
        assert worker.complete
        adopted = worker.adopt(0.5)
        assert torch.equal(adopted.model, torch.full((5,), 2.0)) and not adopted.sends
        assert worker.waiting is None and worker.round == 1 and worker.idle_s == 0.5
    with pytest.raises(WireError) as bad:
        workers[0].receive(Message("shard", -1, 0, 0, meta={"shard": 7}))
    assert bad.value.reason == "bad_meta"
    slice_ = np.zeros(3, np.float32)  # shard 0's, well formed but for one meta value
    for meta in ({"round": "1"}, {"staleness": -1}, {"lead": 1.5}, {"done": "yes"}):
        with pytest.raises(WireError, match="shard 0's") as bad:
            workers[0].receive(
                Message("shard", -1, 0, 0, arrays=[slice_], meta={"shard": 0, **meta})
            )
        assert bad.value.reason == "bad_meta" and not workers[0].replies


def test_a_fedavg_worker_sits_out_the_rounds_that_do_not_pick_it() -> None:
    """Its steps go on by the round's local steps while it pulls the next round."""

    def answer(round: int, picked: bool) -> Message:
        meta = {"shard": 0, "round": round, "version": round, "picked": picked, "done": False}
        return Message("shard", -1, 0, round, arrays=[torch.ones(2).numpy()], meta=meta)

    worker = WorkerCore(0, 1, torch.zeros(2), WorkerSettings(rule="fedavg", local_steps=4))
    (pull,) = worker.start(0.0)
    assert pull.kind == "pull" and worker.waiting == "pull"
    worker.receive(answer(0, picked=False))
    adopted = worker.adopt(1.0)
    assert [s.kind for s in adopted.sends] == ["pull"] and not adopted.fresh_round
    assert worker.steps == 4 and worker.waiting == "pull"
    worker.receive(answer(1, picked=True))
    adopted = worker.adopt(2.0)
    assert adopted.fresh_round and worker.waiting is None and worker.steps == 4


@pytest.mark.parametrize("rule", ["sync", "async"])
def test_a_worker_takes_only_answers_to_its_open_wait(rule: str) -> None:
    """A copy of an answer (the network delivered it twice, or late) sat in the replies and
    completed the worker's next wait with the model of the round before."""
    worker = WorkerCore(0, 1, torch.zeros(2), WorkerSettings(rule=rule))

    def answer(round: int) -> Message:
        meta = {"shard": 0, "version": round, **({"round": round} if rule == "sync" else {})}
        return Message("shard", -1, 0, round, arrays=[np.full(2, round, np.float32)], meta=meta)

    for round in (1, 2):
        assert worker.step(0.0)
        worker.push(0.0, torch.ones(2))
        stale = "older than the last" if rule == "async" else "waits for round 2"
        if round == 2:  # the copy of round 1's answer comes while round 2's push waits
            with pytest.raises(WireError, match=stale):
                worker.receive(answer(0 if rule == "async" else 1))
        worker.receive(answer(round))
        assert torch.equal(worker.adopt(0.1).model, torch.full((2,), float(round)))
        with pytest.raises(WireError, match="no wait is open"):
            worker.receive(answer(round))


# ----------------------------------------------------------------- the simulated engine
def ps_run(tmp_path: Path, out: str, **changes: Any) -> Config:
    return small_config(tmp_path, mode="ps", out=str(tmp_path / out), **changes)


def _lines(run: Path, peer: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "peers" / f"{peer}.jsonl").read_text().splitlines()]


def test_bytes_and_accuracy_match_a_real_sharded_sync_run(tmp_path: Path) -> None:
    """Real processes (two shard servers, two workers) against the simulator: the same
    accuracy, the same pushes and answers byte for byte, the same lines. The one real ps run
    of this file: it also holds the run directory's contract (peers.json lists the workers
    at their real addresses, as in the other modes)."""
    config = ps_run(tmp_path, "run", ps="sync", ps_shards=2, peers=2, steps=40, log_every=20)
    real = launch(config.replace(out=str(tmp_path / "real")), progress=False)
    sim = simulate(config.replace(out=str(tmp_path / "sim")), step_time=0.01)
    assert real["peers_finished"] == sim["peers_finished"] == 2
    assert abs(sim["mean_accuracy"] - real["mean_accuracy"]) <= 0.01
    ratio = sim["total_bytes_sent"] / real["total_bytes_sent"]
    assert 0.97 < ratio <= 1.0, ratio  # the real run adds heartbeats

    def payload(run: str) -> int:
        finals = [_lines(tmp_path / run, i)[-1] for i in range(2)]
        return sum(f["bytes_sent"] - f["header_bytes_sent"] for f in finals)

    assert payload("sim") == payload("real")
    assert len(real["servers"]) == len(sim["servers"]) == 2
    for shard_real, shard_sim in zip(real["servers"], sim["servers"], strict=True):
        assert shard_sim.keys() == shard_real.keys()
        assert shard_sim["updates"] == shard_real["updates"] == 41  # 40 rounds, then the empty one
    real_lines, sim_lines = _lines(tmp_path / "real", 0), _lines(tmp_path / "sim", 0)
    real_keys = [[k for k in r if k != "pid"] for r in real_lines]  # a process: real only
    assert [list(r) for r in sim_lines] == real_keys  # the same keys
    assert [r["step"] for r in sim_lines] == [r["step"] for r in real_lines]
    members = json.loads((tmp_path / "real" / "peers.json").read_text())
    assert [m["id"] for m in members] == [0, 1]
    assert all(m["address"].startswith("tcp://127.0.0.1:") for m in members)


@pytest.mark.parametrize(
    ("rule", "changes"),
    [("async", {"staleness": "ssp:1", "slowdown": "2:3"}), ("async", {"staleness": "soft:2"}),
     ("fedavg", {"fraction": 0.5, "steps": 100})],
)  # fmt: skip
def test_async_and_fedavg_run_to_the_end(
    rule: str, changes: dict[str, Any], tmp_path: Path
) -> None:
    config = ps_run(tmp_path, "run", ps=rule, eval_every=20, **changes)
    run = RunDir(config.out).create()
    simulation = simulation_for("ps")(config, run, step_time=0.01)
    assert isinstance(simulation, PsSimulation)
    simulation.run()
    (shard,) = simulation.shards
    stats = json.loads(run.server_stats(0).read_text())
    assert stats["dead_workers"] == [] and stats["bytes_sent"] > 0
    finals = [_lines(run.root, i)[-1] for i in range(3)]
    assert all(f["final"] and not f["stopped_early"] and f["accuracy"] > 0.6 for f in finals)
    if rule == "async":
        assert stats["updates"] == 3 * config.steps  # every push applied
        assert all("staleness_mean" in f and "max_lead" in f for f in finals)
        if config.staleness == "ssp:1":  # the slow worker holds the others back
            assert 0 < stats["max_lead"] <= 1 and stats["staleness_max"] >= 1
    else:
        assert stats["round"] == shard.server.rounds  # every round was run
        picked = sum(f["model_messages_sent"] for f in finals)
        assert picked == shard.server.rounds * 2  # half of three workers: two a round
        assert all(f["step"] >= config.steps for f in finals)
        # the live display's step targets (its rounds' local steps, picked or not)
        assert {i: f["step"] for i, f in enumerate(finals)} == last_steps(config)


@pytest.mark.parametrize("rule", ["sync", "fedavg", "async"])
def test_a_killed_worker_is_declared_dead_and_the_others_finish(
    rule: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kill worker 1 at 1 s: the shard declares it dead after round_timeout, the rounds
    (sync, fedavg) go on without it, and the others finish every step. (The real launcher's
    async run with a worker killed by SIGKILL is in test_ps.)"""
    config = ps_run(tmp_path, "run", ps=rule, steps=300, round_timeout=3.0,
                    faults=[{"at": "1s", "kill": "1"}])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        summary = simulate(config, step_time=0.01)
    assert "worker 1 silent for 3s" in caplog.text
    assert summary["servers"][0]["dead_workers"] == [1] and "failed" not in summary
    assert {p["id"] for p in summary["peers"] if p["finished"]} == {0, 2}
    for i in (0, 2):
        last = _lines(Path(config.out), i)[-1]
        assert last["final"] and not last["stopped_early"] and last["step"] >= 300
    if rule == "sync":  # each round waits for the dead worker until it is declared dead
        assert 3.0 + 3.0 <= summary["simulated_time_s"] < 3.0 + 3.3  # 300 steps and the wait
    killed = _lines(Path(config.out), 1)[-1]
    assert killed["step"] < 110 and not killed.get("final")


def test_ssp_holds_every_worker_within_its_slack_of_a_straggler(tmp_path: Path) -> None:
    """A straggler 300x slower: under SSP with slack 1 no worker is answered more than 1 step
    ahead of the slowest; every update's staleness is recorded by workers and the shard.
    Without the bound the fast workers run ahead of the straggler."""
    config = ps_run(tmp_path, "ssp", ps="async", staleness="ssp:1", steps=30, slowdown="1:300")
    summary = simulate(config, step_time=0.01)
    assert summary["peers_finished"] == 3
    (shard,) = summary["servers"]
    assert shard["updates"] == 3 * 30
    assert 0 < shard["max_lead"] <= 1  # the bound was reached, never passed
    assert shard["staleness_max"] >= 1
    for peer in range(3):
        last = _lines(Path(config.out), peer)[-1]
        assert last["final"] and last["max_lead"] <= 1
        assert "staleness_mean" in last and "staleness_max" in last
    free = simulate(config.replace(staleness="none", out=str(tmp_path / "free")), step_time=0.01)
    assert free["peers_finished"] == 3 and free["servers"][0]["max_lead"] > 1


def test_sharded_async_with_a_sparse_codec_trains_on_fewer_bytes(tmp_path: Path) -> None:
    """Two shards, async: top-10% pushes shrink the workers' bytes threefold (the shards'
    answers stay dense) and the model still learns."""
    base = ps_run(tmp_path, "dense", ps="async", steps=80, ps_shards=2)
    dense = simulate(base, step_time=0.01)
    sparse = simulate(base.replace(codec="topk:0.1", out=str(tmp_path / "sparse")), step_time=0.01)
    assert len(sparse["servers"]) == 2 and sparse["peers_finished"] == 3
    assert sparse["mean_accuracy"] > 0.6
    worker_bytes = {
        name: sum(p["bytes_sent"] for p in run["peers"])
        for name, run in [("d", dense), ("s", sparse)]
    }
    assert worker_bytes["s"] < worker_bytes["d"] / 3  # pushes shrink; answers stay dense


def test_workers_cut_off_from_the_shards_stop_naming_them(tmp_path: Path) -> None:
    """A partition leaves the shard on a side of its own: every worker's wait ends at its
    deadline (twice round_timeout under sync) with ServerError's message, and it leaves."""
    config = ps_run(tmp_path, "run", ps="sync", steps=300, round_timeout=2.0,
                    faults=[{"at": "0.5s", "partition": ["0", "1-2"]}])  # fmt: skip
    summary = simulate(config, step_time=0.01)
    assert sorted(summary["failed"]) == ["0", "1", "2"]
    assert summary["failed"]["1"].startswith("worker 1: no answer to its push of round ")
    assert "within 4s from shard 0 at tcp://shard-0.sim:5555" in summary["failed"]["1"]
    assert 0.5 + 4.0 <= summary["simulated_time_s"] < 0.5 + 4.1
    assert summary["peers_finished"] == 0 and summary["servers"][0]["dead_workers"] == [0, 1, 2]


def test_restart_is_refused_in_mode_ps(tmp_path: Path) -> None:
    config = ps_run(tmp_path, "run", faults=[{"at": "1s", "kill": "1"},
                                             {"at": "2s", "restart": "1"}])  # fmt: skip
    with pytest.raises(SimulationError, match="restart is not simulated in mode ps"):
        simulate(config, step_time=0.01)


def test_the_same_ps_config_and_seed_give_byte_identical_run_files(tmp_path: Path) -> None:
    """Edge links with jitter, two shards, a lossy codec with error feedback: twice the same."""
    profile = {"peers": "*", "up": "5mbit", "down": "10mbit", "latency": "10ms",
               "jitter": "3ms", "step_time": "50ms"}  # fmt: skip
    changes: dict[str, Any] = {"ps": "async", "ps_shards": 2, "codec": "topk:0.2", "steps": 40,
                               "eval_every": 10, "profiles": {"edge": profile}}  # fmt: skip
    first = simulate(ps_run(tmp_path, "a", **changes))
    again = simulate(ps_run(tmp_path, "b", **changes))
    assert run_files(tmp_path / "a") == run_files(tmp_path / "b")
    assert first["peers_finished"] == 3 and first["simulated_time_s"] > 40 * 0.05
    for k in range(2):
        assert (tmp_path / "a" / "servers" / f"{k}.json").read_bytes() == (
            tmp_path / "b" / "servers" / f"{k}.json"
        ).read_bytes()
    other = simulate(ps_run(tmp_path, "c", seed=1, **changes))
    assert run_files(tmp_path / "c") != run_files(tmp_path / "a"), "the seed changes nothing"
    assert again["simulated_time_s"] == first["simulated_time_s"] != other["simulated_time_s"]


def test_a_fedavg_worker_first_picked_past_the_drift_starts_on_the_drifted_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker FedAvg first picks after the drift step: the real runner permutes its labels
    before its start line is evaluated; the simulator wrote that line on the old ones."""
    begun: list[tuple[int, bool]] = []  # (steps at its start line, drift still pending)
    record = PsSimulation._record

    def spy(self: PsSimulation, peer: Any, **fields: Any) -> None:
        if fields.get("start"):
            begun.append((peer.steps, peer.drift is not None))
        record(self, peer, **fields)

    monkeypatch.setattr(PsSimulation, "_record", spy)
    config = ps_run(tmp_path, "run", ps="fedavg", fraction=0.25, peers=4, steps=80,
                    drift="12:permute")  # fmt: skip
    simulate(config, step_time=0.01)
    late = [pending for steps, pending in begun if steps >= 12]
    assert late, f"no worker started past the drift step: {begun}"
    assert not any(late), "a start line past the drift step was evaluated on the old labels"
