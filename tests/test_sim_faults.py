"""Fault schedules from the config (``[[faults]]``): checked once, run on the simulator's
virtual clock, refused by the real engine."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
from conftest import restore_logging, small_config
from torch.nn.utils import parameters_to_vector
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl.conditions import ConditionError
from gossipdl.config import Config, ConfigError, from_dict, parse_setting, to_toml
from gossipdl.experiments.simulated import simulate
from gossipdl.protocol.joining import RETRY_S
from gossipdl.sim.engine import Simulation, SimulationError
from gossipdl.sim.faults import (
    ClockRate,
    Clog,
    Heal,
    Inject,
    Kill,
    Leave,
    Partition,
    Unclog,
    parse_faults,
)
from gossipdl.sim.network import SimNetwork
from gossipdl.transport.wire import decode


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI sets up logging for the process; give the next tests theirs back."""
    restore_logging(monkeypatch)


def fast_swarm(tmp_path: Path, faults: list[dict[str, Any]], **changes: Any) -> Config:
    """Six peers on a ring that notice a silent neighbour within a second of virtual time."""
    values: dict[str, Any] = {
        "peers": 6,
        "steps": 100,
        "heartbeat": 0.25,
        "dead_after": 1.0,
        "round_timeout": 0.5,
        "faults": faults,
        **changes,
    }
    return small_config(tmp_path, **values)


def lines(run: Path, peer: int) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "peers" / f"{peer}.jsonl").read_text().splitlines()]


@dataclass
class LateStart:
    """One ``Simulation.start_late`` of a peer (the end of its join): whether it was handed
    a model (else it keeps its own), its model before and after, its checkpoint's model."""

    took_model: bool
    before: torch.Tensor
    after: torch.Tensor
    checkpoint: torch.Tensor | None


def spy_late_starts(monkeypatch: pytest.MonkeyPatch, peer_id: int) -> list[LateStart]:
    """Every late start (join, rejoin, restart) of peer ``peer_id`` from now, in order."""
    starts: list[LateStart] = []
    real = Simulation.start_late

    def spy(self: Simulation, peer: Any, start: int, model: Any, swarm_round: Any = None) -> None:
        before = peer.flat().clone()
        checkpoint = None
        if peer.saved is not None:
            saved = copy.deepcopy(self.template)
            saved.load_state_dict(peer.saved[1])
            checkpoint = parameters_to_vector(saved.parameters()).detach()
        real(self, peer, start, model, swarm_round)
        if peer.id == peer_id:
            starts.append(LateStart(model is not None, before, peer.flat().clone(), checkpoint))

    monkeypatch.setattr(Simulation, "start_late", spy)
    return starts


# -- the schedule as the config gives it ----------------------------------------------------


def test_every_action_parses_into_its_event_in_listed_order() -> None:
    faults = parse_faults(
        [
            {"at": "1.5s", "kill": "2-3"},
            {"at": 2, "partition": ["0-1", [4, 5]]},
            {"at": "250ms", "heal": True},
            {"at": "3s", "clog": "0>1"},
            {"at": "4s", "unclog": " 0 > 1 "},
            {"at": "5s", "inject": {"loss": 0.05, "duplicate": "1%", "reorder": "50ms"}},
            {"at": "6s", "inject": {}},
            {"at": "7s", "leave": "6"},
            {"at": "8s", "clock": {"peers": "0-1", "rate": 0.5}},
        ],
        8,
    )
    assert faults == [
        Kill(1.5, (2, 3)),
        Partition(2.0, ((0, 1), (4, 5))),
        Heal(0.25),
        Clog(3.0, 0, 1),
        Unclog(4.0, 0, 1),
        Inject(5.0, 0.05, 0.01, 0.05),
        Inject(6.0, 0.0, 0.0, 0.0),
        Leave(7.0, (6,)),
        ClockRate(8.0, (0, 1), 0.5),
    ]
    assert parse_faults([], 4) == []


