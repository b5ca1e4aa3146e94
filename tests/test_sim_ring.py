"""The ring all-reduce as a state machine, and the ring mode on the simulated engine: the
real ring's bytes and accuracy, identical models, PowerSGD, a dead member, determinism."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import restore_logging, run_files, small_config
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl.config import Config
from gossipdl.experiments.launcher import launch, preflight
from gossipdl.experiments.simulated import simulate
from gossipdl.protocol.core import Send
from gossipdl.protocol.ring import WAITING_FOR, RingCore, RingProgress
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import simulation_for
from gossipdl.sim.ring import RingSimulation
from gossipdl.transport.wire import Message, decode


def _wire(send: Send) -> Message:
    """What the receiver decodes: the bytes as they were when sent."""
    return decode([bytes(memoryview(f)) for f in send.frames], 1 << 30, frozenset({"chunk"}))


def _all_reduce(cores: list[RingCore], xs: list[np.ndarray]) -> dict[int, RingProgress]:
    """Start every rank, then deliver every frame at once, polling until all are done."""
    for core, x in zip(cores, xs, strict=True):
        core.start(0.0, x)
    by_id = {core.me: core for core in cores}
    done: dict[int, RingProgress] = {}
    while len(done) < len(cores):
        for core in cores:
            progress = core.poll(0.0)
            for send in progress.sends:
                by_id[send.to].receive(0.0, _wire(send))
            if progress.result is not None:
                done[core.me] = progress
    return done


# ----------------------------------------------------------------- the state machine
@pytest.mark.parametrize(
    ("n", "codec", "piece"), [(2, "none", 3), (3, "fp16", 2), (5, "none", 100)]
)
def test_the_core_reduces_to_the_same_mean_on_every_rank(n: int, codec: str, piece: int) -> None:
    numel = 13  # not divisible by n; pieces smaller than chunks when piece < 13 / n
    ids = [10 * i + 3 for i in range(n)]  # any ids: the ring is their sorted order
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in ids]
    exact = np.mean(xs, axis=0)
    cores = [RingCore(i, ids, numel, codec=codec, piece=piece) for i in ids]
    done = _all_reduce(cores, [x.copy() for x in xs])
    results = [done[i].result for i in ids]
    for result in results:
        assert result is not None and np.array_equal(result, results[0])
        np.testing.assert_allclose(result, exact, atol=5e-3 * n if codec == "fp16" else 1e-6)
    assert all(core.op == 1 and not core.busy and core.deadline is None for core in cores)


def test_each_rank_sends_2_n_minus_1_over_n_of_the_vector_to_its_successor() -> None:
    n, numel = 4, 4000
    cores = [RingCore(i, list(range(n)), numel) for i in range(n)]
    sent: dict[int, int] = {}
    for core in cores:
        core.start(0.0, np.ones(numel, np.float32))
    done = 0
    while done < n:
        for core in cores:
            progress = core.poll(0.0)
            for send in progress.sends:
                assert send.to == core.successor and send.kind == "chunk"
                sent[core.me] = sent.get(core.me, 0) + _wire(send).arrays[0].nbytes
                cores[send.to].receive(0.0, _wire(send))
            done += progress.result is not None
    assert sent == {i: 2 * (n - 1) * numel // n * 4 for i in range(n)}


def test_a_stalled_predecessor_gets_notices_then_a_failure_naming_whom_it_waits_for() -> None:
    """Events in, actions out, no clock: rank 2 of 0..3 waits on rank 1, which said it waits
    for rank 0; rank 2 passes that on every second and fails at its timeout naming rank 0."""
    core = RingCore(2, [0, 1, 2, 3], 8, timeout=3.0)
    core.start(10.0, np.zeros(8, np.float32))
    start = core.poll(10.0)
    assert start.moved and [s.to for s in start.sends] == [3]  # its own chunk, step 0
    assert core.poll(10.5) == RingProgress() and core.deadline == 11.0
    core.receive(10.6, Message("chunk", 1, 0, 0, meta={WAITING_FOR: 0}))
    notice = core.poll(11.0)
    assert not notice.moved and len(notice.sends) == 1
    assert _wire(notice.sends[0]).meta == {WAITING_FOR: 0}
    assert core.deadline == 12.0
    failed = core.poll(13.0)
    assert failed.failure is not None and failed.failure.culprit == 0
    assert "nothing from peer 1 (its predecessor) for 3s at step 0; it is waiting for peer 0" in (
        failed.failure.message
    )
    assert not core.busy and core.poll(14.0).failure == failed.failure


def test_a_predecessor_that_left_fails_the_wait_at_once_with_its_reason() -> None:
    core = RingCore(0, [0, 1], 4, timeout=60.0)
    core.start(0.0, np.zeros(4, np.float32))
    core.poll(0.0)
    core.left(1, "stopped by RingError: peer 1 ...")
    failure = core.poll(0.1).failure
    assert failure is not None and failure.culprit == 1
    assert "peer 1 (its predecessor) left the ring — stopped by RingError" in failure.message


# ----------------------------------------------------------------- the simulated engine
def ring_swarm(tmp_path: Path, out: str, **changes: Any) -> Config:
    return small_config(tmp_path, mode="ring", out=str(tmp_path / out), **changes)


def _finals(run: Path, peers: int) -> list[dict[str, Any]]:
    return [json.loads(run.joinpath("peers", f"{i}.jsonl").read_text().splitlines()[-1])
            for i in range(peers)]  # fmt: skip


@pytest.mark.parametrize(
    ("codec", "trigger"),
    [("none", "always"), ("fp16", "periodic:5"), ("powersgd:1", "always"),
     ("powersgd:1", "periodic:5")],
)  # fmt: skip
def test_a_simulated_ring_ends_with_every_peer_on_the_same_model(
    codec: str, trigger: str, tmp_path: Path
) -> None:
    """Gradients every step, or parameters every 5 steps (PowerSGD: their change)."""
    config = ring_swarm(tmp_path, "run", peers=4, steps=40, codec=codec, trigger=trigger,
                        model="mlp", hidden=(16,))  # fmt: skip
    summary = simulate(config, step_time=0.01)
    assert summary["peers_finished"] == 4 and summary["consensus_distance"] == 0
    models = [torch.load(RunDir(config.out).model(i)) for i in range(4)]
    for model in models[1:]:
        assert all(torch.equal(model[k], models[0][k]) for k in model)
    finals = _finals(Path(config.out), 4)
    rounds = 40 if trigger == "always" else 8
    assert all(f["syncs"] == rounds and f["final"] for f in finals)
    assert summary["mean_accuracy"] > 0.3  # it learned (rank-1 changes of the model: slowly)


@pytest.mark.parametrize(("codec", "width"), [("none", 4), ("fp16", 2)])
def test_bytes_per_peer_per_round_are_2_n_minus_1_over_n_of_the_model(
    codec: str, width: int, tmp_path: Path
) -> None:
    """The real ring's count: each all-reduce sends 2(N-1) messages per peer, together the
    model 2(N-1) times, headers apart."""
    n, steps = 4, 30
    config = ring_swarm(tmp_path, "run", peers=n, steps=steps, codec=codec)
    simulate(config, step_time=0.01)
    numel = preflight(config)
    finals = _finals(Path(config.out), n)
    payloads = [f["bytes_sent"] - f["header_bytes_sent"] for f in finals]
    assert sum(payloads) == steps * 2 * (n - 1) * numel * width  # every chunk, 2(N-1) hops
    per_round = 2 * (n - 1) / n * numel * width
    for final, payload in zip(finals, payloads, strict=True):
        assert abs(payload / steps - per_round) <= 2 * (n - 1) * width  # chunks differ by one
        assert final["messages_sent"] == final["model_messages_sent"] == steps * 2 * (n - 1)
        assert final["header_bytes_sent"] / final["messages_sent"] < 120


def test_bytes_and_accuracy_match_a_real_ring_of_the_same_config(tmp_path: Path) -> None:
    """Real processes against virtual peers: the same chunks (every payload byte), the same
    accuracy to within a point, the same bytes to within a few percent (the real run adds
    start-up and heartbeat messages). The one real ring-mode swarm of the suite, so it also
    holds what only real peers show: gradients every step leave every peer on the same
    model, and the payload is the ring's 2(N-1) float32 models per step."""
    n, steps = 3, 40
    config = small_config(tmp_path, mode="ring", peers=n, steps=steps, log_every=20)
    real = launch(config.replace(out=str(tmp_path / "real")), progress=False)
    sim = simulate(config.replace(out=str(tmp_path / "sim")), step_time=0.01)
    assert real["peers_finished"] == sim["peers_finished"] == n
    assert real["consensus_distance"] == 0
    accuracies = {p["accuracy"] for p in real["peers"]}
    assert len(accuracies) == 1 and accuracies.pop() > 0.5
    assert abs(sim["mean_accuracy"] - real["mean_accuracy"]) <= 0.01
    ratio = sim["total_bytes_sent"] / real["total_bytes_sent"]
    assert 0.97 < ratio <= 1.0, ratio

    def payload(run: str) -> int:
        return sum(f["bytes_sent"] - f["header_bytes_sent"] for f in _finals(tmp_path / run, n))

    # per all-reduce each chunk crosses each of the 2(N-1) steps once: 2(N-1) float32 models
    assert payload("real") == steps * 2 * (n - 1) * 4 * preflight(config)
    assert payload("sim") == payload("real")


