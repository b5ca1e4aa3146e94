"""One clock for a whole run, and the same metrics lines in TensorBoard, CSV and a user hook."""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    monkeypatch.syspath_prepend(str(tmp_path))  # and the launcher, checking it first
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


HOOKS = """
import copy

seen = []

def raising(peer_id, run_dir):
    def write(line):
        seen.append(line["step"])
        if line["step"] >= 10:
            raise RuntimeError("logging server down")
    return write

def editing(peer_id, run_dir):
    def write(line):
        seen.append(copy.deepcopy(line))
        line.pop("accuracy", None)
        line["dropped_reasons"]["HOOK"] = 999
    return write
"""


@pytest.fixture
def hooks(tmp_path: Path) -> Any:
    """The module ``sinkhooks`` (HOOKS), importable by a metrics_hook spec."""
    (tmp_path / "sinkhooks.py").write_text(HOOKS)
    sys.path.insert(0, str(tmp_path))
    try:
        import sinkhooks

        yield sinkhooks
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sinkhooks", None)


def test_a_hook_that_raises_is_logged_once_and_dropped_and_training_goes_on(
    tmp_path: Path, hooks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook that raised (its logging server down) killed every peer with a traceback that
    did not name it; now one error names it, it is not called again, and the peer's log
    counts the lines it missed."""
    sinks = MetricsSinks(Config(metrics_hook="sinkhooks:raising"), RunDir(tmp_path), 2)
    with caplog.at_level(logging.WARNING, logger="gossipdl.peers.sinks"):
        for step in (0, 10, 20, 30):
            sinks.write({"peer": 2, "step": step})
        sinks.close()
    assert hooks.seen == [0, 10]
    error, missed = caplog.records
    assert error.levelno == logging.ERROR
    said = error.getMessage()
    assert "metrics_hook = 'sinkhooks:raising'" in said and "logging server down" in said
    assert "missed 3 metrics line(s)" in missed.getMessage()


def test_each_sink_gets_its_own_json_safe_copy_of_the_line(tmp_path: Path, hooks: Any) -> None:
    """A hook that edited its line edited the runner's (which then read the final line's
    accuracy: KeyError) and the other sinks'; and it got NaN where the jsonl has null."""
    config = Config(metrics_hook="sinkhooks:editing", csv=str(tmp_path / "csv"))
    sinks = MetricsSinks(config, RunDir(tmp_path), 0)
    line = {"peer": 0, "step": 5, "loss": float("nan"), "accuracy": 0.5, "dropped_reasons": {}}
    sinks.write(line)
    sinks.write(line)
    sinks.close()
    assert line["accuracy"] == 0.5 and line["dropped_reasons"] == {}
    assert hooks.seen[1] == {**line, "loss": None}
    with (tmp_path / "csv" / "0.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["accuracy"] for r in rows] == ["0.5", "0.5"] and rows[0]["loss"] == ""


def test_a_run_refuses_sink_folders_that_hold_an_earlier_runs_files(tmp_path: Path) -> None:
    """A second run with the same --csv folder appended to the first run's files (a sweep
    refused it, `run` did not); only --resume carries a peer's files on."""
    from gossipdl.experiments.launcher import fresh_run

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "0.csv").write_text("peer,step\n0,0\n")
    (tmp_path / "tb" / "peer-0").mkdir(parents=True)
    for key in ("csv", "tensorboard"):
        config = small_config(tmp_path, **{key: str(tmp_path / key[:3].replace("ten", "tb"))})
        with pytest.raises(ConfigError, match=rf"{key} = .* already holds files"):
            fresh_run(config)
        assert not (tmp_path / "run").exists()
    fresh_run(small_config(tmp_path, csv=str(tmp_path / "new")))  # an empty one will do


def test_a_hand_started_peer_refuses_its_own_files_of_an_earlier_run(tmp_path: Path) -> None:
    """Peers started by hand share their sink folders with their swarm, so the folder check
    is not theirs to make; a peer whose own file is there from another run appended its rows
    to that run's. It is refused before it listens; its swarm's files are no matter."""
    from gossipdl.peers.runner import prepare_run_dir

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "1.csv").write_text("peer,step\n1,0\n")  # another run's peer 1
    (tmp_path / "tb" / "peer-2").mkdir(parents=True)
    config = small_config(tmp_path, csv=str(tmp_path / "csv"), tensorboard=str(tmp_path / "tb"))
    prepare_run_dir(RunDir(tmp_path / "run"), config, 0, resume=False)  # peer 0: welcome
    for peer_id, name in ((1, "1.csv"), (2, "peer-2")):
        with pytest.raises(ConfigError, match=rf"already holds {name} of an earlier run"):
            prepare_run_dir(RunDir(tmp_path / "run"), config, peer_id, resume=False)
    prepare_run_dir(RunDir(tmp_path / "run"), config, 1, resume=True)  # carries its own on


def test_sink_folders_are_recorded_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative --csv stayed relative in config.toml, so a rank resumed from another
    working directory wrote its rows somewhere else."""
    from gossipdl.config import resolved, to_toml

    monkeypatch.chdir(tmp_path)
    config = resolved(Config(csv="csv", tensorboard="runs/../tb"))
    assert (config.csv, config.tensorboard) == (str(tmp_path / "csv"), str(tmp_path / "tb"))
    assert f"csv = {json.dumps(str(tmp_path / 'csv'))}" in to_toml(config)
    assert resolved(Config()).csv == ""


class Killed(BaseException):
    """Stands for a kill -9 in the middle of writing the CSV."""


def test_a_csv_is_appended_to_and_widened_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each life's first line, and each line with a new key, rewrote the whole file in place
    (open "w"): a peer killed meanwhile (churn) left it empty of its earlier rows. A row
    whose columns are known is appended; a wider header replaces the file whole."""
    config = Config(csv=str(tmp_path / "csv"))
    path = tmp_path / "csv" / "0.csv"
    first = MetricsSinks(config, RunDir(tmp_path), 0)
    for step in range(3):
        first.write({"peer": 0, "step": step, "loss": 0.5})
    first.close()

    def killed(*args: Any) -> None:
        raise Killed

    monkeypatch.setattr(csv.DictWriter, "writerows", killed)
    second = MetricsSinks(config, RunDir(tmp_path), 0)  # a new life, known columns: appends
    second.write({"peer": 0, "step": 3, "loss": 0.4})
    with pytest.raises(Killed):
        second.write({"peer": 0, "step": 4, "loss": 0.3, "final": True})  # a new column
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert [p.name for p in path.parent.iterdir()] == ["0.csv"]  # no tmp file left
    monkeypatch.undo()
    second.write({"peer": 0, "step": 4, "loss": 0.3, "final": True})
    second.close()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["final"]) for r in rows][-2:] == [("3", ""), ("4", "True")]


def test_sinks_that_cannot_work_are_refused_before_any_peer_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --csv under a file killed every peer after the swarm formed (NotADirectoryError),
    leaving a run directory; tensorboard missing read as "peer 0 did not start listening"."""
    from gossipdl.experiments.launcher import preflight

    (tmp_path / "afile").touch()
    with pytest.raises(ConfigError, match=r"csv = .*afile/sub'.*afile is a file"):
        preflight(small_config(tmp_path, csv=str(tmp_path / "afile" / "sub")))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError, match=r"tensorboard = .* needs the tensorboard package"):
        preflight(small_config(tmp_path, tensorboard=str(tmp_path / "tb")))
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
