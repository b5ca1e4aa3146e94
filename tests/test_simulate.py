"""The simulated engine: the real protocol core, encoder and codecs on virtual time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import restore_logging, run_files, small_config
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl.config import Config, load_config
from gossipdl.experiments.launcher import launch
from gossipdl.experiments.report import runs_of
from gossipdl.experiments.simulated import simulate
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import SimulationError


def lossy_swarm(tmp_path: Path, out: str, link_loss: float = 0.05, **changes: Any) -> Config:
    """Six CHOCO peers on slow, lossy, jittery links: every random draw matters."""
    profile = {"peers": "*", "up": "2mbit", "down": "4mbit", "latency": "20ms",
               "jitter": "5ms", "loss": link_loss, "step_time": "100ms"}  # fmt: skip
    values: dict[str, Any] = {
        "peers": 6,
        "codec": "topk:0.05",
        "steps": 40,
        "eval_every": 20,
        "log_every": 5,
        "profiles": {"edge": profile},
        "out": str(tmp_path / out),
        **changes,
    }
    return small_config(tmp_path, **values)


def test_the_same_config_and_seed_give_byte_identical_run_files(tmp_path: Path) -> None:
    first = simulate(lossy_swarm(tmp_path, "a"))
    again = simulate(lossy_swarm(tmp_path, "b"))
    assert run_files(tmp_path / "a") == run_files(tmp_path / "b")
    assert first["network"]["link_loss"] > 0 and first["peers_finished"] == 6
    other = simulate(lossy_swarm(tmp_path, "c", seed=1))
    assert run_files(tmp_path / "c") != run_files(tmp_path / "a"), "the seed changes nothing"
    assert again["simulated_time_s"] == first["simulated_time_s"] != other["simulated_time_s"]


def test_links_and_step_time_set_the_simulated_time(tmp_path: Path) -> None:
    """40 steps of 100 ms, each round waiting on 20 ms links: about 4.8 s, never less than
    the compute alone; the lines say the same in ``time``."""
    summary = simulate(lossy_swarm(tmp_path, "run", profiles={}), step_time=0.1)
    assert summary["simulated_time_s"] == pytest.approx(4.0, abs=1e-6)  # no link: compute only
    slow = simulate(lossy_swarm(tmp_path, "slow", link_loss=0.0))
    assert 4.4 < slow["simulated_time_s"] < 8.0
    last = (tmp_path / "slow" / "peers" / "0.jsonl").read_text().splitlines()[-1]
    assert json.loads(last)["time"] == pytest.approx(slow["simulated_time_s"], abs=0.05)
    assert slow["peers"][0]["idle_s"] > 0.3


@pytest.mark.parametrize("mode", ["gossip", "ring"])
def test_a_slow_uplink_past_max_queued_mb_drops_in_gossip_and_ring_mode(
    tmp_path: Path, mode: str
) -> None:
    """A real ring's chunks go through the peer's transport, which takes ``max_queued_mb``
    as a gossip peer's does; the simulator applied it in mode gossip alone."""
    profiles = {"slow": {"peers": "0", "up": "50kbit"}}
    config = small_config(tmp_path, mode=mode, peers=3, steps=4, max_queued_mb=0.0001,
                          profiles=profiles, round_timeout=2.0)  # fmt: skip
    summary = simulate(config, step_time=0.01)
    assert summary["network"]["send_queue_full"] > 0


def test_a_straggler_with_a_step_time_floor_takes_its_slowdown_when_that_is_longer(
    tmp_path: Path,
) -> None:
    """A profile's ``step_time`` alone set the step, so an 8x straggler with a 5 ms floor
    stepped in 5 ms; a real one takes 8x the host's step, at least 5 ms. The floor alone
    still needs no host time (deterministic on every host)."""
    profile = {"peers": "*", "slowdown": 8, "step_time": "5ms"}
    config = small_config(tmp_path, steps=10, profiles={"straggler": profile})
    summary = simulate(config, step_time=0.01)  # the host's step: 10 ms
    assert summary["simulated_time_s"] == pytest.approx(0.8, abs=1e-6)
    floor = config.replace(out=str(tmp_path / "floor"), profiles={"p": {**profile, "slowdown": 1}})
    summary = simulate(floor)
    assert summary["simulated_time_s"] == pytest.approx(0.05, abs=1e-6)
    assert summary["step_time_s"] is None  # nothing measured