@pytest.mark.parametrize(
    ("entry", "needles"),
    [
        ("kill 3", ["faults[0] = 'kill 3'", "at = "]),
        ({"kill": "3"}, ["faults[0]", "has no time", 'at = "30s"']),
        ({"at": "30", "kill": "3"}, ["faults[0] (at 30): at = '30'", '"30s"']),
        ({"at": "1s"}, ["faults[0] (at 1s) names none", "kill"]),
        ({"at": "1s", "kill": "1", "heal": True}, ["names 2 actions (kill, heal)", "one table"]),
        ({"at": "1s", "kil": "1"}, ["unknown key 'kil'", "did you mean 'kill'"]),
        ({"at": "1s", "kill": "7"}, ["faults[0] (at 1s): kill = '7' names peer 7", "peers = 4"]),
        ({"at": "1s", "restart": "1"}, ["faults[0] (at 1s): restart = [1]", "not killed"]),
        ({"at": "1s", "partition": "0-1"}, ["partition = '0-1'", '["0-3", "4-7"]']),
        ({"at": "1s", "partition": ["0-2", "2-3"]}, ["peer 2 in groups 0 and 1"]),
        ({"at": "1s", "partition": ["*"]}, ["splits nothing"]),
        ({"at": "1s", "heal": False}, ["heal = False", "write heal = true"]),
        ({"at": "1s", "clog": "0-1"}, ["clog = '0-1'", '"0>1"']),
        ({"at": "1s", "clog": "1>1"}, ["clog = '1>1'", "two peers"]),
        ({"at": "1s", "unclog": "0>9"}, ["unclog = '0>9' names peer 9"]),
        ({"at": "1s", "inject": 0.1}, ["inject = 0.1", "write a table"]),
        ({"at": "1s", "inject": {"los": 0.1}}, ["inject: unknown key 'los'", "'loss'"]),
        ({"at": "1s", "inject": {"loss": 1.5}}, ["inject.loss = 1.5", "[0, 1)"]),
        ({"at": "1s", "inject": {"reorder": "50"}}, ["inject.reorder = '50'", '"250ms"']),
        ({"at": "1s", "leave": "9"}, ["leave = '9' names peer 9"]),
        ({"at": "1s", "clock": 0.5}, ["clock = 0.5", '{peers = "2", rate = 0.5}']),
        ({"at": "1s", "clock": {"rate": 0.5}}, ["clock = {'rate': 0.5}", "rate = 1 sets"]),
        ({"at": "1s", "clock": {"peers": "1", "rate": 0}}, ["clock.rate = 0", "from 0.1"]),
    ],
)
def test_a_bad_event_names_its_entry_and_the_fix(entry: Any, needles: list[str]) -> None:
    with pytest.raises(ConditionError) as info:
        parse_faults([entry], 4)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_the_entry_named_is_the_bad_one_and_killing_everyone_is_refused() -> None:
    with pytest.raises(ConditionError, match=r"faults\[2\] \(at 3s\)"):
        parse_faults([{"at": 1, "heal": True}, {"at": 2, "heal": True}, {"at": "3s"}], 4)
    with pytest.raises(ConditionError, match="every peer"):
        parse_faults([{"at": 1, "kill": "0-1"}, {"at": 2, "kill": "2-3"}], 4)
    with pytest.raises(ConditionError, match=r"faults\[1\] \(at 1s\): restart = \[1\]"):
        parse_faults([{"at": 2, "kill": "1"}, {"at": 1, "restart": "1"}], 4)  # time, not list
    killed_twice = [{"at": 1, "kill": "0-1"}, {"at": 2, "restart": "0-1"}, {"at": 3, "kill": "2-3"}]
    assert len(parse_faults(killed_twice, 4)) == 3  # 0-1 are back by then
    with pytest.raises(ConditionError, match="list of events"):
        parse_faults({"at": 1, "kill": "0"}, 4)


