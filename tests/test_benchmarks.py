"""Benchmarks stay runnable and keep their JSON keys (smoke runs; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


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


def test_codec_benchmark_reports_every_codec_with_its_keys(tmp_path: Path) -> None:
    result = run_benchmark("codecs", tmp_path, "--quick")
    rows = {row["codec"]: row for row in result["rows"]}
    assert "torch.topk 1% (reference)" in rows and "sign" in rows
    for name, row in rows.items():
        if "reference" in name:
            continue
        assert {"bytes", "ratio", "encode_ms", "decode_ms", "rel_error"} <= row.keys()
        assert row["bytes"] > 0 and row["ratio"] > 0
