"""`gossipdl report` compares runs honestly: seeds aggregated to mean ± std, legends that name
what varies, one machine's directory per swarm member merged into one run, start-up apart
from training, a sweep as one table, and summary.json says what produced it. Run directories
are written by hand (metrics lines as peers write them); the real run whose summary and report
are checked is tests/test_experiments.py's `gossipdl experiment`."""

from __future__ import annotations

import json
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from test_experiments import axes_of

from gossipdl.config import Config, ConfigError, to_toml
from gossipdl.experiments.launcher import Interrupted
from gossipdl.experiments.plots import AXES_KEY
from gossipdl.experiments.provenance import PACKAGE_DIR, git_state
from gossipdl.experiments.report import write_report
from gossipdl.experiments.summary import Run, accuracy_curve, summarize, summary_of
from gossipdl.experiments.sweep import parse_grid, plan, run_sweep
from gossipdl.rundir import RunDir, RunDirError, write_json_atomic

STEPS = 30


def fake_run(
    root: Path,
    *,
    peers: tuple[int, ...] = (0, 1),
    swarm: str | None = None,
    startup: float = 2.0,
    skill: float = 0.5,
    devices: tuple[str, ...] = ("cpu",),
    **config: Any,
) -> RunDir:
    """A finished run directory: config.toml, and per peer the lines a peer writes (a start
    line at step 0, an evaluation every 10 steps, a final line). The last peer starts
    ``startup`` seconds after the swarm did; accuracy at step s is ``skill`` + s/1000 + the
    peer's id/100; each peer sends 100 bytes a step."""
    run = RunDir(root).create()
    values = {"peers": len(peers), "dataset": "synthetic", "model": "logistic", "steps": STEPS}
    run.config.write_text(to_toml(Config(**{**values, **config, "out": str(root)})))
    for k, peer in enumerate(peers):
        lines = []
        for step in range(0, STEPS + 1, 10):
            line: dict[str, Any] = {
                "peer": peer,
                "step": step,
                "time": startup - 0.5 * k + 0.1 * step if step == 0 else startup + 0.1 * step,
                "unix_time": 1.7e9 + step,
                "loss": 1.0,
                "accuracy": skill + step / 1000 + peer / 100,
                "bytes_sent": 100 * step,
                "messages_dropped": peer,
            }
            if step == 0:
                line.update(start=True, **({"swarm": swarm} if swarm else {}))
            if step == STEPS:
                line.update(final=True, stopped_early=False, device=devices[k % len(devices)])
            lines.append(json.dumps(line) + "\n")
        run.metrics(peer).write_text("".join(lines))
    return run


def panels(path: Path) -> list[dict[str, Any]]:
    """What a PNG's panels show, from its axes chunk alone: ``axes_of`` also checks the
    picture (seconds for a wide one), done once per kind of plot."""
    with Image.open(path) as image:
        return list(json.loads(image.text[AXES_KEY]))


def table_rows(report: Path, first_cell: str) -> list[list[str]]:
    """The cells of report.md's table rows whose first cell is ``first_cell``."""
    rows = [
        [cell.strip() for cell in line.strip("|\n ").split("|")]
        for line in report.read_text().splitlines()
        if line.startswith("|")
    ]
    return [row for row in rows if row[0] == first_cell]


def test_three_seeds_are_one_group_drawn_as_a_band_and_tabled_as_mean_plus_minus_std(
    tmp_path: Path,
) -> None:
    dirs = [fake_run(tmp_path / f"s{seed}", seed=seed, skill=0.5 + 0.1 * seed) for seed in range(3)]
    files = write_report([d.root for d in dirs])
    out = tmp_path / "report-s0+s1+s2"  # several directories: next to them, named by them
    assert out / "accuracy.png" in files and out / "report.md" in files
    for panel in axes_of(out / "accuracy.png"):
        assert panel["lines"] == 1 and panel["marks"] == {"band": 1}, panel
        assert panel["legend"] == ["mean of 3 runs"]
    means = [summary_of(d)["mean_accuracy"] for d in dirs]
    (group,) = table_rows(out / "report.md", "mean of 3 runs")
    assert group[1] == "3"
    assert group[3] == f"{statistics.fmean(means):.4f} ± {statistics.stdev(means):.4f}"
    assert group[2] == "6/6"
    for seed in range(3):  # and each run on its own row, with its timeline
        (row,) = table_rows(out / "report.md", f"s{seed}")
        assert row[1] == str(seed) and "±" not in row[3]
        assert len(panels(out / f"timeline-s{seed}.png")) == 3
    # one run alone: no band, no ±
    write_report([dirs[0].root])
    assert all(p["marks"] == {} for p in panels(dirs[0].root / "report" / "accuracy.png"))
    assert "±" not in (dirs[0].root / "report" / "report.md").read_text()


