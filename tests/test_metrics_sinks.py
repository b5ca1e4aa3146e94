"""One clock for a whole run, and the same metrics lines in TensorBoard, CSV and a user hook."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gossipdl_cmd, run_forked, small_config, write_config

from gossipdl.config import Config, ConfigError
from gossipdl.experiments.launcher import launch
from gossipdl.peers.sinks import MetricsSinks
from gossipdl.rundir import RunDir

HOOK = """
import json
from pathlib import Path

def sink(peer_id, run_dir):
    out = Path(run_dir) / f"hook-{peer_id}.jsonl"
    def write(line):
        with out.open("a") as f:
            f.write(json.dumps(line) + "\\n")
    return write
"""


def test_a_ps_run_has_one_clock_and_feeds_every_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker counts ``time`` from the launch (so a timeline compares them), and each
    metrics line reaches the CSV file, the TensorBoard events and the user's hook."""
    (tmp_path / "myhook.py").write_text(HOOK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker processes import the hook
    out = tmp_path / "run"
    config = small_config(
        tmp_path, mode="ps", peers=2, steps=10, tensorboard=str(tmp_path / "tb"),
        csv=str(tmp_path / "csv"), metrics_hook="myhook:sink",
    )  # fmt: skip
    summary = launch(config, progress=False)
    assert summary["peers_finished"] == 2
    run = RunDir(out)
    lines = {i: list(run.records(i)) for i in run.peer_ids()}
    assert sorted(lines) == [0, 1]
    starts = {
        line["swarm_start"] for worker in lines.values() for line in worker if "start" in line
    }
    assert len(starts) == 1  # one clock: the launcher's
    start = starts.pop()
    for worker in lines.values():
        for line in worker:  # every line's time counts from that one start
            assert abs(line["unix_time"] - line["time"] - start) < 0.01
    # A synchronous server ends step 10 only with both workers' gradients for it, sent after
    # each logged step 5: on the one clock, each worker's end comes after the other's step 5.
    at = {i: {line["step"]: line["time"] for line in worker} for i, worker in lines.items()}
    assert at[0][10] > at[1][5] and at[1][10] > at[0][5]
    assert all(worker[-1]["final"] and worker[-1]["step"] == 10 for worker in lines.values())

    for i, worker in lines.items():
        with (tmp_path / "csv" / f"{i}.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [line["step"] for line in worker]
        assert float(rows[-1]["accuracy"]) == worker[-1]["accuracy"]
        hooked = [json.loads(ln) for ln in (out / f"hook-{i}.jsonl").read_text().splitlines()]
        assert hooked == worker
        events = _scalars(tmp_path / "tb" / f"peer-{i}", "bytes_sent")
        assert events == [(line["step"], float(line["bytes_sent"])) for line in worker]


def _scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one tag, read back from TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_sinks_refuse_a_hook_that_is_not_there_or_not_a_sink(tmp_path: Path) -> None:
    (tmp_path / "badhook.py").write_text(
        "def sink(peer_id, run_dir):\n    return 3\n\ndef one(peer_id):\n    return print\n"
    )
    (tmp_path / "brokenhook.py").write_text("def sink(:\n")
    sys.path.insert(0, str(tmp_path))
    try:
        for spec, message in (
            ("badhook:sink", "returned int, not a callable"),
            ("badhook:missing", "has no attribute 'missing'"),
            ("nosuchmodule:sink", "cannot import module 'nosuchmodule'"),
            ("brokenhook:sink", "brokenhook.py:1: SyntaxError"),  # a traceback before
            ("badhook:one", "give one the signature one(peer_id, run_dir)"),  # a TypeError
        ):
            try:
                MetricsSinks(Config(metrics_hook=spec), RunDir(tmp_path), 0)
            except ConfigError as exc:
                assert message in str(exc) and spec in str(exc)
            else:
                raise AssertionError(f"{spec} was accepted")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_resumed_csv_keeps_the_first_life_and_widens_its_header(tmp_path: Path) -> None:
    config = Config(csv=str(tmp_path / "csv"))
    first = MetricsSinks(config, RunDir(tmp_path), 3)
    first.write({"peer": 3, "step": 0, "loss": None})
    first.close()
    second = MetricsSinks(config, RunDir(tmp_path), 3)
    second.write({"peer": 3, "step": 10, "loss": 0.5, "resumed": True, "dropped": {"x": 1}})
    second.write({"peer": 3, "step": 20, "loss": 0.4})
    second.close()
    with (tmp_path / "csv" / "3.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "10", "20"]
    assert rows[1]["resumed"] == "True" and rows[0]["resumed"] == ""
    assert json.loads(rows[1]["dropped"]) == {"x": 1}


def test_a_sink_that_cannot_work_stops_the_peer_before_it_listens(tmp_path: Path) -> None:
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=2))
    done = run_forked(
        "peer", "--config", str(config), "--metrics-hook", "nosuchmodule:sink",
        log=tmp_path / "peer.log", timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "listening on" not in done.stdout
    said = " ".join(done.stderr.split())
    assert "metrics_hook = 'nosuchmodule:sink': cannot import module 'nosuchmodule'" in said


PRINTER = """
def sink(peer_id, run_dir):
    def write(line):
        print("a plug-in talking on stdout " * 200, flush=True)  # 5.6 KB a line
    return write
"""


def test_a_peer_that_prints_to_stdout_runs_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing read a launched peer's stdout after its address line: 64 KB of prints (a
    plug-in's, a metrics hook's) filled the pipe and blocked the peer, and the swarm with
    it. What a peer prints goes to its log."""
    (tmp_path / "printer.py").write_text(PRINTER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    config = small_config(tmp_path, peers=2, steps=30, log_every=1, metrics_hook="printer:sink")
    command = gossipdl_cmd("run", str(write_config(tmp_path / "exp.toml", config)), "--no-progress")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the swarm stalled on its peers' stdout")
    assert proc.returncode == 0, stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["peers_finished"] == 2
    for i in (0, 1):
        assert (
            "a plug-in talking on stdout" in (tmp_path / "run" / "peers" / f"{i}.log").read_text()
        )