def test_powersgd_trains_identical_models_on_fewer_bytes(tmp_path: Path) -> None:
    """Rank-1 PowerSGD over the ring: every peer on the same model, a model that learned,
    and less than half the bytes of the dense ring."""
    config = ring_swarm(tmp_path, "dense", peers=3, steps=60, model="mlp", hidden=(32,))
    dense = simulate(config, step_time=0.01)
    low = simulate(config.replace(codec="powersgd:1", out=str(tmp_path / "low")), step_time=0.01)
    assert low["peers_finished"] == 3 and low["consensus_distance"] == 0
    assert low["mean_accuracy"] > 0.6
    assert low["total_bytes_sent"] < dense["total_bytes_sent"] / 2


def test_a_dead_member_stops_the_simulated_ring_within_its_timeout_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kill one of three for good: the other two stop with an error naming it after
    round_timeout, never hang; the run directory and `gossipdl simulate` say why. (Real
    processes with a silent member, on the wall clock: test_ring.)"""
    config = ring_swarm(tmp_path, "run", peers=3, steps=1000, round_timeout=3.0,
                        faults=[{"at": "0.3s", "kill": "1"}])  # fmt: skip
    summary = simulate(config, step_time=0.01)
    failed = summary["failed"]
    assert sorted(failed) == ["0", "2"]
    assert failed["2"].startswith("peer 2, ring all-reduce")
    assert "nothing from peer 1 (its predecessor)" in failed["2"]
    # peer 0 waits on peer 2, which waits on the dead one: its error still names peer 1
    assert re.search(r"peer 0, ring all-reduce \d+: .*\bpeer 1\b", failed["0"]), failed["0"]
    assert 3.3 <= summary["simulated_time_s"] < 3.3 + 0.1
    assert summary["peers_finished"] == 0
    for i in range(3):
        last = json.loads(RunDir(config.out).metrics(i).read_text().splitlines()[-1])
        assert not last.get("final") and 25 <= last["step"] <= 31
    args = ["simulate", "--mode", "ring", "--peers", "3", "--steps", "1000", "--round-timeout",
            "1", "--set", 'faults=[{at="0.1s", kill="1"}]', "--step-time", "10ms",
            "--out", str(tmp_path / "cli"), "--no-progress"]  # fmt: skip
    restore_logging(monkeypatch)
    done = CliRunner().invoke(cli.app, args)
    assert done.exit_code == 2, done.output  # as `gossipdl run` fails when a ring breaks
    assert "peer 2 stopped: peer 2, ring all-reduce" in " ".join(done.output.split())
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["failed"]


def test_a_peer_killed_by_hand_stops_every_rank_and_every_message_is_accounted_for(
    tmp_path: Path,
) -> None:
    """Peer 0 killed by hand (Simulation.kill): every other rank stops at its timeout, every
    message is accounted for, and no peer is left waiting."""
    config = ring_swarm(tmp_path, "run", peers=4, steps=500, round_timeout=2.0)
    run = RunDir(config.out).create()
    sim = simulation_for("ring")(config, run, step_time=0.01)
    assert isinstance(sim, RingSimulation)
    sim.clock.at(0.2, lambda: sim.kill(0))
    sim.run()
    assert sorted(sim.failures) == [1, 2, 3]
    assert "nothing from peer 0 (its predecessor) for 2s" in sim.failures[1]
    assert "it is waiting for peer 0, which died or stalled" in sim.failures[2]
    # the notices move one hop a second: two hops down, a 2 s timeout may name a rank between
    assert re.search(r"it is waiting for peer [01],", sim.failures[3]), sim.failures[3]
    assert sim.network.balanced() and sim.finished


def test_the_same_ring_config_and_seed_give_byte_identicalrun_files(tmp_path: Path) -> None:
    """Links with bandwidth, latency and jitter, PowerSGD's seeded factors: twice the same."""
    profile = {"peers": "*", "up": "5mbit", "down": "10mbit", "latency": "10ms",
               "jitter": "3ms", "step_time": "50ms"}  # fmt: skip
    changes: dict[str, Any] = {"peers": 4, "steps": 30, "eval_every": 10, "codec": "powersgd:2",
                               "model": "mlp", "hidden": (16,),
                               "profiles": {"edge": profile}}  # fmt: skip
    first = simulate(ring_swarm(tmp_path, "a", **changes))
    again = simulate(ring_swarm(tmp_path, "b", **changes))
    assert run_files(tmp_path / "a") == run_files(tmp_path / "b")
    assert first["peers_finished"] == 4 and first["simulated_time_s"] > 30 * 0.05
    other = simulate(ring_swarm(tmp_path, "c", seed=1, **changes))
    assert run_files(tmp_path / "c") != run_files(tmp_path / "a"), "the seed changes nothing"
    assert again["simulated_time_s"] == first["simulated_time_s"] != other["simulated_time_s"]