def test_the_legend_names_only_the_config_keys_that_vary(tmp_path: Path) -> None:
    dirs = [
        fake_run(tmp_path / "a" / "run", codec="none", seed=0),
        fake_run(tmp_path / "b" / "run", codec="none", seed=1, host="10.0.0.1"),  # not a result
        fake_run(tmp_path / "c" / "run", codec="topk:0.5", seed=0, skill=0.3),
        fake_run(tmp_path / "d" / "run", codec="topk:0.5", seed=1, skill=0.35),
    ]
    out = tmp_path / "cmp"
    write_report([d.root for d in dirs], out)
    for panel in panels(out / "accuracy.png"):
        assert panel["legend"] == ["codec=none", "codec=topk:0.5"]
        assert panel["lines"] == 2 and panel["marks"] == {"band": 2}
    for label in ("codec=none", "codec=topk:0.5"):
        assert table_rows(out / "report.md", label)[0][1] == "2"
    # runs in folders of one name are told apart by their paths
    assert [table_rows(out / "report.md", f"{x}/run")[0][1] for x in "abcd"] == list("0101")
    # a key that changes results splits a group even with equal seeds
    fake_run(tmp_path / "e", codec="none", seed=0, lr=0.2)
    write_report([dirs[0].root, tmp_path / "e"], out)
    assert panels(out / "accuracy.png")[0]["legend"] == ["lr=0.05", "lr=0.2"]


def test_directories_of_one_swarm_are_merged_into_one_run(tmp_path: Path) -> None:
    machine_a = fake_run(tmp_path / "machine-a", peers=(0, 1), swarm="5eed", startup=1.0)
    machine_b = fake_run(tmp_path / "machine-b", peers=(2, 3), swarm="5eed", startup=3.0)
    other = fake_run(tmp_path / "other", peers=(0, 1), swarm="0ther")
    merged = summary_of(Run(machine_a, machine_b))
    assert [p["id"] for p in merged["peers"]] == [0, 1, 2, 3]
    assert merged["total_bytes_sent"] == 4 * 100 * STEPS
    assert merged["total_messages_dropped"] == 0 + 1 + 2 + 3
    assert merged["startup_s"] == 3.0  # the last peer of either machine to begin
    curve = accuracy_curve(Run(machine_a, machine_b))
    assert curve[0]["accuracy"] == pytest.approx(0.5 + (0 + 1 + 2 + 3) / 400)
    assert curve[-1]["bytes_sent"] == 4 * 100 * STEPS

    out = tmp_path / "out"
    write_report([machine_a.root, machine_b.root, other.root], out)
    report = out / "report.md"
    (row,) = table_rows(report, "machine-a+machine-b")
    assert row[2] == "4/4" and row[5] == "3.0"
    assert table_rows(report, "other")[0][2] == "2/2"
    assert not table_rows(report, "machine-a")
    timeline = panels(out / "timeline-machine-a+machine-b.png")
    assert timeline[2]["lines"] == 4  # every machine's peers on one timeline
    # one swarm alone: one run, its report in the first directory's folder's report-<names>
    write_report([machine_a.root, machine_b.root])
    merged_report = tmp_path / "report-machine-a+machine-b" / "report.md"
    assert table_rows(merged_report, "machine-a+machine-b")[0][2] == "4/4"
    # runs from before swarm ids: each directory is a run of its own
    old_a = fake_run(tmp_path / "old-a", peers=(0, 1))
    old_b = fake_run(tmp_path / "old-b", peers=(2, 3))
    write_report([old_a.root, old_b.root], out)
    assert table_rows(report, "old-a")[0][2] == table_rows(report, "old-b")[0][2] == "2/2"


def test_two_simulated_runs_of_one_config_are_two_runs(tmp_path: Path) -> None:
    """A simulated swarm's id is its config's: before and after a change, two runs of one
    config carry the same id, and the report merged them into one, the earlier lost."""
    from conftest import small_config

    from gossipdl.experiments.simulated import simulate

    for name in ("before", "after"):
        simulate(small_config(tmp_path, peers=3, steps=10, out=str(tmp_path / name)))
    write_report([tmp_path / "before", tmp_path / "after"], tmp_path / "out")
    report = tmp_path / "out" / "report.md"
    assert table_rows(report, "before") and table_rows(report, "after")
    assert not table_rows(report, "before+after")


