"""Benchmarks stay runnable, print their tables and keep their JSON keys (smoke runs; no
timing is asserted). Swarms run as real processes where the benchmark is about them (parity,
faults, the simulate benchmark's real engine; tests/test_interrupt.py launches convergence's
for real), else on the simulator (``--engine sim``), which the scripts' numbers do not need."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, tmp_path: Path, *args: str) -> dict:
    """Run ``benchmarks/NAME.py ARGS --json FILE``: it must print its table (a row per JSON
    row) and say where it wrote the JSON, which is returned."""
    out = tmp_path / f"{name}.json"
    script = ROOT / "benchmarks" / f"{name}.py"
    done = run_script(script, *args, "--json", str(out), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == name and {"rows", "meta"} <= result.keys()
    assert "env" in result["meta"] and result["rows"]
    lines = done.stdout.splitlines()
    border = [line for line in lines if line.lstrip().startswith(("┏", "┡", "└"))]
    assert len(border) == 3, done.stdout  # the table: its top, under its header, its bottom
    assert any(line.startswith("wrote ") for line in lines), done.stdout
    return result


HELP = """
import contextlib, io, json, runpy, sys, traceback
sys.path.insert(0, sys.argv[1])  # as `python benchmarks/NAME.py` has it
found = {}
for name in sys.argv[2:]:
    sys.argv = [f"{name}.py", "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f"{sys.path[0]}/{name}.py", run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code = traceback.format_exc()
    found[name] = {"code": code, "stdout": out.getvalue()}
print(json.dumps(found))
"""


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py"))


def test_every_benchmark_explains_its_options() -> None:
    """``--help`` works (a ``%`` in a help text once crashed it) and lists the shared ones:
    each script run as ``__main__`` in turn, in one interpreter (one start-up, not ten)."""
    assert len(BENCHMARKS) >= 10
    done = subprocess.run(
        [sys.executable, "-c", HELP, str(ROOT / "benchmarks"), *BENCHMARKS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert sorted(found) == BENCHMARKS
    for name, got in found.items():
        assert got["code"] == 0, f"{name}.py --help: {got['code']}"
        assert "--quick" in got["stdout"] and "--json FILE" in got["stdout"], name
        assert got["stdout"].startswith(f"usage: {name}.py"), name


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_stops_whole_on_a_signal(name: str) -> None:
    """Each script runs under ``run_script``: SIGINT or SIGTERM ends the whole benchmark
    (tests/test_interrupt.py shows it on a swarm-launching and a process-spawning one)."""
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert source.endswith('if __name__ == "__main__":\n    run_script(main)\n')


NO_GPU = "" if torch.cuda.is_available() else "cuda"  # --device cuda: refused only without one
# script, arguments, what the usage error must say: each refused at once (exit 2, no
# traceback), before any run (the bad value of a later setting, or the verdict's, used to
# come after the earlier runs, or only as the JSON was written).
REFUSED = [
    ("transport", ["--numel", "-5"], "argument --numel: '-5': give a whole number >= 1"),
    ("transport", ["--messages", "0"], "argument --messages: '0'"),
    ("transport", ["--warmup", "-1"], "argument --warmup: '-1': give a whole number >= 0"),
    ("transport", ["--quick", "--json", "{file}/x.json"], "argument --json: "),
    ("transport", ["--quick", "--json", "{tmp}"], "is a directory; give a file name in it"),
    ("codecs", ["--numel", "0"], "argument --numel: '0'"),
    ("codecs", ["--rounds", "0"], "argument --rounds: '0'"),
    ("codecs", ["--threads", "-3"], "argument --threads: '-3'"),
    ("codecs", ["--device", "bogus"], "--device bogus: use auto, cpu, cuda[:N] or mps"),
    ("codecs", ["--device", "cuda:99"], "--device cuda:99: "),
    ("parity", ["--steps", "-5"], "argument --steps: '-5'"),
    ("parity", ["--peers", "-1"], "argument --peers: '-1'"),
    ("parity", ["--peers", "1"], "--peers: peers = 1; the gossip mode needs at least 2"),
    ("parity", ["--config", "{bad_config}"], "--config {bad_config}: lr = 'x' is a string"),
    ("convergence", ["--steps", "0"], "argument --steps: '0'"),
    ("convergence", ["--lr-schedule", "bogus"], "--lr-schedule: lr_schedule = 'bogus'"),
    ("convergence", ["--exponential-peers", "-3"], "argument --exponential-peers: '-3'"),
    ("convergence", ["--quick", "--exponential-peers", "1"], "--exponential-peers: peers = 1"),
    ("convergence", ["--hidden", "abc"], "--hidden: hidden = 'abc'"),
    ("byzantine", ["--steps", "-5"], "argument --steps: '-5'"),
    ("byzantine", ["--topologies", "bogus"], "--topologies: topology = 'bogus'"),
    ("byzantine", ["--partitions", "bogus"], "--partitions: partition = 'bogus'"),
    ("byzantine", ["--liars", "3"], "argument --liars: '3': each of [1, 2]"),
    ("faults", ["--steps", "-5"], "argument --steps: '-5'"),
    ("faults", ["--peers", "-1"], "argument --peers: '-1'"),
    ("faults", ["--quick", "--cut", "0"], "--cut 0: the seconds host 2's link is cut, > 0"),
    ("modes", ["--steps", "-5"], "argument --steps: '-5'"),
    ("modes", ["--peers", "-1"], "argument --peers: '-1'"),
    ("simulate", ["--steps", "-5"], "argument --steps: '-5'"),
    ("simulate", ["--peers", "-1"], "argument --peers: '-1'"),
    ("simulate", ["--quick", "--step-time", "bogus"], "--step-time: profile 'edge': step_time"),
    ("triggers", ["--steps", "-5"], "argument --steps: '-5'"),
    ("triggers", ["--peers", "-1"], "argument --peers: '-1'"),
    ("triggers", ["--dynamic", "dynamic:1%:10,dynamic:bogus"], "--dynamic: trigger = "),
    ("triggers", ["--dynamic", "periodic:3"], "--dynamic periodic:3: dynamic triggers only"),
    ("workloads", ["--steps", "-5"], "argument --steps: '-5'"),
    ("workloads", ["--peers", "-1"], "argument --peers: '-1'"),
    ("edge", ["--peers", "-1"], "argument --peers: '-1'"),
    ("edge", ["--delta", "bogus"], "--delta: trigger = 'dynamic:bogus'"),
    ("overhead", ["--steps", "-5"], "argument --steps: '-5'"),
    ("overhead", ["--peers", "-1"], "argument --peers: '-1'"),
    ("overhead", ["--batch-size", "0"], "argument --batch-size: '0'"),
    ("scale", ["--samples-per-peer", "-3"], "argument --samples-per-peer: '-3'"),
    ("scale", ["--device", "bogus"], "--device bogus: use auto, cpu, cuda[:N] or mps"),
    ("scale", ["--quick", "--logistic-steps", "-5"], "argument --logistic-steps: '-5'"),
    ("scale", ["--quick", "--samples-per-peer", "100000"], "--samples-per-peer: samples_per"),
    ("startup", ["--peers", "abc"], "argument --peers: 'abc': comma-separated counts >= 2"),
    ("stability", ["--rounds", "0"], "argument --rounds: '0': give a whole number >= 2"),
    ("stability", ["--rounds", "-1"], "argument --rounds: '-1'"),
    ("gpu_syncs", ["--device", "bogus"], "--device bogus: use auto, cpu, cuda[:N] or mps"),
    *(
        [
            ("codecs", ["--device", NO_GPU], "CUDA is not available here"),
            ("allreduce", ["--device", NO_GPU, "--quick"], "CUDA is not available here"),
        ]
        if NO_GPU
        else []
    ),
]


REFUSE = """
import contextlib, io, json, os, runpy, sys, traceback
scripts, cwd, cases = sys.argv[1:4]
sys.path.insert(0, scripts)  # as `python benchmarks/NAME.py` has it
found = []
for case, (name, args) in enumerate(json.loads(cases)):
    os.chdir(os.path.join(cwd, str(case)))
    sys.argv = [f"{name}.py", *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(f"{scripts}/{name}.py", run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code = traceback.format_exc()
    found.append({"code": code, "stderr": err.getvalue(), "ran": os.path.exists("runs")})
print(json.dumps(found))
"""


def test_a_benchmark_refuses_a_bad_argument_before_any_run(tmp_path: Path) -> None:
    """A usage error that names the option (exit 2, no traceback) before anything ran (no
    run directory under the default ``runs/``): every case of :data:`REFUSED` run as
    ``__main__`` in turn, in one interpreter (one start-up, not fifty)."""
    (tmp_path / "afile").touch()
    (tmp_path / "bad.toml").write_text('lr = "x"\n')
    paths = {"file": tmp_path / "afile", "tmp": tmp_path, "bad_config": tmp_path / "bad.toml"}
    cases = [(name, [arg.format(**paths) for arg in args]) for name, args, _ in REFUSED]
    for case in range(len(cases)):
        (tmp_path / str(case)).mkdir()
    done = subprocess.run(
        [sys.executable, "-c", REFUSE, str(ROOT / "benchmarks"), str(tmp_path), json.dumps(cases)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for (name, args), (_, _, says), got in zip(
        cases, REFUSED, json.loads(done.stdout), strict=True
    ):
        what = f"{name}.py {' '.join(args)}: {got['stderr']}"
        assert got["code"] == 2 and not got["ran"], f"{what} (exit {got['code']})"
        assert says.format(**paths) in got["stderr"] and "Traceback" not in got["stderr"], what
        assert got["stderr"].startswith(f"usage: {name}.py"), what


def test_json_file_is_checked_as_parsed_and_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json FILE``: a directory, a path under a file or in a directory this process may
    not write into is refused as the arguments are parsed; missing parent directories are
    created, and the file is written through a temporary one renamed into place (a stop
    halfway leaves the previous file, never half a new one)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common

    (tmp_path / "afile").touch()
    for bad, says in (
        (tmp_path, "is a directory"),
        (tmp_path / "afile" / "x.json", "is a file, not a directory"),
        (tmp_path / "afile" / "deeper" / "x.json", "is a file, not a directory"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            _common.json_file(str(bad))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere
        with pytest.raises(argparse.ArgumentTypeError, match="cannot write in"):
            _common.json_file(str(locked / "x.json"))
    target = _common.json_file(str(tmp_path / "new" / "dirs" / "x.json"))
    assert not target.parent.exists()  # created when the results are written, not before
    columns = [_common.Column("name", "name")]
    _common.report("demo", "Demo", columns, [{"name": "a"}], {"k": 1}, target)
    document = json.loads(target.read_text())
    assert document["rows"] == [{"name": "a"}] and document["meta"]["k"] == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]  # no temporary left

    def fail(source: str, destination: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _common.write_atomically(target, "{}")
    monkeypatch.undo()
    assert json.loads(target.read_text()) == document  # the previous file, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


def test_transport_benchmark_compares_with_raw_pyzmq(tmp_path: Path) -> None:
    result = run_benchmark("transport", tmp_path, "--quick")
    impls = {row["impl"]: row for row in result["rows"]}
    assert set(impls) == {"gossipdl", "raw-pyzmq"}
    for row in impls.values():
        assert row["median_ms"] > 0 and row["throughput_gbps"] > 0 and row["dropped"] == 0
    assert result["meta"]["ratio"] > 0


def test_parity_benchmark_runs_both_modes(tmp_path: Path) -> None:
    result = run_benchmark(
        "parity", tmp_path, "--quick", "--peers", "2", "--steps", "30",
        "--dataset", "synthetic", "--model", "logistic", "--out", str(tmp_path / "p"),
    )  # fmt: skip
    modes = [row["mode"] for row in result["rows"]]
    assert modes == ["single", "gossip"]
    assert all(row["mean_accuracy"] is not None for row in result["rows"])
    assert "gap_points" in result["meta"] and "within_target" in result["meta"]


def test_startup_benchmark_times_a_typed_run_to_every_peers_first_round(tmp_path: Path) -> None:
    result = run_benchmark(
        "startup", tmp_path, "--quick", "--peers", "2", "--out", str(tmp_path / "s")
    )
    (row,) = result["rows"]
    assert (row["setting"], row["peers"]) == ("decentralizepy job", 2)
    assert 0 < row["train_s"] < row["wall_s"] and 0 < row["startup_s"] < row["wall_s"]
    assert result["meta"]["first_round_met"] is None  # no 8-peer row in a quick run


def test_overhead_benchmark_compares_gossip_with_the_same_swarm_alone(tmp_path: Path) -> None:
    result = run_benchmark(
        "overhead", tmp_path, "--quick", "--only", "choco-sign", "--steps", "12",
        "--log-every", "2", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    alone, sign = result["rows"]
    assert (alone["setting"], sign["setting"]) == ("alone", "choco-sign")
    assert alone["overhead"] is None and alone["bytes_per_round"] is None
    ratio = alone["s_per_step"] / sign["s_per_step"]
    assert alone["s_per_step"] > 0 and sign["overhead"] == pytest.approx(1 - ratio)
    assert sign["bytes_per_round"] > 0 and sign["parameters"] == alone["parameters"] > 0
    assert set(result["meta"]["met"]) == {"choco-sign"}


def test_byzantine_benchmark_pits_attacks_against_defences(tmp_path: Path) -> None:
    result = run_benchmark("byzantine", tmp_path, "--quick", "--out", str(tmp_path / "b"))
    rows = {(r["attack"], r["byzantine"], r["defence"]): r for r in result["rows"]}
    assert set(rows) == {
        ("none", 0, "none"), ("none", 0, "clip"), ("scaled", 1, "none"), ("scaled", 1, "clip"),
        ("dissensus", 1, "none"), ("dissensus", 1, "clip"),
    }  # fmt: skip
    assert {"attack", "defence", "byzantine", "topology", "partition", "accuracy"} <= set(
        rows[("none", 0, "none")]
    )
    assert rows[("scaled", 1, "none")]["accuracy"] < 0.5 < rows[("scaled", 1, "clip")]["accuracy"]
    # batched, but for the swarm the scaled liar blows up: its dropped messages need per-peer
    assert {key: r["engine"] for key, r in rows.items() if r["engine"] != "batched"} == {
        ("scaled", 1, "none"): "per-peer"
    }
    assert result["meta"]["targets"]["defence_cost"]["ring/iid"]["met"] in (True, False)


def test_byzantine_benchmark_runs_every_swarm_once_per_seed(tmp_path: Path) -> None:
    """``--seeds 2``: each cell runs with seeds 0 and 1 (other shards: other accuracies),
    and the targets judge each cell's mean over them."""
    result = run_benchmark(
        "byzantine", tmp_path, "--quick", "--attacks", "dissensus", "--defences", "none,clip",
        "--seeds", "2", "--out", str(tmp_path / "b"),
    )  # fmt: skip
    cells: dict[tuple[str, int, str], dict[int, float]] = {}
    for r in result["rows"]:
        cells.setdefault((r["attack"], r["byzantine"], r["defence"]), {})[r["seed"]] = r["accuracy"]
    assert len(cells) == 4 and all(set(seeds) == {0, 1} for seeds in cells.values())
    clean, clipped = cells[("none", 0, "none")], cells[("none", 0, "clip")]
    assert clean[0] != clean[1]
    mean = (sum(clean.values()) - sum(clipped.values())) / 2 * 100
    cost = result["meta"]["targets"]["defence_cost"]["ring/iid"]["cost_points"]["clip"]
    assert cost == pytest.approx(mean) and result["meta"]["seeds"] == 2
    script = ROOT / "benchmarks" / "byzantine.py"
    done = run_script(script, "--quick", "--seeds", "0", cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "--seeds 0: at least 1" in done.stderr


def test_byzantine_benchmark_runs_its_grid_with_choco_peers(tmp_path: Path) -> None:
    """``--algorithm choco``: CHOCO top-10% peers on the batched engine (what a liar does
    to them, defended or not, is tests/test_robust.py's; that batched is the per-peer
    engine, tests/test_sim_batched.py's); each row names its algorithm, codec and engine.
    Dissensus, a model per neighbour, is refused."""
    result = run_benchmark(
        "byzantine", tmp_path, "--quick", "--algorithm", "choco", "--attacks", "scaled",
        "--defences", "clip", "--out", str(tmp_path / "b"),
    )  # fmt: skip
    rows = {(r["attack"], r["defence"]): r for r in result["rows"]}
    assert set(rows) == {("none", "clip"), ("scaled", "clip")}
    assert {(r["algorithm"], r["codec"], r["engine"]) for r in rows.values()} == {
        ("choco", "topk:0.1", "batched")
    }
    assert rows[("scaled", "clip")]["accuracy"] > 0.5 and result["meta"]["algorithm"] == "choco"
    script = ROOT / "benchmarks" / "byzantine.py"
    done = run_script(
        script, "--quick", "--algorithm", "choco", "--attacks", "dissensus", cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "CHOCO refuses it" in done.stderr


def test_byzantine_benchmark_runs_its_grid_with_beer_peers_on_the_per_peer_engine(
    tmp_path: Path,
) -> None:
    """``--algorithm beer``: BEER top-10% peers, on the per-peer engine (the batched one has
    no BEER); BALANCE keeps a scaled liar out, of the model and of the trackers."""
    result = run_benchmark(
        "byzantine", tmp_path, "--quick", "--algorithm", "beer", "--attacks", "scaled",
        "--defences", "none,balance", "--out", str(tmp_path / "b"),
    )  # fmt: skip
    rows = {(r["attack"], r["defence"]): r for r in result["rows"]}
    assert {(r["algorithm"], r["codec"], r["engine"]) for r in rows.values()} == {
        ("beer", "topk:0.1", "per-peer")
    }
    assert rows[("scaled", "none")]["accuracy"] < 0.5 < rows[("scaled", "balance")]["accuracy"]
    script = ROOT / "benchmarks" / "byzantine.py"
    done = run_script(
        script, "--quick", "--algorithm", "beer", "--attacks", "dissensus", cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "BEER refuses it" in done.stderr


def test_byzantine_benchmark_refuses_a_defence_setting_it_cannot_parse(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "byzantine.py"
    done = run_script(
        script, "--quick", "--defences", "clip,balance:0.5:0.8", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2 and "--defences: defence = 'balance:0.5:0.8'" in done.stderr
    assert "RHO is 0, off, or at least 1" in done.stderr


def test_byzantine_verdicts_count_the_defences_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A defence given by its setting (``balance:0.5:2.5``) is a defence like the named ones:
    the best one per attack and the dearest one without an attack come from the rows."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import byzantine

    def row(attack: str, liars: int, defence: str, accuracy: float) -> dict:
        return {"topology": "exponential", "partition": "iid", "attack": attack,
                "byzantine": liars, "defence": defence, "accuracy": accuracy}  # fmt: skip

    rows = [row("none", 0, "none", 0.90), row("none", 0, "balance", 0.895),
            row("none", 0, "balance:0.5:2.5", 0.885), row("label-flip", 2, "balance", 0.77),
            row("label-flip", 2, "balance:0.5:2.5", 0.89)]  # fmt: skip
    judged = byzantine.verdicts(rows)
    best = judged["best_within"]["exponential/iid"]
    assert best["gaps_points"] == {"label-flip": pytest.approx(1.0)} and best["met"]
    cost = judged["defence_cost"]["exponential/iid"]
    assert cost["cost_points"]["balance:0.5:2.5"] == pytest.approx(1.5) and not cost["met"]


def test_codec_benchmark_reports_every_codec_with_its_keys(tmp_path: Path) -> None:
    result = run_benchmark("codecs", tmp_path, "--quick")
    rows = {row["codec"]: row for row in result["rows"]}
    assert "torch.topk 1% (reference)" in rows and "sign" in rows
    assert "sign (numpy kernels)" in rows  # the fallback of a build without a C compiler
    assert "c_kernels" in result["meta"]
    for name, row in rows.items():
        if "reference" in name:
            continue
        assert {"bytes", "ratio", "encode_ms", "decode_ms", "rel_error"} <= row.keys()
        assert row["bytes"] > 0 and row["ratio"] > 0
        assert row["x_floor"] == pytest.approx(row["roundtrip_ms"] / row["floor_ms"])
    floor = result["meta"]["targets"]["within_2x_floor"]
    assert "sign" in floor["codecs"] and "topk:0.01+delta-golomb" not in floor["codecs"]
    assert floor["copy_gb_s"] > 0 and floor["met"] == (not floor["over"])


def test_convergence_benchmark_refuses_a_non_iid_setting_it_does_not_know(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "convergence.py"
    done = run_script(
        script, "--quick", "--non-iid-setting", "beer-sign,nope", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2 and "--non-iid-setting nope: choose from" in done.stderr


def test_convergence_benchmark_compares_with_dense_and_plots(tmp_path: Path) -> None:
    result = run_benchmark(
        "convergence", tmp_path, "--quick", "--peers", "2", "--exponential-peers", "4",
        "--steps", "24", "--only", "dense,choco-topk,powergossip", "--jobs", "2",
        "--non-iid-setting", "powergossip,choco-topk",
        "--out", str(tmp_path / "c"),
    )  # fmt: skip
    rows = {(row["topology"], row["setting"], row["partition"]): row for row in result["rows"]}
    ring = [("ring", s, "iid") for s in ("dense", "choco-topk", "powergossip")]
    exponential = [("exponential", s, "iid") for s in ("dense", "choco-topk", "powergossip")]
    non_iid = [("ring", s, "dirichlet:0.1") for s in ("choco-topk", "powergossip")]
    assert list(rows) == [*ring, *exponential, *non_iid]
    for topology in ("ring", "exponential"):
        dense = rows[(topology, "dense", "iid")]
        assert dense["ratio"] == 1.0 and dense["gap_points"] == 0.0
        assert dense["ratio_to_target"] == 1.0 and dense["bytes_to_target"] <= dense["bytes"]
        # top-1% of a 3,274-parameter MLP: far fewer bytes than dense, headers counted apart.
        assert rows[(topology, "choco-topk", "iid")]["ratio"] > 3
    assert rows[("exponential", "dense", "iid")]["peers"] == 4
    delta = 33 / 3274  # top-1% of 3,274 values; a ring of 2 keeps W_ii = 1/2
    assert rows[("ring", "choco-topk", "iid")]["gamma"] == pytest.approx(
        min(delta**0.5 / 2, 2 * delta**0.85)
    )
    for row in rows.values():
        assert 0 < row["header_bytes"] < row["bytes"]
        assert row["peers_finished"] == row["peers"] and row["accuracy"] is not None
        assert [p["step"] for p in row["curve"]] == list(range(25))  # an evaluation a step
        reached = row["bytes_to_target"]
        assert reached is None or reached in [p["bytes_sent"] for p in row["curve"]]
    assert set(result["meta"]["targets"]) and all(
        {"met", "by"} == t.keys() for t in result["meta"]["targets"].values()
    )
    plots = result["meta"]["plots"]
    assert list(plots) == ["ring", "exponential"] and result["meta"]["plot"] == plots["ring"]
    for path in plots.values():
        png = Path(path).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_stability_benchmark_finds_a_critical_step_above_the_automatic_one(tmp_path: Path) -> None:
    result = run_benchmark("stability", tmp_path, "--quick")
    (row,) = result["rows"]
    assert (row["codec"], row["graph"], row["peers"]) == ("topk:0.01", "ring", 8)
    assert row["self_weight"] == pytest.approx(1 / 3)
    assert 0 < row["auto_gamma"] < row["critical_gamma"] < 1  # a margin, measured
    assert row["ratio"] == pytest.approx(row["auto_gamma"] / row["critical_gamma"])
    assert result["meta"]["margin"]["met"] and result["meta"]["rounds"] == 300


def test_stability_quick_keeps_only_and_a_target_without_its_rows_is_not_run(
    tmp_path: Path,
) -> None:
    """``--quick --only sign``: the sign row, not --quick's top-1% (``--quick`` dropped
    ``--only``); the top-k target has no row to judge, so it is not run (null), not met."""
    result = run_benchmark("stability", tmp_path, "--quick", "--only", "sign", "--rounds", "20")
    assert [(r["codec"], r["graph"], r["peers"]) for r in result["rows"]] == [("sign", "ring", 8)]
    assert result["meta"]["slowest"] == {"met": None} and result["meta"]["rounds"] == 20
    assert result["meta"]["margin"]["met"] in (True, False)
    stdout = (tmp_path / ".stability.stdout").read_text()
    assert "target (top-k's auto γ >= 0.1 γ*): not run" in stdout


def test_parity_does_not_judge_a_gap_it_could_not_measure(monkeypatch) -> None:
    """A run without an accuracy leaves the gap unknown: not judged (null), not outside."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import parity

    assert parity.judge(None, 0.9) == parity.judge(0.9, None) == (None, None)
    gap, within = parity.judge(0.90, 0.89)
    assert gap == pytest.approx(1.0) and within is True
    assert parity.judge(0.90, 0.85)[1] is False


def test_triggers_benchmark_counts_transmissions_and_plots_the_drift(tmp_path: Path) -> None:
    result = run_benchmark(
        "triggers", tmp_path, "--quick", "--engine", "sim", "--peers", "2", "--steps", "40",
        "--only", "always,periodic:10,periodic:50", "--dynamic", "dynamic:1%:10",
        "--out", str(tmp_path / "t"),
    )  # fmt: skip
    rows = {row["trigger"]: row for row in result["rows"]}
    fixed = ["always", "periodic:10", "periodic:50"]
    assert list(rows) == [*fixed, "dynamic:1%:10"]
    for row in rows.values():
        assert {"trigger", "accuracy", "transmissions", "bytes"} <= row.keys()
        assert row["accuracy"] is not None
        # virtual time too short for a heartbeat: no model sent, no byte sent
        assert (row["bytes"] > 0) == (row["transmissions"] > 0)
    # Two peers (one edge) send one model each per round: 40 rounds, 4 and none.
    assert [rows[t]["transmissions"] for t in fixed] == [80, 8, 0]
    assert rows["periodic:10"]["fewer_than_periodic10"] == 1.0
    assert rows["dynamic:1%:10"]["transmissions"] <= rows["periodic:10"]["transmissions"]
    assert set(result["meta"]["drift"]) == {"periodic:10", "dynamic:1%:10"}
    png = Path(result["meta"]["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_allreduce_benchmark_compares_shared_memory_and_the_ring_with_gloo(
    tmp_path: Path,
) -> None:
    result = run_benchmark("allreduce", tmp_path, "--quick")
    rows = {row["impl"]: row for row in result["rows"]}
    assert set(rows) == {"gossipdl", "gossipdl-tcp", "gloo"} and len(result["rows"]) == 3
    for row in rows.values():
        assert {"impl", "procs", "numel", "median_ms", "times_ms", "correct"} <= row.keys()
        assert (row["procs"], row["numel"]) == (2, 100_000) and len(row["times_ms"]) == 3
        assert row["correct"] is True and row["median_ms"] > 0
    assert rows["gossipdl"]["ratio"] > 0 and rows["gossipdl-tcp"]["ratio"] > 0
    assert {"target", "met"} <= result["meta"].keys()


def test_modes_benchmark_runs_ring_and_ps_side_by_side(tmp_path: Path) -> None:
    result = run_benchmark(
        "modes", tmp_path, "--quick", "--engine", "sim", "--only", "ring,ps-async-ssp"
    )
    rows = {row["setting"]: row for row in result["rows"]}
    assert set(rows) == {"ring", "ps-async-ssp"}
    for row in rows.values():
        assert row["peers_finished"] == 3 and 0.5 < row["accuracy"] <= 1
        assert row["bytes"] > 0 and row["wall_time_s"] > 0
    assert rows["ps-async-ssp"]["server_bytes"] > 0 and rows["ring"]["server_bytes"] == 0


def test_faults_benchmark_kills_peers_and_reports_recovery(tmp_path: Path) -> None:
    result = run_benchmark(
        "faults", tmp_path, "--quick", "--loopback", "--only", "baseline,kill,partition",
        "--steps", "300",
    )  # fmt: skip
    rows = {row["scenario"]: row for row in result["rows"]}
    assert set(rows) == {"baseline", "kill", "partition"}
    for key in ("peers_finished", "accuracy", "gap", "recovery_s"):
        assert key in rows["baseline"] and key in rows["kill"]
    assert rows["baseline"]["peers_finished"] == 4 and rows["kill"]["peers_finished"] == 2
    assert rows["kill"]["declared_dead"] >= 1 and rows["kill"]["recovery_s"] > 0
    assert rows["partition"]["skipped"] == "--loopback"


def test_edge_benchmark_times_each_setting_to_the_target(tmp_path: Path) -> None:
    result = run_benchmark(
        "edge", tmp_path, "--quick", "--engine", "sim", "--only", "choco,ring,ps",
        "--no-progress", "--budget", "6", "--out", str(tmp_path / "e"),
    )  # fmt: skip
    rows = {row["setting"]: row for row in result["rows"]}
    assert set(rows) == {"CHOCO top-1%", "ring all-reduce (dense)", "ps sync (dense)"}
    for row in rows.values():
        assert {"setting", "reached", "time_to_target_s", "bytes"} <= set(row)
        assert row["bytes"] > 0 and row["steps"] > 0
        assert row["reached"] == (row["time_to_target_s"] is not None)
        assert not row["reached"] or 0 < row["time_to_target_s"] <= row["wall_time_s"]
    # 10 Mbit/s links, simulated seconds: a dense model costs the ring more time per step
    assert rows["ring all-reduce (dense)"]["s_per_step"] > rows["CHOCO top-1%"]["s_per_step"]
    assert result["meta"]["best"] == "CHOCO top-1%" or not rows["CHOCO top-1%"]["reached"]
    assert (tmp_path / "e" / "edge.png").stat().st_size > 10_000


def test_edge_takes_a_target_reached_at_the_start_and_a_target_of_zero(tmp_path: Path) -> None:
    """A setting at the target by its first evaluation (0 s) divided by zero and lost every
    row; ``--target 0`` and ``--budget 0`` were taken as not given."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        edge = runpy.run_path(str(ROOT / "benchmarks" / "edge.py"))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [
        {"setting": "CHOCO top-1%", "reached": True, "time_to_target_s": 0.0},
        {"setting": "ring all-reduce (dense)", "reached": True, "time_to_target_s": 3.0},
    ]
    best, speedup, _ = edge["speedup_vs_ring"](rows, 20.0)
    assert best is rows[0] and speedup is None
    assert edge["options"](["--quick", "--target", "0"]).target == 0.0
    with pytest.raises(SystemExit):
        edge["options"](["--quick", "--budget", "0"])


def test_simulate_benchmark_runs_both_engines_the_scale_case_and_the_edge_settings(
    tmp_path: Path,
) -> None:
    """One invocation, three cases: ``choco`` by both engines, ``scale`` simulated, and
    ``speed``: the edge settings simulated against what ``edge.py --quick --json`` would
    have written (made up here: the real runs take minutes even quick)."""
    names = ["CHOCO top-1%", "ring all-reduce (dense)", "ps sync (dense)", "dense gossip"]
    real = {
        "benchmark": "edge",
        "meta": {"peers": 3, "target": 0.6, "budget_s": 20.0, "seed": 0, "quick": True,
                 "link": "up=10mbit,down=10mbit,latency=20ms"},
        "rows": [{"setting": name, "reached": True, "time_to_target_s": 1.0 + k, "bytes": 1e6,
                  "steps": 20, "final_accuracy": 0.7, "wall_time_s": 100.0, "run_dir": "x"}
                 for k, name in enumerate(names)],
    }  # fmt: skip
    recorded = tmp_path / "edge.json"
    recorded.write_text(json.dumps(real))
    result = run_benchmark(
        "simulate", tmp_path, "--quick", "--cases", "choco,scale,speed", "--peers", "2",
        "--steps", "20", "--scale-peers", "6", "--scale-steps", "10",
        "--real-edge-json", str(recorded), "--out", str(tmp_path / "s"),
    )  # fmt: skip
    rows = result["rows"]
    assert [(row["case"], row["engine"], row.get("setting")) for row in rows] == [
        ("choco", "real", None), ("choco", "sim", None), ("scale", "sim", None),
        *(("speed", "real", name) for name in names),
        *(("speed", "sim", name) for name in names),
    ]  # fmt: skip
    keys = {"case", "engine", "peers", "accuracy", "bytes", "time_to_target_s", "wall_s",
            "peak_rss_mb"}  # fmt: skip
    for row in rows:
        assert keys <= row.keys()
        assert row["bytes"] > 0 and row["wall_s"] > 0
        assert (row["peak_rss_mb"] is not None) == (row["engine"] == "sim")
    for row in rows[:3]:
        assert row["accuracy"] is not None
    assert rows[0]["peers"] == rows[1]["peers"] == 2
    assert rows[2]["peers"] == 6 and rows[2]["peak_rss_mb"] > 0
    choco = result["meta"]["fidelity"]["choco"]
    assert {"accuracy_gap_points", "bytes_ratio", "accuracy_within_1_point",
            "bytes_within_1pct", "met"} <= choco.keys()  # fmt: skip
    assert {"under_20_min", "under_6_gb", "met"} <= result["meta"]["scale"].keys()
    for row in rows[3:]:
        assert row["case"] == "speed" and row["peers"] == 3
    speed = result["meta"]["speed"]
    assert speed["real"]["ranking"] == names and speed["real"]["choco_vs_ring"] == 2.0
    assert speed["wall_ratio"] == 400.0 / speed["sim"]["wall_s"]
    assert {"same_ranking", "wall_20x_less", "met"} <= speed.keys()


def test_simulate_benchmark_refuses_a_recorded_edge_run_of_other_settings(tmp_path: Path) -> None:
    recorded = tmp_path / "edge.json"
    recorded.write_text(json.dumps({"benchmark": "edge", "meta": {"peers": 3}, "rows": []}))
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "simulate.py"), "--cases", "speed",
         "--real-edge-json", str(recorded), "--out", str(tmp_path / "t")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode != 0 and "was run with peers = 3, the simulation runs 8" in bad.stderr
    assert not (tmp_path / "t").exists()


def test_scale_benchmark_times_both_simulators_and_plots_seconds_per_step(
    tmp_path: Path,
) -> None:
    result = run_benchmark(
        "scale", tmp_path, "--peers", "4", "--unbatched-up-to", "4", "--only", "choco-topk",
        "--topologies", "exponential", "--cnn-steps", "6", "--logistic-steps", "6",
        "--samples-per-peer", "40", "--out", str(tmp_path / "scale"),
    )  # fmt: skip
    rows = result["rows"]
    keys = [(r["peers"], r["model"], r["engine"]) for r in rows]
    assert keys == [
        (4, "cnn1d", "batched"), (4, "cnn1d", "per-peer"),
        (4, "logistic", "batched"), (4, "logistic", "per-peer"),
    ]  # fmt: skip
    for row in rows:
        assert row["s_per_step"] == pytest.approx(row["wall_s"] / 6)
        assert row["peak_rss_mb"] > 50 and 0 <= row["accuracy"] <= 1 and row["bytes"] > 0
    batched, per_peer = rows[0], rows[1]
    assert batched["bytes"] == pytest.approx(per_peer["bytes"], rel=0.02)  # the same messages
    targets = result["meta"]["targets"]
    assert targets["cnn_1000"]["met"] is None and targets["speedup"]["met"] is None  # not run
    png = Path(result["meta"]["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_gpu_syncs_benchmark_runs_every_setting_through_real_rounds(tmp_path: Path) -> None:
    """On a CPU the audit's path runs (rounds end, models move); there is no sync to count."""
    result = run_benchmark("gpu_syncs", tmp_path, "--quick", "--device", "cpu")
    assert [row["setting"] for row in result["rows"]] == list(result["meta"]["placement"])
    assert all(row["per_step"] == 0.0 and row["site"] == "-" for row in result["rows"])
    placement = result["meta"]["placement"]
    assert placement["choco-topk"]["averager.x_hat"] == placement["dense"]["model"] == "cpu"


def test_workloads_benchmark_measures_what_it_has_and_names_what_it_lacks(tmp_path: Path) -> None:
    result = run_benchmark(
        "workloads", tmp_path, "--quick", "--engine", "sim", "--peers", "4",
        "--only", "cifar10-resnet20,fedprox-logistic", "--data-dir", str(tmp_path / "none"),
        "--out", str(tmp_path / "w"),
    )  # fmt: skip
    rows = {(r["workload"], r["setting"]): r for r in result["rows"]}
    assert len(rows) == 4
    for setting in ("dense", "choco-topk"):
        lacking, made = rows[("cifar10-resnet20", setting)], rows[("fedprox-logistic", setting)]
        assert lacking["s_per_step"] is None and "gossipdl data fetch cifar10" in lacking["skipped"]
        assert made["skipped"] is None and made["s_per_step"] > 0 and made["parameters"] == 610
    dense, choco = rows[("fedprox-logistic", "dense")], rows[("fedprox-logistic", "choco-topk")]
    assert choco["bytes_per_round"] < dense["bytes_per_round"] / 5


def test_convergence_divergence_verdict_needs_a_ring_run_not_dense(monkeypatch) -> None:
    """Without dense (``--only``) the other targets cannot be judged, but whether a ring run
    diverged can; with no ring run at all nothing is claimed met. A run whose models end
    far apart diverged even if it still predicts, and its non-IID row meets nothing."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import convergence

    def row(
        setting: str,
        accuracy: float,
        topology: str = "ring",
        distance: float = 0.5,
        partition: str = "iid",
        gap: float | None = None,
    ) -> dict:
        return {"setting": setting, "name": setting, "topology": topology,
                "partition": partition, "accuracy": accuracy, "gap_points": gap,
                "ratio_to_target": None, "consensus_distance": distance}  # fmt: skip

    key = next(k for k in convergence.verdicts([]) if "diverged" in k)
    assert convergence.verdicts([])[key] is None  # not run
    assert convergence.verdicts([row("exponential-only", 0.6, "exponential")])[key] is None
    assert convergence.verdicts([row("choco-topk", 0.6), row("beer-topk", 0.6)])[key] == [
        "all 2 ring runs"
    ]
    assert convergence.verdicts([row("choco-topk", 0.6), row("beer-topk", 0.05)])[key] == []
    drifted = row("beer-sign", 0.68, distance=1.2e5)
    assert convergence.verdicts([row("choco-topk", 0.6), drifted])[key] == []
    non_iid = next(k for k in convergence.verdicts([]) if "non-IID" in k)
    for distance, met in ((0.56, ["beer-sign"]), (1.2e5, [])):
        shards = row("beer-sign", 0.677, distance=distance, partition="dirichlet:0.1", gap=0.0)
        rows = [row("beer-sign", 0.687, gap=-1.0), shards]
        assert convergence.verdicts(rows)[non_iid] == met


def test_a_target_whose_runs_were_left_out_is_not_run_not_missed(monkeypatch) -> None:
    """``--only dense`` on the ring: the targets on the other settings were reported missed
    (``met`` false), as if they had run and failed; they are not run (None), as in the
    other benchmarks. The edge benchmark's speedup without the ring or any gossipdl
    setting likewise."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import convergence
    import edge

    dense = {"setting": "dense", "name": "dense", "topology": "ring", "partition": "iid",
             "accuracy": 0.6, "gap_points": 0.0, "ratio_to_target": 1.0,
             "consensus_distance": 0.1}  # fmt: skip
    judged = convergence.verdicts([dense])
    assert [by for name, by in judged.items() if "diverged" not in name] == [None] * 4
    assert next(by for name, by in judged.items() if "diverged" in name) == ["all 1 ring runs"]
    choco = {**dense, "setting": "choco-topk", "gap_points": 5.0, "ratio_to_target": 2.0}
    judged = convergence.verdicts([dense, choco])
    assert [by for name, by in judged.items() if "non-IID" not in name] == [
        [], [], [], ["all 2 ring runs"]
    ]  # fmt: skip

    def ran(setting: str, seconds: float | None) -> dict:
        return {"setting": setting, "reached": seconds is not None, "time_to_target_s": seconds}

    gossip, ring = ran("CHOCO top-1%", 2.0), ran("ring all-reduce (dense)", 4.0)
    ps = ran("ps sync (dense)", 1.0)
    for rows in ([gossip], [ring, ps], [ps]):
        assert edge.speedup_met(rows, edge.speedup_vs_ring(rows, 20.0)[1]) is None
    assert edge.speedup_met([gossip, ring], 2.0) is False
    assert edge.speedup_met([ran("CHOCO top-1%", None), ring], None) is False  # ran, missed
    assert edge.speedup_met([gossip, ring], edge.TARGET_SPEEDUP) is True


def test_byzantine_target_without_its_rows_says_not_run(monkeypatch) -> None:
    """``--liars 1`` (as ``--quick`` has it) has no gap with 2 liars to judge: the target is
    not run (null in the JSON, a line saying so under the table), not left out silently."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import byzantine

    def row(attack: str, liars: int, defence: str, accuracy: float) -> dict:
        return {"topology": "ring", "partition": "iid", "attack": attack, "byzantine": liars,
                "defence": defence, "accuracy": accuracy}  # fmt: skip

    judged = byzantine.verdicts(
        [row("none", 0, "none", 0.9), row("none", 0, "clip", 0.895), row("scaled", 1, "clip", 0.8)]
    )
    assert judged["best_within"] is None and judged["defence_cost"]["ring/iid"]["met"]
    (line,) = byzantine.verdict_lines("best defence within 2 pts", judged["best_within"], str)
    assert line.startswith("best defence within 2 pts — not run")
    lines = byzantine.verdict_lines("cost", judged["defence_cost"], lambda v: "detail")
    assert lines == ["ring/iid: cost — [green]met[/] (detail)"]


def test_byzantine_reference_runs_the_liars_killed_at_the_start(monkeypatch) -> None:
    """The ``absent`` line kills the two liars at time 0 on the per-peer engine; it is
    reported beside the targets, never judged as an attack."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import argparse

    import byzantine

    args = argparse.Namespace(
        config=None, peers=16, dataset="synthetic", model="logistic", steps=10, seed=0, seeds=1,
        engine="batched", out=Path("/nonexistent"), defences=["none"], liars=[1, 2],
        attacks=["alie"], topologies=["ring"], partitions=["iid"], algorithm="dense",
        codec="none",
    )  # fmt: skip
    runs = byzantine.grid(args)
    absent = [r for r in runs if r.attack == byzantine.ABSENT]
    assert [(r.defence, r.byzantine) for r in absent] == [("none", 2)]
    config = byzantine.config_for(args, absent[0])
    assert not config.batched and not config.profiles
    assert config.faults == [{"at": 0, "kill": "3,11"}]
    small = byzantine.config_for(argparse.Namespace(**{**vars(args), "peers": 8}), absent[0])
    assert small.faults == [{"at": 0, "kill": "3,7"}]  # spread over any swarm, inside it
    for peers in range(4, 17):
        ids = [int(i) for i in byzantine.liar_ids(2, peers).split(",")]
        assert len(set(ids)) == 2 and max(ids) < peers

    def row(attack: str, liars: int, defence: str, accuracy: float) -> dict:
        return {"topology": "ring", "partition": "iid", "attack": attack, "byzantine": liars,
                "defence": defence, "accuracy": accuracy}  # fmt: skip

    judged = byzantine.verdicts(
        [row("none", 0, "none", 0.9), row("none", 0, "clip", 0.9), row("absent", 2, "none", 0.85),
         row("alie", 2, "none", 0.8), row("alie", 2, "clip", 0.89)]
    )  # fmt: skip
    assert judged["best_within"]["ring/iid"]["gaps_points"] == pytest.approx({"alie": 1.0})
    assert judged["absent"]["ring/iid"] == pytest.approx(
        {"accuracy": 0.85, "below_clean_points": 5.0}
    )