def test_bytes_and_accuracy_match_a_real_run_of_the_same_config(tmp_path: Path) -> None:
    """The quick start's kind of swarm, real processes against virtual peers: the same
    model messages, the same payload bytes (the real run adds start-up and heartbeat
    messages), the same accuracy to within a point; a third of the peers' labels drift
    midway in both (their test labels too). The one real gossip swarm of this file."""
    config = small_config(tmp_path, steps=40, log_every=20, drift="20:permute:0.34")
    real = launch(config.replace(out=str(tmp_path / "real")), progress=False)
    sim = simulate(config.replace(out=str(tmp_path / "sim")), step_time=0.01)
    assert real["peers_finished"] == sim["peers_finished"] == 3
    assert sim["total_messages_sent"] == real["total_messages_sent"]
    assert abs(sim["mean_accuracy"] - real["mean_accuracy"]) <= 0.01
    ratio = sim["total_bytes_sent"] / real["total_bytes_sent"]
    assert 0.97 < ratio <= 1.0


def test_overlap_takes_the_same_steps_in_virtual_and_real_peers(tmp_path: Path) -> None:
    """With overlap (each round behind the next step's compute, settled before an
    evaluation and at the end) virtual and real peers end on the same weights, which
    differ from those without overlap; on virtual time the rounds (a 20 ms link) hide
    behind the 10 ms steps, so training takes less time, and less of it idle. On the CPU:
    virtual peers run there, and a GPU's sums round otherwise."""
    config = small_config(
        tmp_path, steps=60, eval_every=25, link="latency=20ms", overlap=True, device="cpu"
    )
    real = launch(config.replace(out=str(tmp_path / "real")), progress=False)
    sim = simulate(config.replace(out=str(tmp_path / "sim")), step_time=0.01)
    off = simulate(config.replace(out=str(tmp_path / "off"), overlap=False), step_time=0.01)
    assert real["peers_finished"] == sim["peers_finished"] == off["peers_finished"] == 3

    def weights(name: str) -> torch.Tensor:
        run = RunDir(tmp_path / name)
        return torch.cat(
            [torch.cat([w.flatten() for w in torch.load(run.model(i)).values()]) for i in range(3)]
        )

    torch.testing.assert_close(weights("sim"), weights("real"), rtol=0, atol=1e-6)
    assert (weights("sim") - weights("off")).abs().max() > 1e-4
    assert sim["training_s"] < 0.8 * off["training_s"]
    idle = {
        name: sum(p["idle_s"] for p in run["peers"]) for name, run in (("sim", sim), ("off", off))
    }
    assert (
        0 < idle["sim"] < 0.8 * idle["off"]
    )  # a step waits only for what its compute did not hide


def _toml(tmp_path: Path, config: Config) -> Path:
    from gossipdl.config import to_toml

    path = tmp_path / "job.toml"
    path.write_text(to_toml(config))
    return path


def test_a_dead_peer_is_declared_dead_and_the_ring_goes_on(tmp_path: Path) -> None:
    """Peer 2 stops for good at 1 s: its neighbours time out, declare it dead after
    dead_after, announce it, and the ring closes over the gap (CHOCO resyncs there)."""
    from gossipdl.sim.engine import Simulation

    config = lossy_swarm(tmp_path, "run", profiles={}, codec="topk:0.1", steps=60,
                         dead_after=1.0, heartbeat=0.25, round_timeout=0.5)  # fmt: skip
    run = RunDir(config.out).create()
    sim = Simulation(config, run, step_time=0.05)
    sim.clock.at(1.0, lambda: sim.kill(2))
    sim.run()
    lines = {i: [json.loads(x) for x in run.metrics(i).read_text().splitlines()] for i in range(6)}
    assert lines[2][-1]["step"] < 30 and not lines[2][-1].get("final")
    for i in (0, 1, 3, 4, 5):
        assert lines[i][-1]["final"] and lines[i][-1]["members"] == 5
    assert lines[1][-1]["declared_dead"] + lines[3][-1]["declared_dead"] >= 1
    assert sim.peers[1].core.neighbours() == [0, 3]  # the ring closed over the gap
    assert sim.network.balanced()


