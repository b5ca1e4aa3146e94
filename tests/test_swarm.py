"""Real swarms: peer processes over real ZeroMQ sockets on 127.0.0.1, and the run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import gossipdl_cmd, last_record, peer_pids, restore_logging, small_config, wait_for
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl.config import TABLE_KEYS, ConfigError, from_dict, resolved, to_dict
from gossipdl.experiments.launcher import launch
from gossipdl.experiments.simulated import simulate
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.rundir import RunDir
from gossipdl.training import lr_at

RECORD_KEYS = {
    "peer", "step", "time", "loss", "bytes_sent", "header_bytes_sent", "bytes_received",
    "messages_sent", "messages_dropped", "dropped_reasons",
}  # fmt: skip
SUMMARY_KEYS = {
    "mean_accuracy", "min_accuracy", "max_accuracy", "consensus_distance",
    "total_bytes_sent", "total_header_bytes_sent", "total_messages_sent", "wall_time_s", "peers",
}  # fmt: skip
SUMMARY_PEER_KEYS = {
    "id", "accuracy", "bytes_sent", "bytes_received", "messages_sent", "messages_dropped",
}  # fmt: skip


@pytest.fixture
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI, run in this process, sets up logging; give the next tests theirs back."""
    restore_logging(monkeypatch)


def test_swarm_trains_and_writes_the_run_directory_and_never_reuses_it(tmp_path: Path) -> None:
    """One real launch: three peer processes on 127.0.0.1, the run directory they write, the
    summary; a second launch into the same directory is refused before anything starts."""
    steps = 30
    config = small_config(tmp_path, peers=3, topology="ring", steps=steps, eval_every=15)
    summary = launch(config, progress=False)
    run = RunDir(config.out)

    assert from_dict(tomllib.loads(run.config.read_text())) == resolved(config)  # what ran
    peers = json.loads(run.peers_json.read_text())
    assert sorted(p["id"] for p in peers) == [0, 1, 2]
    assert all(p["address"].startswith("tcp://127.0.0.1:") for p in peers)
    assert len({p["address"] for p in peers}) == 3

    numel = 32 * 10 + 10  # logistic regression on the 32-feature, 10-class blobs
    message_bytes = numel * 4
    for peer_id in range(3):
        records = list(run.records(peer_id))
        assert all(r.keys() >= RECORD_KEYS for r in records)
        assert [r["step"] for r in records if r.get("accuracy") is not None] == [0, 15, 30]
        final = records[-1]
        assert final["final"] and final["step"] == steps and not final["stopped_early"]
        # Two ring neighbours per round, each sent a full model plus its header.
        assert final["messages_sent"] >= 2 * steps
        assert final["bytes_sent"] > 2 * steps * message_bytes
        # Headers are counted within bytes_sent: tens of bytes per message, not model-sized.
        assert 20 * final["messages_sent"] < final["header_bytes_sent"]
        assert final["header_bytes_sent"] < 1000 * final["messages_sent"]
        assert final["bytes_received"] > 2 * steps * message_bytes
        assert final["messages_dropped"] == 0
        assert run.model(peer_id).is_file()

    assert summary.keys() >= SUMMARY_KEYS
    assert json.loads(run.summary.read_text()) == summary
    assert all(p.keys() >= SUMMARY_PEER_KEYS for p in summary["peers"])
    assert summary["peers_finished"] == 3
    assert summary["total_bytes_sent"] == sum(p["bytes_sent"] for p in summary["peers"])
    curve = accuracy_curve(run)
    assert [p["step"] for p in curve] == [0, 15, 30]
    assert curve[-1]["accuracy"] == pytest.approx(summary["mean_accuracy"])
    assert 0 < curve[1]["bytes_sent"] < curve[2]["bytes_sent"] <= summary["total_bytes_sent"]
    assert summary["mean_accuracy"] > 0.7  # chance is 0.1
    import torch

    norm = sum(float((t**2).sum()) for t in torch.load(run.model(0)).values())
    assert summary["consensus_distance"] < 1e-3 * norm  # peers agree up to the last local steps

    before = run.summary.read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        launch(config, progress=False)
    assert run.summary.read_text() == before


def test_single_mode_trains_one_process_on_all_data(tmp_path: Path) -> None:
    config = small_config(tmp_path, mode="single", peers=4, steps=30)
    summary = launch(config, progress=False)
    assert [p["id"] for p in summary["peers"]] == [0]
    assert summary["total_bytes_sent"] == 0 and summary["consensus_distance"] is None
    assert summary["mean_accuracy"] > 0.7