def test_faults_are_a_config_key_set_in_a_file_or_with_set_and_written_back() -> None:
    faults = [
        {"at": "1s", "partition": ["0-1", "2-3"]},
        {"at": 2.5, "heal": True},
        {"at": "1s", "inject": {"loss": 0.05, "reorder": "50ms"}},
    ]
    config = Config(peers=4, faults=faults, profiles={"p": {"peers": "0", "up": "1mbit"}})
    text = to_toml(config)
    assert '[[faults]]\nat = "1s"\ninject = {loss = 0.05, reorder = "50ms"}' in text
    assert from_dict(tomllib.loads(text)) == config
    key, value = parse_setting('faults=[{at = "30s", kill = "3"}]')
    assert from_dict({key: value}).faults == [{"at": "30s", "kill": "3"}]
    with pytest.raises(ConfigError, match=r"faults\[0\] \(at 1s\): kill = '9' names peer 9"):
        Config(peers=4, faults=[{"at": "1s", "kill": "9"}])
    with pytest.raises(ConfigError, match=r"one \[\[faults\]\] table per event"):
        from_dict({"faults": {"at": "1s", "kill": "3"}})


# -- the schedule on the simulator ------------------------------------------------------


def test_a_partition_splits_the_ring_each_side_carries_on_and_the_heal_merges_them(
    tmp_path: Path,
) -> None:
    """At 1 s the ring 0..5 splits into 0-2 and 3-5: what crosses is dropped as
    ``partition``, each side declares the other dead after ``dead_after`` and goes on in
    a smaller ring. After the heal at 3 s the heartbeats cross again: 0-2 (a tie, and the
    side with the smallest id) answer that 3-5 were dropped, and 3-5 rejoin through them,
    so every peer counts six members again and finishes."""
    faults = [{"at": "1s", "partition": ["0-2", "3-5"]}, {"at": "3s", "heal": True}]
    summary = simulate(fast_swarm(tmp_path, faults), step_time=0.05)
    assert summary["peers_finished"] == 6
    assert summary["network"]["partition"] > 0
    run = tmp_path / "run"
    for peer in range(6):
        before = [x for x in lines(run, peer) if x["time"] <= 1.0]
        assert before[-1]["members"] == 6  # whole until the partition
        split = [x for x in lines(run, peer) if 2.5 <= x["time"] <= 3.0]
        assert split[-1]["members"] == 3 and split[-1]["declared_dead"] == 3  # the other side
        merged = [x for x in lines(run, peer) if 4.0 <= x["time"] <= 5.0]
        assert merged and all(x["members"] == 6 for x in merged)
        last = lines(run, peer)[-1]
        assert last["final"] and last["step"] == 100
        assert last["rejoins"] == (1 if peer >= 3 else 0)  # the outranked side rejoined