def test_a_run_written_by_a_newer_gossipdl_is_reported_with_its_added_keys(
    tmp_path: Path,
) -> None:
    """The run directory's contract only adds keys: a config.toml with a key this version
    does not know was refused, advising to delete the record of what ran."""
    for name, value in (("old", "1"), ("new", "2")):
        run = fake_run(tmp_path / name)
        run.config.write_text(to_toml(Config()) + f"future_key = {value}\n")
    write_report([tmp_path / "old", tmp_path / "new"], tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "future_key=1" in text and "future_key=2" in text


def test_start_up_and_training_time_are_apart_in_summary_tables_and_plots(
    tmp_path: Path,
) -> None:
    run = fake_run(tmp_path / "run", startup=4.0)
    # a resumed second life's start line: the run's start-up is still its first lives'
    with run.metrics(0).open("a") as f:
        f.write(json.dumps({"peer": 0, "step": 20, "time": 50.0, "start": True}) + "\n")
        f.write(json.dumps({"peer": 0, "step": STEPS, "time": 60.0, "final": True}) + "\n")
    summary = summarize(run)
    assert summary["startup_s"] == 4.0
    assert summary["wall_time_s"] == 60.0 and summary["training_s"] == 56.0
    written = json.loads(run.summary.read_text())
    assert (written["startup_s"], written["training_s"]) == (4.0, 56.0)
    assert summarize(run, wall_time_s=70.0)["training_s"] == 66.0
    curve = accuracy_curve(run)
    assert [p["training_s"] for p in curve] == pytest.approx([p["time_s"] - 4.0 for p in curve])
    assert curve[0]["training_s"] == 0.0

    write_report([run.root])
    accuracy = panels(run.root / "report" / "accuracy.png")
    assert accuracy[1]["xlabel"] == "training time (s, start-up excluded)"
    timeline = axes_of(run.root / "report" / "timeline.png")
    assert [panel["marks"] for panel in timeline] == [{"start-up": 1}] * 3
    assert "start-up (4.0 s)" in timeline[2]["legend"]
    report = run.root / "report" / "report.md"
    (header,) = table_rows(report, "run")[:1]
    assert header[5:7] == ["start-up s", "training s"]
    (row,) = table_rows(report, "run")[1:]  # summary.json's measured wall time: 70 s
    assert row[5:7] == ["4.0", "66.0"]
    run.summary.unlink()  # none (a live run): computed from the metrics, wall = last time
    write_report([run.root])
    (row,) = table_rows(report, "run")[1:]
    assert row[5:7] == ["4.0", "56.0"]


def test_summary_json_records_what_produced_the_run(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", peers=(0, 1, 2), devices=("cuda:1", "cuda:0"))
    found = summarize(run)["provenance"]
    assert found == json.loads(run.summary.read_text())["provenance"]
    assert found["gossipdl"] == metadata.version("gossipdl")
    assert found["torch"] == torch.__version__
    assert found["python"] == platform.python_version()
    assert found["host"] == socket.gethostname()
    assert found["devices"] == ["cuda:0", "cuda:1"]
    assert found["command"] == sys.argv

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(PACKAGE_DIR), *args],
            capture_output=True,
            text=True,
        )

    head = git("rev-parse", "HEAD")
    if head.returncode == 0:  # gossipdl runs from a checkout (as in development)
        assert found["git_commit"] == head.stdout.strip()
        status = git("status", "--porcelain", "--untracked-files=no").stdout
        assert found["git_dirty"] is bool(status.strip())
    else:
        assert found["git_commit"] is None and found["git_dirty"] is None
    assert git_state(tmp_path) == (None, None)  # not a checkout


def test_a_2x2_sweep_is_reported_as_one_table_and_overlaid_plots(tmp_path: Path) -> None:
    """A sweep's directory (``run_sweep`` writing sweep.json; each variant's run written by
    hand), reported as ``gossipdl sweep`` ends: a row and a timeline per variant."""
    base = Config(peers=2, dataset="synthetic", model="logistic", steps=STEPS)
    grid = {"codec": ["none", "topk:0.5"], "lr": [0.1, 0.05]}  # as the CLI parses --grid

    def launch(config: Config) -> dict[str, Any]:
        run = fake_run(Path(config.out), codec=config.codec, lr=config.lr, skill=config.lr)
        return summarize(run)

    root = tmp_path / "sw"
    run_sweep(base, grid, root, launch)
    names = [
        "codec-none__lr-0.1",
        "codec-none__lr-0.05",
        "codec-topk_0.5__lr-0.1",
        "codec-topk_0.5__lr-0.05",
    ]
    write_report([root])
    table = (root / "report" / "report.md").read_text()
    assert all(f"| {name} |" in table for name in names)
    accuracy = axes_of(root / "report" / "accuracy.png")
    assert [(a["xlabel"], a["xscale"]) for a in accuracy] == [
        ("local steps", "linear"),
        ("training time (s, start-up excluded)", "linear"),
        ("total bytes sent by all peers (log scale)", "log"),
    ]
    assert all(a["ylabel"] == "mean test accuracy" and a["lines"] == 4 for a in accuracy)
    for name in names:
        assert len(panels(root / "report" / f"timeline-{name}.png")) == 3