def test_what_the_simulator_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match="mode 'single' is not simulated"):
        simulate(small_config(tmp_path, mode="single"))
    with pytest.raises(SimulationError, match="no backward to overlap"):
        simulate(small_config(tmp_path, mode="ring", overlap=True))
    with pytest.raises(SimulationError, match="no network for the simulator to model"):
        simulate(small_config(tmp_path, mode="ring", shared_memory=True))


def test_gossipdl_simulate_writes_a_run_directory_report_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI in this process: twenty peers simulated, then their report. The timeline of
    many peers names none of them one by one (no twenty-entry legend over the bytes panel)
    and labels time as what it is; up to 16 peers each is still named."""
    from PIL import Image

    from gossipdl.experiments.plots import AXES_KEY

    restore_logging(monkeypatch)
    out = tmp_path / "run"
    done = CliRunner().invoke(cli.app, [
        "simulate", "--peers", "20", "--steps", "30", "--dataset", "synthetic",
        "--model", "logistic", "--eval-every", "10", "--step-time", "50ms",
        "--out", str(out), "--no-progress"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "simulated 1.5 s of swarm time" in " ".join(done.stderr.split())
    assert load_config(out / "config.toml").peers == 20
    members = json.loads((out / "peers.json").read_text())
    assert members[0]["address"] == "tcp://198.18.0.0:5555" and len(members) == 20
    few = tmp_path / "run3"
    simulate(small_config(tmp_path, steps=10, out=str(few)), step_time=0.01)
    for run, peers, named in ((out, 20, False), (few, 3, True)):
        report = CliRunner().invoke(cli.app, ["report", str(run)])
        assert report.exit_code == 0, report.output
        assert (run / "report" / "accuracy.png").is_file()
        with Image.open(run / "report" / "timeline.png") as image:
            sent = json.loads(image.text[AXES_KEY])[2]
        assert sent["xlabel"].startswith("time since the swarm started (s")
        assert (f"peer {peers - 1}" in sent["legend"]) is named


def test_a_sweep_runs_its_variants_in_the_simulator_with_engine_sim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    restore_logging(monkeypatch)
    config = small_config(tmp_path, peers=4, steps=20, out=str(tmp_path / "sweep"))
    done = CliRunner().invoke(cli.app, [
        "sweep", str(_toml(tmp_path, config)), "--grid", "codec=none,topk:0.1",
        "--engine", "sim", "--step-time", "10ms", "--no-progress"])  # fmt: skip
    assert done.exit_code == 0, done.output
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["engine"] == "sim" and summary["peers_finished"] == 4
        assert summary["step_time_s"] == 0.01  # --step-time, for every variant
    # one seed, one size, two swarms: report must not merge them as one run across machines
    assert len(runs_of([tmp_path / "sweep"])) == 2


def test_a_sim_sweep_refuses_a_real_peer_setting_before_its_first_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    restore_logging(monkeypatch)
    config = small_config(tmp_path, peers=2, steps=4, out=str(tmp_path / "sweep"))
    done = CliRunner().invoke(cli.app, [
        "sweep", str(_toml(tmp_path, config)), "--grid", "seed=1,2",
        "--set", "csv=metrics",
        "--engine", "sim", "--no-progress"])  # fmt: skip
    assert done.exit_code == 2, done.output
    said = " ".join(done.stderr.split())
    assert "variant seed-1: csv: these feed a real peer's metrics lines" in said
    assert not (tmp_path / "sweep").exists()  # not even the first variant ran
    real = CliRunner().invoke(
        cli.app, ["sweep", str(_toml(tmp_path, config)), "--grid", "seed=1,2", "--step-time", "1s"]
    )
    assert real.exit_code == 2 and "add --engine sim" in " ".join(real.stderr.split())