def test_a_restarted_peer_resumes_from_its_checkpoint_and_rejoins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed at 1 s, restarted at 3 s (after the others declared it dead): it starts from
    its checkpoint of step 10, keeping that model and that step count (not a neighbour's
    model and the swarm's count, as a newcomer), and rejoins; everyone finishes. The
    checkpoint holds its model after step 10's round, as a real peer saves it (it was taken
    before the round, so a restart lost that round's averaging)."""
    starts = spy_late_starts(monkeypatch, 2)
    stepped: dict[int, torch.Tensor] = {}  # peer 2's model as each step (and its round) ends
    after_round = Simulation._after_round

    def spy(self: Simulation, peer: Any) -> None:
        if peer.id == 2:
            stepped[peer.steps] = peer.flat().clone()
        after_round(self, peer)

    monkeypatch.setattr(Simulation, "_after_round", spy)
    faults = [{"at": "1s", "kill": "2"}, {"at": "3s", "restart": "2"}]
    summary = simulate(fast_swarm(tmp_path, faults, checkpoint_every=10), step_time=0.05)
    assert summary["peers_finished"] == 6 and "failed" not in summary
    back = [x for x in lines(tmp_path / "run", 2) if x.get("start")]
    assert len(back) == 2 and back[1]["resumed"] and back[1]["step"] == 10
    assert back[1]["down_s"] == pytest.approx(2.0)
    (resumed,) = starts  # let back in once, with the checkpoint's model, nobody else's
    assert not resumed.took_model and resumed.checkpoint is not None
    assert torch.equal(resumed.after, resumed.checkpoint)
    assert torch.equal(resumed.checkpoint, stepped[10])
    after = [x for x in lines(tmp_path / "run", 2) if x["time"] > 3.0 and not x.get("start")]
    assert after[0]["step"] <= 20  # on from the checkpoint's 10, not the swarm's count (> 40)
    assert after[0]["members"] == 6 and after[-1]["final"] and after[-1]["step"] == 100
    for peer in (0, 1, 3, 4, 5):
        seen = [x["members"] for x in lines(tmp_path / "run", peer)]
        assert 5 in seen and seen[-1] == 6  # it was dropped, then back


def test_a_restart_at_the_moment_of_the_kill_is_a_new_life_alone(tmp_path: Path) -> None:
    """Killed and restarted at the same instant, before anyone noticed: what the old life
    had scheduled (its next step, its heartbeat) never runs in the new one, which rejoins
    as a new life (not as a join sent again) and finishes with the others."""
    faults = [{"at": "1s", "kill": "2"}, {"at": "1s", "restart": "2"}]
    summary = simulate(fast_swarm(tmp_path, faults), step_time=0.05)
    assert summary["peers_finished"] == 6 and "failed" not in summary
    back = [x for x in lines(tmp_path / "run", 2) if x.get("start")]
    assert len(back) == 2 and back[1]["down_s"] == 0.0
    assert lines(tmp_path / "run", 2)[-1]["final"]


@pytest.mark.parametrize("mode", ["ring", "ps"])
def test_restart_is_refused_where_the_real_engine_cannot_restart(tmp_path: Path, mode: str) -> None:
    faults = [{"at": "1s", "kill": "2"}, {"at": "2s", "restart": "2"}]
    with pytest.raises(SimulationError, match=f"restart is not simulated in mode {mode}"):
        simulate(fast_swarm(tmp_path, faults, mode=mode, peers=4), step_time=0.05)


def test_a_peer_restarted_without_a_checkpoint_takes_a_neighbours_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a checkpoint the restarted peer is a newcomer on its old address: it gets its
    id back, takes a neighbour's model and step count, trains on from there in step with the
    swarm (alone until its first round, a join margin on), and finishes with the others.
    Its first two model requests are lost: it keeps asking, each ``RETRY_S``, until one
    is answered."""
    asked: list[tuple[float, int]] = []  # (time, to) of each model request of peer 2
    send = SimNetwork.send

    def lossy(self: SimNetwork, src: int, dst: int, frames: list[bytes]) -> None:
        if src == 2 and decode(frames, 1 << 30).kind == "model_request":
            asked.append((self.clock.now, dst))
            if len(asked) <= 2:
                return  # lost on the way
        send(self, src, dst, frames)

    monkeypatch.setattr(SimNetwork, "send", lossy)
    faults = [{"at": "1s", "kill": "2"}, {"at": "3s", "restart": "2"}]
    summary = simulate(fast_swarm(tmp_path, faults, steps=150), step_time=0.05)
    assert summary["peers_finished"] == 6 and "failed" not in summary
    assert asked == [(pytest.approx(3.0 + i * RETRY_S), 1) for i in range(3)]  # a neighbour
    back = [x for x in lines(tmp_path / "run", 2) if x["time"] > 3.0 and not x.get("start")]
    neighbour = {x["time"]: x["step"] for x in lines(tmp_path / "run", 1)}
    # the swarm's step count (not its own 20, nor its first round's, a margin on), at once:
    # it trains from the reply on instead of waiting a margin of rounds for the swarm
    assert back[0]["step"] > 60 and back[0]["time"] < asked[-1][0] + 0.5
    assert all(abs(x["step"] - neighbour[x["time"]]) <= 5 for x in back if x["time"] in neighbour)
    assert back[-1]["final"] and back[-1]["time"] == pytest.approx(summary["simulated_time_s"])


def test_injected_loss_duplicates_and_reordering_are_counted_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages are lost, delivered twice and overtaken by later ones (a link is first in,
    first out without the injection; a delay of up to two steps lets a round's message pass
    the one before); the receivers drop the second copies and nothing else, so a message
    that came after later ones is taken, and every peer finishes."""
    delivered: dict[tuple[int, int], list[tuple[float, int]]] = {}  # (from, to): (time, seq)
    deliver = SimNetwork._deliver

    def spy(self: SimNetwork, src: int, dst: int, frames: list[bytes], *rest: Any) -> None:
        seq = decode(frames, 1 << 30).seq
        if seq > 0:  # numbered: each sender numbers what it sends each member in order
            delivered.setdefault((src, dst), []).append((self.clock.now, seq))
        deliver(self, src, dst, frames, *rest)

    monkeypatch.setattr(SimNetwork, "_deliver", spy)
    faults = [
        {"at": "0.5s", "inject": {"loss": 0.05, "duplicate": 0.1, "reorder": "100ms"}},
        {"at": "3s", "inject": {}},  # ends it
    ]
    summary = simulate(fast_swarm(tmp_path, faults, peers=4, dead_after=5.0), step_time=0.05)
    network = summary["network"]
    assert network["injected_loss"] > 0 and network["duplicated"] > 0
    assert summary["peers_finished"] == 4
    assert all(peer["finished"] and peer["steps"] == 100 for peer in summary["peers"])

    def overtaken(start: float, end: float) -> int:  # delivered after a later one
        late = 0
        for arrivals in delivered.values():
            seqs = [q for t, q in arrivals if start <= t < end]
            late += sum(q < max(seqs[:i], default=0) for i, q in enumerate(seqs))
        return late

    assert overtaken(0.0, 0.5) == overtaken(3.2, float("inf")) == 0  # no injection: in order
    assert overtaken(0.5, 3.2) > 0  # reordered while it lasted
    copies = sum(len(a) - len({q for _, q in a}) for a in delivered.values())
    seen_twice = sum(p["dropped_reasons"].get("duplicate", 0) for p in summary["peers"])
    assert 0 < seen_twice == copies <= network["duplicated"]  # second copies, and only those


def test_a_compressed_broadcast_swarm_agrees_again_after_its_losses(tmp_path: Path) -> None:
    """A lost update makes the whole swarm resync in one round, so every peer averages the
    same copies. A peer that resynced alone took its neighbours' dense copies instead of
    their updates of that round and never agreed again (consensus distance 0.01-0.02)."""
    faults = [{"at": "0.5s", "inject": {"loss": 0.05}}, {"at": "2s", "inject": {}}]
    config = fast_swarm(tmp_path, faults, peers=4, topology="complete", algorithm="broadcast",
                        codec="topk:0.1")  # fmt: skip
    summary = simulate(config, step_time=0.05)
    assert summary["network"]["injected_loss"] > 5
    assert summary["consensus_distance"] < 1e-9


def test_a_killed_peer_stops_at_its_time_and_the_others_finish(tmp_path: Path) -> None:
    summary = simulate(fast_swarm(tmp_path, [{"at": "1s", "kill": "2"}]), step_time=0.05)
    run = tmp_path / "run"
    dead = lines(run, 2)
    assert dead[-1]["time"] <= 1.0 and dead[-1]["step"] <= 20 and not dead[-1].get("final")
    for peer in (0, 1, 3, 4, 5):
        assert lines(run, peer)[-1]["final"]
    assert summary["network"]["dead"] > 0  # sent to it before its neighbours gave up on it


def test_a_peer_offline_past_dead_after_is_dropped_then_rejoins_and_ends_with_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peer 2's device is away from 1 s to 3 s: the others declare it dead, and once back
    its heartbeat gets the answer that it was dropped; it rejoins with its own model and
    the swarm's step count (the steps it missed are not owed), as a real peer does."""
    starts = spy_late_starts(monkeypatch, 2)
    away = {"away": {"peers": "2", "offline": ["1s-3s"]}}
    summary = simulate(fast_swarm(tmp_path, [], profiles=away), step_time=0.05)
    assert summary["peers_finished"] == 6 and summary["network"]["offline"] > 0
    (rejoined,) = starts  # back in once, with the model it trained (no neighbour's)
    assert not rejoined.took_model and torch.equal(rejoined.after, rejoined.before)
    came_back = [x for x in lines(tmp_path / "run", 2) if x["time"] >= 3.0 and not x.get("final")]
    assert came_back[-1]["rejoins"] == 1 and came_back[-1]["members"] == 6
    assert came_back[-1]["step"] - came_back[0]["step"] > 30  # it jumped to the swarm's step
    assert all(lines(tmp_path / "run", i)[-1]["declared_dead"] == 1 for i in (0, 1, 3, 4, 5))
    assert summary["simulated_time_s"] < 6.5  # it ends with the others


def test_a_peer_waiting_in_a_round_when_it_goes_offline_stops_waiting_and_logs_away(
    tmp_path: Path,
) -> None:
    """Peer 2 computes fast and waits on slow neighbours; its window starts mid-round. The
    round was looked at only when a message came or it timed out, and none comes to an
    offline peer: it waited the whole window (10 s timeout), writing no line, where a real
    peer's round ends as it goes away and it logs ``online: false`` every 0.25 s."""
    profiles = {
        "slow": {"peers": "0-1", "step_time": "300ms"},
        "away": {"peers": "2", "step_time": "10ms", "offline": ["1s-2s"]},
    }
    config = fast_swarm(tmp_path, [], peers=3, steps=8, round_timeout=10.0, profiles=profiles)
    simulate(config)
    away = [x for x in lines(tmp_path / "run", 2) if 1.0 <= x["time"] < 2.0]
    assert away and away[0]["time"] <= 1.01 and away[0]["idle_s"] < 1.0  # ended at once
    assert [x["online"] for x in away] == [False] * len(away) and len(away) >= 4
    assert len({x["step"] for x in away}) == 1


# -- the real engine refuses them -------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "peer", "sweep"])
def test_the_real_engine_refuses_faults_naming_simulate(tmp_path: Path, command: str) -> None:
    args = [command, "--set", 'faults=[{at = "1s", kill = "1"}]', "--out", str(tmp_path / "x")]
    if command == "sweep":
        path = tmp_path / "job.toml"
        path.write_text(to_toml(small_config(tmp_path)))
        args = [command, str(path), "--grid", "lr=0.1,0.2", *args[1:]]
    result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "80"})
    stderr = " ".join(result.stderr.split())
    assert result.exit_code == 2, stderr
    assert "faults (1 event(s)) are simulated only" in stderr
    assert "gossipdl simulate" in stderr
    assert not (tmp_path / "x" / "peers").exists()