def test_cli_run_of_a_toml_file_with_overrides_and_user_factories_prints_a_table(
    tmp_path: Path,
) -> None:
    """The installed console script (no cwd on sys.path, unlike -m) runs a TOML file whose
    dataset and model are user functions named by module:function, with flag overrides."""
    (tmp_path / "myexp.py").write_text(
        "import numpy as np, torch\n"
        "from gossipdl.data import Dataset\n"
        "def data():\n"
        "    rng = np.random.default_rng(0)\n"
        "    x = rng.standard_normal((400, 6)).astype(np.float32)\n"
        "    y = (x[:, 0] > 0).astype(np.int64)\n"
        "    return Dataset('halfspace', x[:300], y[:300], x[300:], y[300:], 2, (6,))\n"
        "def tiny(input_shape, num_classes, hidden):\n"
        "    return torch.nn.Linear(input_shape[0], num_classes)\n"
    )
    exp = tmp_path / "exp.toml"
    exp.write_text(
        'peers = 2\ndataset = "myexp:data"\nmodel = "myexp:tiny"\nsteps = 500\n'
        'eval_every = 0\nthreads = 1\nlr = 0.5\ntopology = "ring"\n'
    )
    console_script = Path(sys.executable).with_name("gossipdl")
    command = [str(console_script)] if console_script.exists() else gossipdl_cmd()
    done = subprocess.run(
        [*command, "run", str(exp), "--steps", "40", "--topology", "complete", "--out", "run",
         "--no-progress"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mean test accuracy" in done.stdout and "peer" in done.stdout
    out = tmp_path / "run"
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert (resolved["peers"], resolved["steps"], resolved["topology"]) == (2, 40, "complete")
    assert (resolved["dataset"], resolved["model"]) == ("myexp:data", "myexp:tiny")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers_finished"] == 2 and summary["mean_accuracy"] > 0.9


@pytest.mark.usefixtures("_restore_logging")
def test_help_lists_every_option_with_its_default() -> None:
    done = CliRunner().invoke(
        cli.app, ["run", "--help"], env={"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    )
    assert done.exit_code == 0, done.output
    for key, value in to_dict(small_config(Path("."))).items():
        # Tables (device profiles, fault events) live in the config file only; the help says
        # where.
        flag = "--" + key.replace("_", "-")
        if key in TABLE_KEYS:
            flag = f"[{key}." if isinstance(value, dict) else f"[[{key}]]"
        assert flag in done.stdout, f"{flag} missing from --help"
    assert "[default: 4]" in done.stdout and "[default: ring]" in done.stdout


@pytest.mark.usefixtures("_restore_logging")
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--topology", "torus", "--peers", "7"], ["torus", "7"]),
        (["--topology", "moebius"], ["moebius", "ring"]),
        (["--dataset", "imagenet"], ["imagenet", "mnist1d"]),
        (["--model", "resnet"], ["resnet", "cnn1d"]),
        (["--peers", "1"], ["peers = 1", "at least 2"]),
        (["--partition", "zipf:2"], ["zipf:2", "dirichlet:ALPHA"]),
        (["--lr", "-1"], ["lr = -1"]),
        (["--lr-schedule", "linear"], ["lr_schedule = 'linear'", "constant, cosine"]),
        (["--peers", "401", "--partition", "dirichlet:1"], ["dirichlet:1", "need 4010 samples"]),
        (["--steps", "ten"], ["Invalid value", "--steps"]),  # wording varies by click version
        (["--codec", "zip:9"], ["codec = 'zip:9'"]),
        (["--gamma", "2"], ["gamma = 2.0"]),
        (["--algorithm", "magic"], ["magic", "choco"]),
        (["--trigger", "sometimes"], ["sometimes", "periodic:H", "dynamic:DELTA"]),
        (["--trigger", "periodic:0"], ["periodic:0", "whole number >= 1"]),
        (
            ["--algorithm", "broadcast", "--topology", "complete", "--trigger", "dynamic:1"],
            ["broadcast", "periodic:H"],
        ),
        (["--slowdown", "3"], ["slowdown '3'", "PEER:FACTOR"]),
        (["--drift", "soon"], ["drift 'soon'", "STEP:permute"]),
        (["--link", "up=fast"], ["link = 'up=fast'", "KEY=NUMBER[UNIT]", "up=10mbit"]),
    ],
)
def test_bad_config_fails_before_any_peer_starts(
    tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    """The CLI's own parsing and validation, in this process (what a real process adds,
    its exit code, is checked once below)."""
    out = tmp_path / "never"
    done = CliRunner().invoke(
        cli.app, ["run", "--out", str(out), "--dataset", "synthetic", *args],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    for needle in needles:
        assert needle in text
    assert not (out / "peers").exists() or not any((out / "peers").iterdir())


@pytest.mark.usefixtures("_restore_logging")
def test_missing_config_file_is_named(tmp_path: Path) -> None:
    done = CliRunner().invoke(cli.app, ["run", str(tmp_path / "nope.toml")])
    text = "".join(done.output.split())  # a long path may be wrapped anywhere
    assert done.exit_code == 2 and "nope.tomldoesnotexist" in text


def test_a_killed_peer_is_declared_dead_then_ctrl_c_stops_the_swarm_and_keeps_measurements(
    tmp_path: Path,
) -> None:
    """kill -9 of one real peer process: the others notice its silence and declare it dead
    (the protocol's side, ring repair included, is simulated in test_sim_faults and
    test_simulate). Then Ctrl-C stops the whole swarm: exit 130, every survivor's final line
    and model kept, no process left. Steps are padded to 20 ms by a device profile, so the
    peers mostly sleep while the test waits."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        gossipdl_cmd(
            "run", "--peers", "3", "--dataset", "synthetic", "--model", "logistic",
            "--steps", "100000", "--eval-every", "0", "--threads", "1", "--out", str(out),
            "--round-timeout", "5", "--dead-after", "1.5", "--heartbeat", "0.2",
            "--log-every", "5", "--no-progress",
            "--set", 'profiles={board={peers="*", step_time="20ms"}}',
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    try:
        wait_for(lambda: (last_record(out / "peers" / "2.jsonl") or {}).get("step", 0) >= 10,
                 120, "the swarm to train")  # fmt: skip
        pids = peer_pids(out)
        assert sorted(pids) == [0, 1, 2]
        os.kill(pids[1], signal.SIGKILL)

        def declared() -> bool:
            lines = [last_record(out / "peers" / f"{i}.jsonl") or {} for i in (0, 2)]
            return any(line.get("declared_dead", 0) >= 1 for line in lines) and all(
                line.get("members") == 2 for line in lines
            )

        wait_for(declared, 120, "the survivors to drop peer 1")
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr  # 128 + SIGINT, as a shell reports it
    assert "interrupted" in stderr
    summary = json.loads((out / "summary.json").read_text())
    peers = {p["id"]: p for p in summary["peers"]}
    assert sorted(peers) == [0, 1, 2] and not peers[1]["finished"]
    for peer_id in (0, 2):
        final = last_record(out / "peers" / f"{peer_id}.jsonl")
        assert final is not None and final["final"] and final["stopped_early"]
        assert final["accuracy"] is not None and (out / "models" / f"{peer_id}.pt").is_file()
        log = (out / "peers" / f"{peer_id}.log").read_text()
        assert "at least 0.02 s a step" in log  # the profile reached the real peer
    logs = (out / "peers" / "0.log").read_text() + (out / "peers" / "2.log").read_text()
    assert "no word from peer 1" in logs and "declared dead" in logs
    assert not (last_record(out / "peers" / "1.jsonl") or {}).get("final")
    assert not peer_pids(out), "peer processes left running"


def test_choco_swarm_trains_on_a_fraction_of_the_bytes(tmp_path: Path) -> None:
    """Simulated (the same protocol core, wire encoder and codecs): bytes are the encoded
    frames', counted the same way as a real run's."""
    common = {"peers": 3, "steps": 60, "topology": "ring"}
    dense = simulate(small_config(tmp_path / "dense", **common), step_time=0.01)
    choco = simulate(
        small_config(tmp_path / "choco", **common, codec="topk:0.1+fp16", gamma=0.3),
        step_time=0.01,
    )
    resolved = tomllib.loads((tmp_path / "choco" / "run" / "config.toml").read_text())
    assert resolved["codec"] == "topk:0.1+fp16" and resolved["algorithm"] == "choco"
    assert choco["peers_finished"] == 3 and choco["total_messages_dropped"] == 0
    assert choco["total_messages_sent"] == dense["total_messages_sent"]
    assert choco["mean_accuracy"] > 0.7
    assert choco["total_bytes_sent"] * 3 < dense["total_bytes_sent"]


def test_a_second_sigint_during_the_first_cannot_deadlock_a_stopping_peer() -> None:
    """Ctrl-C reaches a peer from the terminal and again from the launcher; the second
    signal must not re-enter the handler while the first holds the stop Event's lock."""
    script = (
        "import os, signal, threading, types\n"
        "from gossipdl.cli import _stop_on_signals\n"
        "training, stop = threading.Event(), threading.Event()\n"
        "training.set()\n"
        "def set_with_second_signal(self):\n"
        "    with self._cond:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        sum(range(10000))\n"  # bytecodes at which a nested handler would run
        "        self._flag = True\n"
        "        self._cond.notify_all()\n"
        "stop.set = types.MethodType(set_with_second_signal, stop)\n"
        "_stop_on_signals(training, stop)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "sum(range(10000))\n"
        "print('stopped' if stop.is_set() else 'running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


def test_cosine_schedule_anneals_from_lr_to_zero_by_step_alone() -> None:
    config = small_config(Path("."), lr=0.2, steps=100, lr_schedule="cosine")
    assert [lr_at(config, s) for s in (0, 50, 100, 150)] == pytest.approx([0.2, 0.1, 0, 0])
    assert lr_at(config.replace(lr_schedule="constant"), 77) == 0.2