def test_sweep_refuses_a_directory_that_holds_a_run_or_a_sweep(tmp_path: Path) -> None:
    base = Config(peers=2, dataset="synthetic", model="logistic", steps=STEPS)
    grid = parse_grid(["codec=none,topk:0.5"])

    def launch(config: Config) -> dict[str, Any]:
        pytest.fail(f"a variant started ({config.out}) in a directory that was refused")

    for mark, make in [
        ("sweep.json", lambda d: (d / "sweep.json").write_text('{"variants": []}')),
        ("report", lambda d: (d / "report").mkdir()),
        ("config.toml", lambda d: fake_run(d)),
        ("peers", lambda d: (d / "peers").mkdir()),
    ]:
        out = tmp_path / mark
        out.mkdir()
        make(out)
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(ConfigError, match=f"already holds a run or a sweep .*{mark}"):
            run_sweep(base, grid, out, launch)
        assert sorted(p.name for p in out.iterdir()) == before
    # a variant's directory that holds a run is refused too, before any variant starts
    fake_run(tmp_path / "fresh" / "codec-topk_0.5")
    with pytest.raises(ConfigError, match=re.escape("codec-topk_0.5 already holds")):
        plan(base, grid, tmp_path / "fresh")
    assert len(plan(base, grid, tmp_path / "new")) == 2  # an empty or missing one is fine


def test_a_sweeps_variants_write_their_csv_and_tensorboard_files_apart(tmp_path: Path) -> None:
    """Every variant's peer 0 wrote (appended to) the same ``<csv>/0.csv``: each variant's
    sinks now write below their folder, and one that holds files is refused."""
    base = Config(
        peers=2, dataset="synthetic", model="logistic", steps=STEPS,
        csv=str(tmp_path / "csv"), tensorboard=str(tmp_path / "tb"),
    )  # fmt: skip
    variants = plan(base, parse_grid(["codec=none,topk:0.5"]), tmp_path / "sw")
    assert [(c.csv, c.tensorboard) for _, _, c in variants] == [
        (str(tmp_path / "csv" / name), str(tmp_path / "tb" / name))
        for name in ("codec-none", "codec-topk_0.5")
    ]
    assert plan(base.replace(csv=""), {"lr": [0.1]}, tmp_path / "sw")[0][2].csv == ""
    (tmp_path / "csv" / "codec-none").mkdir(parents=True)
    (tmp_path / "csv" / "codec-none" / "0.csv").write_text("step\n0\n")
    with pytest.raises(ConfigError, match=r"csv = .*codec-none' already holds files"):
        plan(base, parse_grid(["codec=none"]), tmp_path / "sw")


def test_grid_values_keep_their_commas_inside_brackets_and_quotes() -> None:
    """``--grid`` split every value at each comma: ``hidden=[64,32]`` failed, and
    ``link=up=10mbit,down=10mbit`` quietly became two variants."""
    from gossipdl.config import parse_value

    grid = parse_grid(
        ["hidden=[64,32], [8]", 'link="up=10mbit,down=10mbit",none', "slowdown='3:4,2:2'",
         "codec=none,topk:0.5"]
    )  # fmt: skip
    assert {k: [parse_value(k, v) for v in vs] for k, vs in grid.items()} == {
        "hidden": [[64, 32], [8]],
        "link": ["up=10mbit,down=10mbit", "none"],
        "slowdown": ["3:4,2:2"],
        "codec": ["none", "topk:0.5"],
    }
    assert parse_grid(["hidden=64,32"]) == {"hidden": ["64", "32"]}  # two, as before


def test_an_interrupted_sweep_lists_the_variant_it_stopped_in(tmp_path: Path) -> None:
    """Ctrl-C in the second of three variants: sweep.json lists it, interrupted, with what
    its run measured (it was left out, and the report with it); a grid that names one
    variant twice is refused before anything runs (the second run hit the first's)."""
    base = Config(peers=2, dataset="synthetic", model="logistic", steps=STEPS)
    done: list[str] = []

    def launch(config: Config) -> dict[str, Any]:
        run = fake_run(Path(config.out))
        summary = summary_of(run)
        write_json_atomic(run.summary, summary)
        done.append(config.out)
        if len(done) == 2:
            raise Interrupted(signal.SIGINT)
        return summary

    with pytest.raises(Interrupted):
        run_sweep(base, {"seed": [1, 2, 3]}, tmp_path / "sw", launch)
    listed = json.loads((tmp_path / "sw" / "sweep.json").read_text())["variants"]
    assert [v["name"] for v in listed] == ["seed-1", "seed-2"] and len(done) == 2
    assert listed[1]["interrupted"] and listed[1]["peers_finished"] == 2
    with pytest.raises(ConfigError, match="variant seed-1 comes twice"):
        plan(base, {"seed": [1, 1]}, tmp_path / "dup")