def test_a_peer_that_leaves_during_a_sync_says_goodbye_and_is_not_declared_dead(
    tmp_path: Path,
) -> None:
    """A graceful leave takes effect at the peer's next round, once that round's messages are
    out: its final line says it stopped early, the others hear its goodbye (no death
    sentence) and finish without it."""
    config = fast_swarm(tmp_path, [{"at": "1s", "leave": "2"}])
    summary = simulate(config, step_time=0.02)
    gone = lines(Path(config.out), 2)[-1]
    assert gone["final"] and gone["stopped_early"] and 0 < gone["step"] < 100
    assert summary["peers_finished"] == 5 and "failed" not in summary  # of its steps
    others = [lines(Path(config.out), i)[-1] for i in (0, 1, 3, 4, 5)]
    assert all(r["step"] == 100 and r["declared_dead"] == 0 for r in others)


def test_a_slow_clock_runs_the_peers_timers_late_and_the_swarm_carries_on(tmp_path: Path) -> None:
    """``clock`` sets how fast a peer's own clock runs: at half speed from 1 s to 3 s it
    reads a second behind true time from then on; its heartbeats, due by its own clock,
    go out half as often in true time meanwhile (every 0.5 s for a heartbeat of 0.25 s),
    and the swarm still finishes."""
    from gossipdl.rundir import RunDir

    faults = [
        {"at": "1s", "clock": {"peers": "3", "rate": 0.5}},
        {"at": "3s", "clock": {"peers": "3", "rate": 1}},
    ]
    config = fast_swarm(tmp_path, faults, profiles={"all": {"peers": "0-5", "step_time": "40ms"}})
    run = RunDir(config.out)
    run.create()
    simulation = Simulation(config, run)
    alive: dict[tuple[int, int], list[float]] = {}  # (from, to): true times of heartbeats
    send = simulation._send

    def spy(peer: Any, sends: list[Any]) -> None:
        for s in sends:
            if s.kind == "alive":
                alive.setdefault((peer.id, s.to), []).append(simulation.clock.now)
        send(peer, sends)

    simulation._send = spy  # type: ignore[method-assign]
    simulation.run()
    slow, other = simulation.peers[3], simulation.peers[0]
    assert simulation.local(slow) == pytest.approx(simulation.clock.now - 1.0)
    assert simulation.local(other) == simulation.clock.now
    assert all(p.steps == 100 for p in simulation.peers) and not simulation.failures
    assert simulation.clock.now > 3.5  # the run outlasts the slow clock's window

    def gaps(sender: int, to: int, start: float, end: float) -> list[float]:
        times = [t for t in alive[sender, to] if start <= t <= end]
        assert len(times) >= 3, (sender, to, alive[sender, to])
        return [round(b - a, 6) for a, b in pairwise(times)]

    # peer 0 is no ring neighbour of 3: what they trade is heartbeats alone
    assert set(gaps(3, 0, 1.2, 2.9)) == {2 * config.heartbeat}  # by its slow clock
    assert set(gaps(0, 3, 1.2, 2.9)) == {config.heartbeat}  # the other way, on time
    assert set(gaps(3, 0, 3.1, simulation.clock.now)) == {config.heartbeat}  # on time again


