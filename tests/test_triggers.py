"""When peers talk: periodic and dynamic triggers, gossip learning, stragglers and drift."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gossipdl_cmd, in_threads, small_config
from test_peer_api import make_swarm

from gossipdl import Peer
from gossipdl.averaging import TriggerError, age_weighted_merge, parse_trigger
from gossipdl.conditions import Drift, parse_drift, parse_slowdown
from gossipdl.config import ConfigError
from gossipdl.data import evaluation_inputs
from gossipdl.experiments.simulated import simulate
from gossipdl.peers.runner import _loop
from gossipdl.protocol.mailbox import Mailbox
from gossipdl.rundir import RunDir
from gossipdl.training import dataset_of, evaluation, initial_model, make_optimizer

# ----------------------------------------------------------------- pure parts


def test_trigger_specs_parse_into_round_lengths_and_thresholds() -> None:
    assert parse_trigger("always").period == 1 and not parse_trigger("always").dynamic
    assert parse_trigger("periodic:7").period == 7
    dynamic = parse_trigger("dynamic:0.25")
    assert (dynamic.period, dynamic.delta, dynamic.relative) == (10, 0.25, False)
    relative = parse_trigger("dynamic:2%:4")
    assert (relative.period, relative.delta, relative.relative) == (4, 0.02, True)
    for bad in ["sometimes", "periodic", "periodic:0", "periodic:2.5", "dynamic:-1", "dynamic:x",
                "dynamic:1:0", "always:3"]:  # fmt: skip
        with pytest.raises(TriggerError, match="periodic:H"):
            parse_trigger(bad)


def test_periodic_rounds_end_on_exactly_every_hth_step() -> None:
    trigger = parse_trigger("periodic:5")
    assert [s for s in range(1, 31) if trigger.ends_round(s)] == [5, 10, 15, 20, 25, 30]


def test_dynamic_condition_is_the_squared_distance_to_the_reference() -> None:
    reference = torch.zeros(4)
    absolute = parse_trigger("dynamic:1.0")
    assert not absolute.violated(torch.tensor([0.5, 0.5, 0.5, 0.5]), reference)  # ‖·‖² = 1.0
    assert absolute.violated(torch.tensor([0.5, 0.5, 0.5, 0.51]), reference)
    relative = parse_trigger("dynamic:1%")  # Δ = 0.01 ‖r‖² = 0.04 for r = (1, 1, 1, 1)
    reference = torch.ones(4)
    assert not relative.violated(reference + 0.09, reference)  # 4 · 0.0081 < 0.04
    assert relative.violated(reference + 0.11, reference)  # 4 · 0.0121 > 0.04


def test_age_weighted_merge_weights_each_model_by_its_age() -> None:
    x, other = torch.tensor([1.0, -2.0, 10.0]), torch.tensor([5.0, 2.0, 0.0])
    merged, age = age_weighted_merge(x, 30, other, 10)
    assert age == 30
    expected = (30 * x.double() + 10 * other.double()) / 40
    assert torch.allclose(merged.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(age_weighted_merge(x, 0, other, 0)[0], (x + other) / 2)
    assert torch.equal(age_weighted_merge(x, 5, other, 0)[0], x)


def test_condition_specs_are_checked() -> None:
    assert parse_slowdown("3:4, 0:1.5") == {3: 4.0, 0: 1.5}
    assert parse_drift("750:permute:0.5") == Drift(750, 0.5)
    drift = Drift(10, 0.5)
    assert [p for p in range(8) if drift.affects(p, 8)] == [0, 1, 2, 3]
    perm = Drift.permutation(10, seed=0)
    assert sorted(perm) == list(range(10)) and all(perm != range(10))
    bad_specs = [("slowdown", "3"), ("slowdown", "x:2"), ("slowdown", "1:0.5")]
    bad_specs += [("drift", "10"), ("drift", "10:shuffle"), ("drift", "10:permute:2")]
    for field, bad in bad_specs:
        with pytest.raises(ConfigError, match=field):
            small_config(Path("."), **{field: bad})


def test_config_refuses_combinations_that_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"broadcast.*cannot"):
        small_config(Path("."), algorithm="broadcast", topology="complete", trigger="dynamic:1")
    with pytest.raises(ConfigError, match=r"gossip-learning.*zeros"):
        small_config(Path("."), algorithm="gossip-learning", codec="topk:0.01")
    with pytest.raises(ConfigError, match="trigger"):
        small_config(Path("."), algorithm="gossip-learning", trigger="dynamic:1")


def test_the_mailbox_keeps_an_update_that_comes_after_its_round_stopped_waiting() -> None:
    box = Mailbox(keep_late=True)
    assert not box.complete(0, {1, 2}) and box.take(0) == {}  # the round gave up waiting
    box.put(1, 0, "q1")  # round 0 is still open, but nobody waits for it any more
    box.advance(1)
    assert box.drain_late() == [(1, 0, "q1")]
    box.put(2, 1, "q2")
    assert box.complete(1, {2}) and box.take(1) == {2: "q2"}
    box.advance(2)
    assert box.drain_late() == []  # what was handed out is not handed out twice
    box.sent(3, 2)  # peer 3 says it sent round 2: what did not come was lost
    assert box.complete(2, {3})


# ----------------------------------------------------------------- peers in this process


def step_all(peers: list[Peer], steps: int, each: object = None) -> dict[int, list[int]]:
    """``steps`` calls of ``peer.step()`` on every peer at once; model messages after each."""
    sent: dict[int, list[int]] = {p.id: [] for p in peers}

    def work(peer: Peer) -> None:
        for _ in range(steps):
            peer.step()
            sent[peer.id].append(peer.model_messages_sent)

    errors = in_threads(work, peers)
    assert not errors, errors
    return sent


def values(peer: Peer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in peer.params])


def test_periodic_peers_send_on_exactly_every_hth_step_and_average_there() -> None:
    peers = make_swarm(3, "ring", [0.0, 3.0, 6.0], trigger="periodic:4")
    try:
        sent = step_all(peers, 12)
        for peer in peers:
            # Two neighbours each at steps 4, 8 and 12; nothing in between.
            assert sent[peer.id] == [0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6]
            assert (peer.steps, peer.round) == (12, 3)
            assert torch.allclose(values(peer), torch.full_like(values(peer), 3.0))
    finally:
        for peer in peers:
            peer.close()


def test_dynamic_peers_send_no_model_while_the_condition_holds_and_sync_when_it_breaks() -> None:
    peers = make_swarm(5, "ring", [1.0] * 5, trigger="dynamic:0.5:1")
    by_id = {p.id: p for p in peers}
    try:
        sent = step_all(peers, 5)
        assert all(counts == [0] * 5 for counts in sent.values())
        assert all(p.syncs == 0 for p in peers)

        with torch.no_grad():  # peer 0 drifts: ‖Δ‖² = 8 parameters · 1² = 8 > 0.5
            for p in by_id[0].params:
                p.add_(1.0)
        sent = step_all(peers, 4)
        # Peer 0's alarm needs 2 rounds to reach peers 2 and 3 (the ring's diameter), so the
        # whole swarm syncs 2 rounds after the violation, every peer with both neighbours.
        assert all(counts == [0, 0, 2, 2] for counts in sent.values())
        after = {i: 4 / 3 if i in (0, 1, 4) else 1.0 for i in by_id}  # Metropolis weights 1/3
        for peer in peers:
            assert torch.allclose(values(peer), torch.full_like(values(peer), after[peer.id]))
            assert peer.syncs == 1  # and the reference moved to the result: quiet again
    finally:
        for peer in peers:
            peer.close()


def test_a_sync_asked_for_at_a_step_is_held_by_the_whole_swarm() -> None:
    peers = make_swarm(3, "complete", [0.0, 3.0, 6.0], trigger="dynamic:1000:2")
    try:
        for peer in peers:
            peer.sync_at_step(4)  # as the runner does with the last step
        sent = step_all(peers, 6)
        assert all(counts == [0, 0, 0, 2, 2, 2] for counts in sent.values())
        for peer in peers:  # a complete graph's sync is the exact average
            assert torch.allclose(values(peer), torch.full_like(values(peer), 3.0))
    finally:
        for peer in peers:
            peer.close()


# ----------------------------------------------------------------- whole swarms
# Protocol behaviour of whole swarms runs on the simulator: the same protocol core, wire
# encoder and codecs as real peers, on virtual time, deterministic for a seed. The real
# processes (the CLI, a peer's slowdown and drift) are the last test.


@pytest.mark.parametrize(
    ("algorithm", "extra"),
    [
        ("dense", {}),
        ("choco", {"codec": "topk:0.1"}),
        ("broadcast", {"codec": "threshold:auto:0.1+sign", "topology": "complete"}),
        ("gossip-learning", {}),
    ],
)
def test_a_4x_slower_peer_finishes_and_the_others_idle_time_is_recorded(
    tmp_path: Path, algorithm: str, extra: dict[str, str]
) -> None:
    steps, step_time = 40, 0.01
    config = small_config(
        tmp_path, peers=3, steps=steps, algorithm=algorithm, slowdown="2:4", **extra
    )  # fmt: skip
    summary = simulate(config, step_time=step_time)
    assert summary["peers_finished"] == 3
    assert summary["config"]["slowdown"] == "2:4"
    assert summary["config"]["algorithm"] == algorithm
    idle = {p["id"]: p["idle_s"] for p in summary["peers"]}
    if algorithm == "gossip-learning":
        assert all(v == 0 for v in idle.values())  # nobody ever waits
        walks = {p["id"]: p["messages_sent"] for p in summary["peers"]}
        # One walk per step, while a neighbour is left to walk to (the fast ones finish first).
        assert walks[0] == walks[1] == steps and 0 < walks[2] < steps
    else:
        # The fast peers wait out the straggler's extra 3 step times every step; it never
        # waits for them.
        assert idle[0] == idle[1] == pytest.approx(steps * 3 * step_time)
        assert idle[2] == 0
    assert summary["simulated_time_s"] == pytest.approx(steps * 4 * step_time, abs=0.05)
    assert summary["mean_accuracy"] > 0.5


def test_dynamic_swarm_trains_with_fewer_transmissions_than_always(tmp_path: Path) -> None:
    common = dict(peers=3, steps=60, codec="topk:0.1")
    always = simulate(small_config(tmp_path / "a", **common), step_time=0.01)
    dynamic = simulate(
        small_config(tmp_path / "d", trigger="dynamic:0.05:1", **common), step_time=0.01
    )
    assert dynamic["config"]["trigger"] == "dynamic:0.05:1"
    assert dynamic["peers_finished"] == 3
    assert dynamic["total_messages_sent"] < 0.8 * always["total_messages_sent"]
    assert sum(p["syncs"] for p in dynamic["peers"]) > 0
    assert dynamic["mean_accuracy"] > 0.8


def test_drift_permutes_labels_mid_run(tmp_path: Path) -> None:
    config = small_config(tmp_path, peers=2, steps=40, drift="20:permute", log_every=5)
    simulate(config, step_time=0.01)
    run = RunDir(config.out)
    for peer_id in (0, 1):
        loss = {r["step"]: r["loss"] for r in run.records(peer_id) if r.get("loss")}
        assert loss[25] > 3 * loss[20]  # the learnt mapping is suddenly wrong


def test_a_real_life_that_starts_past_the_drift_step_is_first_evaluated_on_drifted_labels(
    tmp_path: Path,
) -> None:
    """A peer resumed (or let in late) past the drift step wrote its first line's accuracy
    on the old labels, the drift applied only at its first step (a review's bogus point)."""
    config = small_config(tmp_path, peers=2, steps=400, drift="100:permute")
    run = RunDir(config.out).create()
    dataset = dataset_of(config)
    model = initial_model(config, dataset)
    peer = Peer(model, make_optimizer(config, model), rank=0, listen="tcp://127.0.0.1:0",
                min_peers=1, resume_step=250)  # fmt: skip
    stop = threading.Event()
    stop.set()  # the life's first line and its final one, no step between
    try:
        with contextlib.ExitStack() as held:
            _loop(config, run, peer, dataset, torch.device("cpu"), stop, held, resumed=True)
    finally:
        peer.close()
    first = next(run.records(0))
    x, y = evaluation_inputs(dataset, torch.device("cpu")), torch.as_tensor(dataset.y_test)
    new_label = torch.as_tensor(Drift.permutation(dataset.num_classes, config.seed))
    drifted, old = (evaluation(model, x, labels)["accuracy"] for labels in (new_label[y], y))
    assert first["start"] and first["step"] == 250 and drifted != old
    assert first["accuracy"] == drifted


def test_a_simulated_restart_past_the_drift_step_is_first_evaluated_on_drifted_labels(
    tmp_path: Path,
) -> None:
    """The simulator's restart as the real runner's resume: the restarted life's first line
    scores its checkpoint's model about as its first life did at that step (it scored it on
    the old labels: 0.62 against 0.20)."""
    faults = [{"at": "1s", "kill": "2"}, {"at": "3s", "restart": "2"}]
    config = small_config(tmp_path, peers=6, steps=60, heartbeat=0.25, dead_after=1.0,
                          round_timeout=0.5, faults=faults, checkpoint_every=10, eval_every=10,
                          drift="5:permute")  # fmt: skip
    simulate(config, step_time=0.05)
    scored = [r for r in RunDir(config.out).records(2) if "accuracy" in r]
    back = next(r for r in scored if r.get("resumed"))
    before = next(r for r in scored if r["step"] == back["step"] and not r.get("start"))
    assert back["step"] >= 10 and abs(back["accuracy"] - before["accuracy"]) < 0.05


def test_cli_runs_each_new_option_and_records_it_in_the_summary(tmp_path: Path) -> None:
    """Real peer processes: the options reach them and the summary; half the swarm (peer 0)
    drifts and says so in its log, the other does not."""
    out = tmp_path / "run"
    args = ["--trigger", "periodic:2", "--slowdown", "1:2", "--drift", "20:permute:0.5"]
    done = subprocess.run(
        gossipdl_cmd("run", "--peers", "2", "--dataset", "synthetic", "--model", "logistic",
                     "--steps", "30", "--threads", "1", "--out", str(out), "--no-progress",
                     *args),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers_finished"] == 2
    for flag, value in zip(args[::2], args[1::2], strict=True):
        assert summary["config"][flag.removeprefix("--")] == value
    assert summary["total_messages_sent"] == sum(p["messages_sent"] for p in summary["peers"])
    run = RunDir(out)
    assert "labels permuted at step 20" in run.log(0).read_text()
    assert "labels permuted" not in run.log(1).read_text()
    assert "2x slower" in run.log(1).read_text() and "slower" not in run.log(0).read_text()


def test_a_period_longer_than_the_run_is_a_caution_before_it_starts() -> None:
    """``periodic:100`` over 5 steps never talks: valid, but the run sends nothing (a
    review found it silent, "sent 0 B"), so it is said before the peers start."""
    from gossipdl.config import cautions, load_config

    (said,) = cautions(load_config(None, trigger="periodic:100", steps=5))
    assert "trigger = 'periodic:100' with steps = 5" in said and "never comes" in said
    assert cautions(load_config(None, trigger="periodic:4", steps=5)) == []
    assert cautions(load_config(None, steps=5)) == []
    (said,) = cautions(load_config(None, trigger="dynamic:0.1:50", steps=30))
    assert "never comes" in said  # a dynamic trigger's period too (it was silent)
    # a dynamic trigger promises an agreed end: not when steps stop past the last sync
    (said,) = cautions(load_config(None, trigger="dynamic:0.1:10", steps=25))
    assert "last 5 steps are trained alone" in said and "multiple of 10" in said
    assert cautions(load_config(None, trigger="dynamic:0.1:10", steps=30)) == []


@pytest.mark.parametrize("mode", ["ring", "ps:sync", "ps:async", "ps:fedavg", "single"])
def test_a_period_longer_than_the_run_is_a_caution_in_every_mode_that_follows_it(
    mode: str,
) -> None:
    """The ring and the parameter server's sync and async workers average every period
    steps too, and sent nothing with a period past the run, with no warning (only gossip
    had one). FedAvg's rounds go by local_epochs and a single process talks to nobody."""
    from gossipdl.config import cautions, load_config

    name, _, rule = mode.partition(":")
    config = load_config(None, mode=name, ps=rule or "sync", trigger="periodic:50", steps=20)
    said = cautions(config)
    if mode in ("ps:fedavg", "single"):
        assert said == []
    else:
        (text,) = said
        assert "trigger = 'periodic:50' with steps = 20" in text and "never comes" in text
        assert ("workers" if name == "ps" else "peers") + " train alone" in text
    assert cautions(config.replace(steps=50)) == []


def test_simulated_gossip_learning_ages_its_models_as_real_peers_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walking model is a step older after each local step, and merges weigh two models by
    their ages. The simulator never aged them: every walk went with age 0, and every merge
    was an even mean, where a real peer's (:meth:`Peer.step`) weighs the older more."""
    from gossipdl.protocol.core import WALK_AGE, GossipCore

    ages: list[int] = []
    send = GossipCore.send

    def spy(self: GossipCore, to: int, kind: str, t: int | None, *rest: Any) -> Any:
        if kind == "walk":
            ages.append(rest[1][WALK_AGE])
        return send(self, to, kind, t, *rest)

    monkeypatch.setattr(GossipCore, "send", spy)
    steps = 30
    config = small_config(tmp_path, peers=3, steps=steps, algorithm="gossip-learning")
    assert simulate(config, step_time=0.01)["peers_finished"] == 3
    assert len(ages) >= 2 * steps and ages[:3] == [1, 1, 1]  # each after its first step
    assert max(ages) >= steps  # a merge keeps the older age, and steps add to it