def test_a_live_run_with_torn_lines_reports_what_is_complete(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "live", peers=(0, 1), swarm="11fe")
    with run.metrics(1).open("a") as f:
        f.write('{"peer": 1, "step": 31, "ti')  # being written now
    run.metrics(2).write_text('{"peer": 2, "st')  # a joiner's first line, half written
    summary = summary_of(run)
    assert [p["id"] for p in summary["peers"]] == [0, 1]
    assert summary["peers"][1]["steps"] == STEPS
    curve = accuracy_curve(run)
    assert [p["step"] for p in curve] == [0, 10, 20, 30]
    write_report([run.root])
    (row,) = table_rows(run.root / "report" / "report.md", "live")
    assert row[2] == "2/2"
    assert panels(run.root / "report" / "accuracy.png")[0]["lines"] == 1


def test_a_torn_server_counter_or_model_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    """``report`` reads a parameter server's counters and the final models (the consensus
    distance): a torn one is an error naming the file, not a traceback."""
    run = fake_run(tmp_path / "torn", peers=(0, 1), swarm="70a2")
    run.server_stats(0).parent.mkdir(exist_ok=True)
    run.server_stats(0).write_text('{"bytes_sent": 12')
    with pytest.raises(RunDirError, match=r"servers/0.json is not readable JSON .*restore it"):
        summary_of(run)
    run.server_stats(0).write_text('{"bytes_sent": 12}')
    assert summary_of(run)["server_bytes_sent"] == 12
    for peer in (0, 1):
        torch.save({"w": torch.full((3,), float(peer))}, run.model(peer))
    assert summary_of(run)["consensus_distance"] == pytest.approx(0.75)
    run.model(1).write_bytes(run.model(1).read_bytes()[:40])  # cut short
    with pytest.raises(RunDirError, match=r"models/1.pt is not a readable model .*delete it"):
        summary_of(run)
    done = subprocess.run(
        [sys.executable, "-m", "gossipdl", "report", str(run.root)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = "".join(done.stderr.split())  # rich wraps it, even inside the path
    assert done.returncode == 2 and "models/1.ptisnotareadablemodel" in said
    assert "Traceback" not in said
    # an empty file failed with an IndexError; a bare tensor or another model's with a
    # RuntimeError
    run.model(1).write_bytes(b"")
    with pytest.raises(RunDirError, match=r"models/1.pt is not a readable model \(an empty file"):
        summary_of(run)
    for saved, says in [
        (torch.ones(3), r"is not a readable model \(a Tensor, not a state_dict"),
        ({"w": torch.ones(2)}, "holds 2 parameters, the other models 3"),
    ]:
        torch.save(saved, run.model(1))
        with pytest.raises(RunDirError, match=f"models/1.pt {says}"):
            summary_of(run)


def test_the_report_names_the_neighbour_the_defences_found_wrong(tmp_path: Path) -> None:
    """A simulated swarm with one dissenting liar (peer 3) and a trimmed mean: the report's
    neighbour table and summary.json single out peer 3, and nobody else."""
    from gossipdl.experiments.simulated import simulate

    config = Config(
        peers=8, steps=60, model="mlp", hidden=[16], dataset="mnist1d", topology="exponential",
        algorithm="dense", defence="trimmed", batched=True, threads=1, eval_every=0,
        profiles={"liar": {"peers": "3", "byzantine": "dissensus"}}, out=str(tmp_path / "run"),
    )  # fmt: skip
    summary = simulate(config, step_time=0.01)
    assert summary["suspect_neighbours"] == [3]
    write_report([tmp_path / "run"], tmp_path / "report")
    rows = re.findall(
        r"^\| (\d+) \|.*\|(.*)\|$", (tmp_path / "report" / "report.md").read_text(), re.M
    )
    flagged = [int(peer) for peer, verdict in rows if "looks wrong" in verdict]
    assert flagged == [3] and len(rows) == 8
    assert not (tmp_path / "report" / "devices.png").exists()  # no device holds its own data


def test_natural_splits_get_each_devices_accuracy_worst_to_best(tmp_path: Path) -> None:
    """Six simulated devices of Synthetic(1, 1), one user each: ``devices.png`` draws their
    own-data accuracies worst to best, and the Devices table gives the worst, median and
    best of them, as summary.json has them."""
    from gossipdl.experiments.simulated import simulate

    config = Config(
        peers=6, steps=20, dataset="synthetic-fedprox:1:1:6", model="logistic", batched=True,
        partition="natural", eval_every=0, threads=1, out=str(tmp_path / "run"),
    )  # fmt: skip
    summary = simulate(config, step_time=0.01)
    own = sorted(p["own_accuracy"] for p in summary["peers"])
    assert len(set(own)) > 1
    write_report([tmp_path / "run"], tmp_path / "report")
    (panel,) = axes_of(tmp_path / "report" / "devices.png")
    assert panel["lines"] == 1 and "own test data" in panel["ylabel"]
    table = (tmp_path / "report" / "report.md").read_text().split("## Devices")[1]
    row = re.search(r"^\| run \| 6 \| (.*) \|$", table, re.M)
    assert row is not None, table
    mean, worst, _, median, best = (float(v) for v in row[1].split(" | "))
    assert (worst, median, best) == pytest.approx((own[0], own[3], own[-1]), abs=5e-5)
    assert mean == pytest.approx(statistics.fmean(own), abs=5e-5)


def test_neighbour_statistics_are_weighted_by_rounds_and_malformed_ones_skipped() -> None:
    """Two peers judged neighbour 5 over 10 and 30 rounds: its distance and share are the
    round-weighted means; an entry that is not a number is left out, not an error."""
    from gossipdl.experiments.summary import judged_neighbours

    lines = {
        0: [{"neighbours": {"5": {"rounds": 10, "distance": 1.0, "filtered": 0.0}}}],
        1: [{"neighbours": {"5": {"rounds": 30, "distance": 2.0, "filtered": 0.4},
                            "6": {"rounds": "x", "distance": 1.0, "filtered": 0.0}}}],
    }  # fmt: skip
    (row,) = judged_neighbours(lines)
    assert (row["id"], row["judged"], row["rounds"]) == (5, 2, 40)
    assert row["distance"] == pytest.approx(1.75) and row["filtered"] == pytest.approx(0.3)


def test_neighbour_statistics_add_up_every_life_of_a_restarted_peer() -> None:
    """Peer 1 judged neighbour 2 for 20 rounds, was killed and resumed from a checkpoint: its
    judge counted from 0 again (121 rounds, as in a simulated run with a fault). Both lives
    count, the peer once among the judges; only the last life's 121 rounds counted before."""
    from gossipdl.experiments.summary import judged_neighbours

    def seen(rounds: int, distance: float) -> dict[str, Any]:
        return {"neighbours": {"2": {"rounds": rounds, "distance": distance, "filtered": 1.0}}}

    lines = {1: [{"start": True}, seen(10, 100.0), seen(20, 250.0),
                 {"start": True, "resumed": True}, seen(10, 700.0), seen(121, 950.0)]}  # fmt: skip
    (row,) = judged_neighbours(lines)
    assert (row["id"], row["judged"], row["rounds"]) == (2, 1, 141)
    assert row["distance"] == pytest.approx((20 * 250.0 + 121 * 950.0) / 141)


def write_lines(run: RunDir, peer: int, lines: list[dict[str, Any]]) -> None:
    """Peer ``peer``'s metrics file, these lines, one JSON object each."""
    run.metrics(peer).write_text("".join(json.dumps({"peer": peer, **x}) + "\n" for x in lines))


def evaluation(step: int, time: float, accuracy: float, **more: Any) -> dict[str, Any]:
    """A metrics line with an evaluation; the peer has sent 10 bytes and 1 model a step."""
    return {"step": step, "time": time, "accuracy": accuracy, "bytes_sent": 10 * step,
            "model_messages_sent": step, **more}  # fmt: skip


def test_the_accuracy_curve_counts_an_absent_peer_with_its_latest_evaluation(
    tmp_path: Path,
) -> None:
    """Peer 1 is away at step 20 (it catches up its step count and skips that evaluation),
    peer 2 is killed after step 10 and peer 3 joins at step 20: a point per step any peer
    evaluated, the absent ones counted with their latest evaluation, the one not yet
    joined left out. A step some peer skipped was dropped, and the curve ended at the
    dead peer's last evaluation."""
    run = RunDir(tmp_path / "run").create()
    write_lines(run, 0, [evaluation(s, s / 10, 0.5 + s / 100) for s in (0, 10, 20, 30)])
    write_lines(run, 1, [
        evaluation(0, 0.0, 0.1), evaluation(10, 1.0, 0.2),
        {"step": 25, "time": 4.0, "bytes_sent": 250}, evaluation(30, 4.5, 0.4),
    ])  # fmt: skip
    write_lines(run, 2, [evaluation(0, 0.0, 0.3), evaluation(10, 1.1, 0.3)])
    write_lines(run, 3, [evaluation(20, 2.5, 0.9), evaluation(30, 3.0, 0.9)])
    curve = accuracy_curve(run)
    assert [p["step"] for p in curve] == [0, 10, 20, 30]
    assert [p["accuracy"] for p in curve] == pytest.approx(
        [(0.5 + 0.1 + 0.3) / 3, (0.6 + 0.2 + 0.3) / 3, (0.7 + 0.2 + 0.3 + 0.9) / 4,
         (0.8 + 0.4 + 0.3 + 0.9) / 4]
    )  # fmt: skip
    # the latest time of the peers that evaluated at the step; costs of the records counted
    assert [p["time_s"] for p in curve] == [0.0, 1.1, 2.5, 4.5]
    assert curve[2]["bytes_sent"] == 200 + 100 + 100 + 200
    assert curve[2]["messages_sent"] == 20 + 10 + 10 + 20


def test_a_restarted_peers_replay_of_earlier_steps_leaves_its_first_life_in_the_curve(
    tmp_path: Path,
) -> None:
    """Peer 1 dies after step 20 and starts again from step 0 without a checkpoint: its new
    life's evaluations at steps 0 to 20 came later, from another model, and overwrote the
    first life's, so the curve's time ran backwards; they are skipped until it passes 20."""
    run = RunDir(tmp_path / "run").create()
    write_lines(run, 0, [evaluation(s, s / 10, 0.5, start=s == 0) for s in range(0, 50, 10)])
    write_lines(run, 1, [
        evaluation(0, 0.0, 0.1, start=True), evaluation(10, 1.0, 0.2), evaluation(20, 2.0, 0.3),
        evaluation(0, 3.5, 0.05, start=True, resumed=False, down_s=1.0),
        evaluation(10, 3.6, 0.15), evaluation(20, 3.7, 0.25), evaluation(30, 3.8, 0.35),
        evaluation(40, 4.0, 0.45),
    ])  # fmt: skip
    curve = accuracy_curve(run)
    assert [p["step"] for p in curve] == [0, 10, 20, 30, 40]
    assert [p["time_s"] for p in curve] == [0.0, 1.0, 2.0, 3.8, 4.0]
    assert [p["accuracy"] for p in curve] == pytest.approx([0.3, 0.35, 0.4, 0.425, 0.475])


def test_a_killed_or_restarted_simulated_peer_keeps_the_curve_going_forward_in_time(
    tmp_path: Path,
) -> None:
    """The reviewer's runs: with peer 3 killed at 0.12 s the curve ended at step 10; with it
    restarted at 0.2 s (no checkpoint) the curve's time ran backwards."""
    from gossipdl.experiments.simulated import simulate

    kill = {"at": "0.12s", "kill": "3"}
    for name, faults in (("kill", [kill]), ("restart", [kill, {"at": "0.2s", "restart": "3"}])):
        config = Config(
            peers=4, steps=40, eval_every=10, log_every=5, dataset="synthetic", model="logistic",
            threads=1, faults=faults, out=str(tmp_path / name),
        )  # fmt: skip
        simulate(config, step_time=0.01)
        curve = accuracy_curve(RunDir(tmp_path / name))
        assert [p["step"] for p in curve] == [0, 10, 20, 30, 40], name
        times = [p["time_s"] for p in curve]
        assert times == sorted(times), (name, times)


def test_a_peer_restarted_without_its_checkpoint_counts_every_lifes_counters(
    tmp_path: Path,
) -> None:
    """A life whose start line does not say ``resumed`` counted from 0 again, and the
    summary and the curve read only the last life's: the first life's 100 bytes, its idle
    second and its drops were lost. A life resumed from a checkpoint carries them itself."""
    run = RunDir(tmp_path / "run").create()
    write_lines(run, 0, [
        evaluation(0, 0.0, 0.1, start=True),
        evaluation(10, 1.0, 0.2, idle_s=1.0, messages_dropped=2, dropped_reasons={"late": 2}),
        evaluation(0, 3.0, 0.1, start=True, resumed=False, down_s=1.0),
        evaluation(20, 5.0, 0.3, idle_s=0.5, messages_dropped=1, dropped_reasons={"late": 1}),
        evaluation(20, 7.0, 0.3, start=True, resumed=True, idle_s=0.5, messages_dropped=1),
        evaluation(30, 8.0, 0.4, idle_s=0.75, messages_dropped=1, dropped_reasons={"late": 1},
                   final=True),
    ])  # fmt: skip
    (peer,) = summary_of(run)["peers"]
    assert (peer["bytes_sent"], peer["messages_sent"], peer["idle_s"]) == (400, 40, 1.75)
    assert (peer["messages_dropped"], peer["dropped_reasons"]) == (3, {"late": 3})
    assert [p["bytes_sent"] for p in accuracy_curve(run)] == [0, 100, 300, 400]


def test_a_ps_runs_bytes_axis_holds_the_servers_bytes_as_its_total_does(
    tmp_path: Path,
) -> None:
    """Mode ps: summary.json's total has the shards' bytes (servers/<k>.json); the curve,
    accuracy.png's bytes axis, had only the workers', half of it."""
    run = RunDir(tmp_path / "run").create()
    for peer in (0, 1):
        write_lines(run, peer, [evaluation(s, s / 10, 0.5, bytes_received=12 * s)
                                for s in (0, 10, 20)])  # fmt: skip
    run.server_stats(0).parent.mkdir()
    write_json_atomic(run.server_stats(0), {"bytes_sent": 2 * 12 * 20})
    assert [p["bytes_sent"] for p in accuracy_curve(run)] == [0, 2 * 220, 2 * 440]
    assert summary_of(run)["total_bytes_sent"] == 2 * 440


def test_an_accuracy_that_is_no_number_is_skipped(tmp_path: Path) -> None:
    """A hand-edited or foreign line's ``"accuracy": "0.9"`` failed the summary with a
    TypeError; it reads as absent, as everywhere else."""
    run = RunDir(tmp_path / "run").create()
    write_lines(run, 0, [evaluation(0, 0.0, 0.5), {**evaluation(10, 1.0, 0.5), "accuracy": "0.9"},
                         {"step": 20, "time": 2.0, "own_accuracy": "x", "loss": "y"}])  # fmt: skip
    summary = summary_of(run)
    assert summary["mean_accuracy"] == 0.5
    assert (summary["peers"][0]["own_accuracy"], summary["peers"][0]["loss"]) == (None, None)


def test_two_runs_whose_names_make_one_file_name_get_a_timeline_each(tmp_path: Path) -> None:
    """``exp/seed0`` and ``exp_seed0`` both drew ``timeline-exp_seed0.png``: one replaced
    the other, and both rows linked the survivor."""
    fake_run(tmp_path / "exp" / "seed0", seed=0)
    fake_run(tmp_path / "exp_seed0", seed=1)
    write_report([tmp_path / "exp" / "seed0", tmp_path / "exp_seed0"], tmp_path / "out")
    report = tmp_path / "out" / "report.md"
    links = [table_rows(report, name)[0][-1] for name in ("exp/seed0", "exp_seed0")]
    assert links == ["![timeline](timeline-exp_seed0.png)", "![timeline](timeline-exp_seed0-2.png)"]
    assert (tmp_path / "out" / "timeline-exp_seed0-2.png").is_file()


def _away_bars(monkeypatch: pytest.MonkeyPatch, lines: dict[int, list[dict[str, Any]]]) -> list:
    """The (start, width) of the red (away) bars in a timeline's online panel."""
    from matplotlib.colors import to_rgba

    from gossipdl.experiments import plots

    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    plots.plot_timeline(lines, Path("unused.png"), "t")
    (fig,) = drawn
    bars = []
    for collection in fig.axes[0].collections:
        for path, colour in zip(collection.get_paths(), collection.get_facecolors(), strict=False):
            if tuple(colour) == to_rgba("tab:red"):
                (x0, _), (x1, _) = path.vertices.min(0), path.vertices.max(0)
                bars.append((round(float(x0), 6), round(float(x1 - x0), 6)))
    plots.pyplot().close(fig)
    return sorted(bars)


def test_the_timeline_shows_a_restarted_peers_dead_time_as_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A life restarted without its checkpoint (``resumed`` false) showed its dead time as
    online and busy: its first line's ``down_s`` is away, and the rest of the gap since the
    last line online; a later life with no ``down_s`` is away for all of the gap, and an
    offline window is away as before."""
    lines = {
        0: [{"time": 0.0, "start": True}, {"time": 1.0}, {"time": 2.0, "online": False},
            {"time": 3.0}],
        1: [{"time": 0.0, "start": True}, {"time": 1.0},
            {"time": 3.0, "start": True, "resumed": False, "down_s": 1.5}, {"time": 4.0}],
        2: [{"time": 0.0, "start": True}, {"time": 1.0}, {"time": 2.0, "start": True}],
    }  # fmt: skip
    assert _away_bars(monkeypatch, lines) == [(1.0, 1.0), (1.0, 1.0), (1.5, 1.5)]


def test_a_config_with_a_toml_datetime_is_reported_as_its_text(tmp_path: Path) -> None:
    """A key a newer gossipdl writes may be a TOML date or time, which ``json.dumps`` could not
    write: the report failed with a TypeError."""
    for name, day in (("a", "2025-01-01T00:00:00Z"), ("b", "2025-02-01")):
        run = fake_run(tmp_path / name)
        run.config.write_text(f"created = {day}\n" + run.config.read_text())
    write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "created=2025-01-01T00:00:00+00:00" in text and "created=2025-02-01" in text
    write_report([tmp_path / "a"])  # alone: nothing varies, nothing named


@pytest.mark.parametrize("key", ["time", "bytes_sent", "idle_s", "step"])
def test_a_null_counter_reads_as_absent_everywhere(tmp_path: Path, key: str) -> None:
    """A non-finite counter is written as null (json_safe): the summary, its table, the curve,
    the timeline and the live display failed on it with a TypeError."""
    import io

    from rich.console import Console

    from gossipdl.experiments.display import LiveProgress, summary_table

    run = fake_run(tmp_path / "run")
    for peer in (0, 1):
        lines = [json.loads(x) for x in run.metrics(peer).read_text().splitlines()]
        for line in lines[1:]:
            line[key] = None
        write_lines(run, peer, lines)
    summary = summary_of(run)
    Console(file=io.StringIO()).print(summary_table(summary))
    assert summary["peers"][0][{"time": "time_s", "step": "steps"}.get(key, key)] == 0
    assert accuracy_curve(run)
    write_report([run.root])
    live = LiveProgress(run, STEPS, console=Console(file=io.StringIO()))
    with live:
        live.refresh()
    assert len(live.progress.tasks) == 2