@pytest.mark.parametrize("action", ["leave", "clock"])
def test_leave_and_clock_are_refused_where_the_real_engine_has_no_member_table(
    tmp_path: Path, action: str
) -> None:
    value: Any = "2" if action == "leave" else {"peers": "2", "rate": 0.5}
    config = fast_swarm(tmp_path, [{"at": "1s", action: value}], mode="ring", peers=4)
    with pytest.raises(SimulationError, match=f"{action} is not simulated in mode ring"):
        simulate(config, step_time=0.02)


def test_syncs_count_the_rounds_a_peer_took_part_in_across_its_lives(tmp_path: Path) -> None:
    """``syncs`` is the rounds a peer averaged in. For every trigger but the dynamic one it
    was the round number, so a peer restarted without a checkpoint (let in a join margin
    ahead of the swarm's round) reported more syncs than the run has rounds before it had
    averaged at all."""
    faults = [{"at": "1.2s", "kill": "3"}, {"at": "3s", "restart": "3"}]
    config = fast_swarm(tmp_path, faults, steps=60, trigger="periodic:5")
    summary = simulate(config, step_time=0.1)
    assert summary["peers_finished"] == 6
    rounds = config.steps // 5
    back = [x for x in lines(tmp_path / "run", 3) if x["time"] > 3.0]
    assert all(x["syncs"] <= rounds for x in back), [x["syncs"] for x in back]
    first = back[0]
    assert first["syncs"] == 0 and first["model_messages_sent"] == 0  # a new life, no round yet
    for peer in (0, 1, 2, 4, 5):  # a round every 5 steps, the last one too
        assert lines(tmp_path / "run", peer)[-1]["syncs"] == rounds


