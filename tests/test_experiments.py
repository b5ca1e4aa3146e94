"""`gossipdl experiment` runs a real swarm and draws its report, in which a peer scheduled
offline goes silent for its window and comes back; `sweep` runs a grid (here on the simulator)
into one directory, one table and overlaid real PNGs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gossipdl_cmd, restore_logging
from PIL import Image
from typer.testing import CliRunner

from gossipdl.cli import app
from gossipdl.experiments.plots import AXES_KEY
from gossipdl.rundir import RunDir


def axes_of(path: Path) -> list[dict[str, Any]]:
    """What a PNG's panels show, read back from the file; it must hold a real picture too."""
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 400 and image.height > 300
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(pixels, axis=0)) > 20, f"{path.name} looks blank"
        return list(json.loads(image.text[AXES_KEY]))


def cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gossipdl_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


CHURN = """
peers = 3
dataset = "synthetic"
model = "logistic"
steps = 600
eval_every = 300
log_every = 10
lr = 0.1
threads = 1
heartbeat = 0.2
dead_after = 0.8
round_timeout = 5.0

[profiles.steady]
peers = "0-1"
step_time = "10ms"

[profiles.flaky]
peers = "2"
step_time = "10ms"
offline = ["2.5s-4.5s"]
"""


def test_a_peer_offline_in_its_window_sends_and_hears_nothing_then_rejoins(
    tmp_path: Path,
) -> None:
    """Real peers (``gossipdl experiment``, as a user runs it), each step lasting at least
    10 ms so the run outlasts the window on any host, idling rather than computing; the
    summary says what produced it (tests/test_report.py has the rest of provenance)."""
    (tmp_path / "churn.toml").write_text(CHURN)
    done = cli("experiment", "churn.toml", "--out", "run", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = RunDir(tmp_path / "run")
    flaky = list(run.records(2))
    offline = [r for r in flaky if r["online"] is False]
    assert len(offline) >= 2, "peer 2 logged nothing while offline"
    # the windows count from the swarm's start (the launch), as ``time`` does: not from when
    # the peer began training, a second or two later
    assert all(2.4 <= r["time"] <= 4.7 for r in offline)
    # The device was away: no steps, nothing crossed its link; the counters stand still.
    assert len({(r["step"], r["bytes_sent"], r["bytes_received"]) for r in offline}) == 1
    assert flaky[-1]["dropped_reasons"].get("offline", 0) > 0
    # Its own silence while away is no sign that the others died: it declares nobody dead
    # (it used to drop both on its return, then train alone until told it was dropped).
    assert flaky[-1]["declared_dead"] == 0
    for peer_id in (0, 1):  # the others dropped it meanwhile
        assert any(r["members"] == 2 for r in run.records(peer_id))
    # Back online: it was told it had been dropped, rejoined, and traffic flows again.
    back = [r for r in flaky if r["time"] > 4.5]
    assert flaky[-1]["rejoins"] >= 1
    assert any(r["members"] == 3 for r in back)
    assert back[-1]["bytes_received"] > offline[-1]["bytes_received"]
    accuracies = [json.loads(line)["accuracy"] for line in _last_lines(run)]
    assert min(accuracies) >= max(accuracies) - 0.05, accuracies
    # summary.json says what produced the run, with start-up apart from training.
    summary = json.loads(run.summary.read_text())
    assert summary["provenance"]["devices"] == ["cuda:0" if torch.cuda.is_available() else "cpu"]
    assert summary["provenance"]["command"][1:3] == ["experiment", "churn.toml"]
    assert summary["startup_s"] > 0  # forming the swarm takes time, on one clock
    assert summary["startup_s"] + summary["training_s"] == pytest.approx(summary["wall_time_s"])
    # `experiment` drew its report: timelines show the window.
    timeline = axes_of(run.root / "report" / "timeline.png")
    assert [a["ylabel"] for a in timeline] == ["peer", "peer", "bytes sent (MB)"]
    assert timeline[2]["xlabel"].startswith("time since the swarm started (s")
    assert timeline[2]["lines"] == 3
    assert "| run |" in (run.root / "report" / "report.md").read_text()


def _last_lines(run: RunDir) -> list[str]:
    return [run.metrics(i).read_text().splitlines()[-1] for i in run.peer_ids()]


BASE = """
peers = 2
dataset = "synthetic"
model = "logistic"
steps = 30
eval_every = 10
lr = 0.1
threads = 1
"""


def test_a_2x2_sweep_makes_four_runs_one_table_and_overlaid_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the simulator (``--engine sim``; the sweep is the same for either engine), in
    this process, to its console table."""
    monkeypatch.chdir(tmp_path)
    restore_logging(monkeypatch)
    (tmp_path / "base.toml").write_text(BASE)
    done = CliRunner().invoke(
        app,
        ["sweep", "base.toml", "--grid", "codec=none,topk:0.5", "--grid", "lr=0.1,0.05",
         "--engine", "sim", "--out", "sw", "--no-progress"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    root = tmp_path / "sw"
    names = [
        "codec-none__lr-0.1",
        "codec-none__lr-0.05",
        "codec-topk_0.5__lr-0.1",
        "codec-topk_0.5__lr-0.05",
    ]
    assert sorted(p.name for p in root.iterdir() if (p / "config.toml").is_file()) == sorted(names)
    for name in names:
        summary = json.loads((root / name / "summary.json").read_text())
        assert summary["peers_finished"] == 2 and summary["engine"] == "sim"
    sweep = json.loads((root / "sweep.json").read_text())
    assert [v["name"] for v in sweep["variants"]] == names
    assert sweep["variants"][2]["settings"] == {"codec": "topk:0.5", "lr": 0.1}
    sent = {v["name"]: v["total_bytes_sent"] for v in sweep["variants"]}
    assert sent["codec-topk_0.5__lr-0.1"] < sent["codec-none__lr-0.1"]
    # One comparison table on the console and in report.md, a row per variant.
    rows = [line.lstrip("│ ") for line in done.stdout.splitlines()]
    assert sum(row.startswith(("none", "topk")) for row in rows) == 4
    # Its report (a table row and a timeline per variant, overlaid curves) is in
    # tests/test_report.py, on hand-written variants: the simulator gives every variant of
    # one seed and peer count the same swarm id, and the report merges them into one run.
    assert (root / "report" / "report.md").is_file()


def test_report_and_sweep_reject_bad_input_before_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    restore_logging(monkeypatch)
    runner = CliRunner()

    def fails(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 2, result.output
        return " ".join(result.stderr.split())  # rich wraps long lines

    assert "missing is not a directory" in fails("report", "missing")
    (tmp_path / "empty").mkdir()
    assert "holds no peer metrics" in fails("report", "empty")
    for torn, message in [("{", "sweep.json is not readable JSON"), ("[]", "lists no variants")]:
        (tmp_path / "empty" / "sweep.json").write_text(torn)
        assert message in fails("report", "empty")
    (tmp_path / "base.toml").write_text(BASE)
    for grid, message in [
        ("colour=red,blue", "not a config key a sweep can vary"),
        ("codec=none,bogus:1", "variant codec-bogus_1"),
        ("codec", "use KEY=VALUE1,VALUE2"),
    ]:
        assert message in fails("sweep", "base.toml", "--grid", grid, "--out", "sw")
        assert not (tmp_path / "sw").exists()
    assert "nope.toml does not exist" in fails("experiment", "nope.toml")
    (tmp_path / "latin1.toml").write_bytes(b"# J\xf6rg\npeers = 2\n")
    assert "latin1.toml is not UTF-8 text (byte 3: 0xf6)" in fails("experiment", "latin1.toml")
    for bad in ('peers = "x"\n', 'peers = 2\n[profiles.p]\npeers = "7"\n'):
        (tmp_path / "bad.toml").write_text(bad)
        assert "error:" in fails("experiment", "bad.toml", "--out", "run")
        assert not (tmp_path / "run").exists()