@pytest.mark.parametrize("checkpoint_every", [10, 0], ids=["resumed", "newcomer"])
def test_a_restarted_peers_counters_start_as_a_new_process_s_do(
    tmp_path: Path, checkpoint_every: int
) -> None:
    """A new life is a new process: its counters start at 0, plus, resumed from a checkpoint,
    what its last life's last line held (``gossipdl peer --resume`` carries those sums on).
    The simulator restarted the protocol's counters at 0 even when resumed, and carried the
    network's (bytes, messages) on even for a newcomer."""
    from gossipdl.training import CARRIED

    faults = [{"at": "1s", "kill": "3"}, {"at": "3s", "restart": "3"}]
    config = fast_swarm(tmp_path, faults, checkpoint_every=checkpoint_every)
    assert simulate(config, step_time=0.05)["peers_finished"] == 6
    records = lines(tmp_path / "run", 3)
    restart = next(i for i, x in enumerate(records) if x.get("start") and x["time"] >= 3.0)
    before, first = records[restart - 1], records[restart]
    assert before["model_messages_sent"] > 0 and before["bytes_sent"] > 0
    for key in CARRIED:
        assert first[key] == (before[key] if checkpoint_every else 0), key
    assert first["dropped_reasons"] == (before["dropped_reasons"] if checkpoint_every else {})
    assert records[-1]["syncs"] > first["syncs"]  # and counts on from there
