"""Start-up: from typing `gossipdl run` to every peer's first gossip round, and the quick start.

What it measures
    Each run is ``python -m gossipdl run`` as a user types it: a fresh interpreter, so
    its imports count. For 4, 8 and 16 peers, decentralizepy's job (ring, MNIST-1D, the
    572k-parameter MLP of widths 1024 and 512, dense gossip, batch 32) for 20 steps with
    a metrics line every step: ``startup_s`` runs from just before the command starts to
    the moment the last peer has finished its first round (the ``unix_time`` of each
    peer's first metrics line whose ``syncs``, its rounds done, is at least 1). Then the
    quick start (``python -m gossipdl run`` with no arguments, the embedded default):
    ``wall_s`` (the command, start to exit) against ``train_s`` (its summary's
    ``training_s``), and its ``startup_s`` measured the same way (its peers write a line
    every 50 steps, so its first round shows late: its row's start-up is an upper bound).
    Every row also has the command's ``wall_s`` and ``train_s``.

Targets
    8 peers' first round within 3 s (one third of decentralizepy's 8–11 s start-up on the
    same job, measured side by side on a 2-core VM); the quick start's wall time at most
    2x its training time.

Run
    python benchmarks/startup.py                   # 4, 8, 16 peers and the quick start
    python benchmarks/startup.py --quick           # 4 peers, no quick start
    python benchmarks/startup.py --json runs/bench-startup.json

JSON (``--json FILE``): ``{"benchmark": "startup", "rows": [...], "meta": {...}}``; each
row has ``setting``, ``peers``, ``startup_s``, ``wall_s``, ``train_s`` and ``run_dir``;
``meta`` holds the targets and whether each was met.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import Column, benchmark_parser, fresh_run_dir, mark, peer_counts, report, run_script

from gossipdl.rundir import RunDir

FIRST_ROUND_TARGET_S = 3.0  # 8 peers
WALL_OVER_TRAIN_TARGET = 2.0  # the quick start
JOB = [
    "--topology", "ring", "--dataset", "mnist1d", "--model", "mlp", "--hidden", "1024,512",
    "--algorithm", "dense", "--batch-size", "32", "--steps", "20", "--log-every", "1",
    "--eval-every", "0",
]  # fmt: skip


def timed_run(args: list[str], out: Path) -> tuple[float, float]:
    """Run ``python -m gossipdl run ARGS --out OUT``; when it started (unix time) and how
    long it took. A stop signal here stops the command (its peers with it) first."""
    fresh_run_dir(out)
    command = [sys.executable, "-m", "gossipdl", "run", *args, "--out", str(out)]
    started, clock = time.time(), time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: SIGTERM is a run's clean stop
            proc.terminate()
            proc.wait()
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}:\n{stderr[-2000:]}")
    return started, time.perf_counter() - clock


def first_rounds(run: RunDir, peers: int) -> list[float]:
    """Each peer's unix time at its first metrics line after a round."""
    times = []
    for i in range(peers):
        after = [r["unix_time"] for r in run.records(i) if r.get("syncs", 0) >= 1]
        if not after:
            raise SystemExit(f"peer {i} of {run.root} recorded no round; see {run.log(i)}")
        times.append(after[0])
    return times


def measure(setting: str, peers: int, args: list[str], out: Path) -> dict[str, Any]:
    """One row: the command's start-up to the last peer's first round, wall and training."""
    started, wall = timed_run(args, out)
    run = RunDir(out)
    summary = json.loads(run.summary.read_text())
    return {
        "setting": setting,
        "peers": peers,
        "startup_s": max(first_rounds(run, peers)) - started,
        "wall_s": wall,
        "train_s": summary["training_s"],
        "run_dir": str(out),
    }


def main() -> None:
    parser = benchmark_parser(__doc__ or "", "4 peers, no quick start")
    parser.add_argument(
        "--peers",
        type=peer_counts,
        default=None,
        help="comma-separated, default 4,8,16 (--quick: 4)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-startup"))
    args = parser.parse_args()
    counts = args.peers or ([4] if args.quick else [4, 8, 16])
    rows = [
        measure("decentralizepy job", n, ["--peers", str(n), *JOB], args.out / f"peers-{n}")
        for n in counts
    ]
    if not args.quick:
        rows.append(measure("quick start", 4, [], args.out / "quick-start"))
    eight = next((r for r in rows if r["peers"] == 8 and r["setting"] != "quick start"), None)
    quick = next((r for r in rows if r["setting"] == "quick start"), None)
    first_met = None if eight is None else eight["startup_s"] <= FIRST_ROUND_TARGET_S
    ratio = None if quick is None else quick["wall_s"] / quick["train_s"]
    wall_met = None if ratio is None else ratio <= WALL_OVER_TRAIN_TARGET
    for row in rows:
        row["wall_over_train"] = row["wall_s"] / row["train_s"] if row["train_s"] else None
    columns = [
        Column("setting", "setting"),
        Column("peers", "peers"),
        Column("startup_s", "to every peer's first round (s)", "{:.2f}"),
        Column("wall_s", "wall (s)", "{:.2f}"),
        Column("train_s", "training (s)", "{:.2f}"),
        Column("wall_over_train", "wall / training", "{:.2f}x"),
    ]
    notes = [
        f"8 peers' first round ≤ {FIRST_ROUND_TARGET_S:g} s: {mark(first_met)}",
        f"quick start wall ≤ {WALL_OVER_TRAIN_TARGET:g}x its training: {mark(wall_met)}",
    ]
    meta = {
        "first_round_target_s": FIRST_ROUND_TARGET_S,
        "first_round_met": first_met,
        "wall_over_train_target": WALL_OVER_TRAIN_TARGET,
        "quick_start_wall_over_train": ratio,
        "wall_over_train_met": wall_met,
    }
    report("startup", "Start-up: gossipdl run to the first round", columns, rows, meta,
           args.json, notes=notes)  # fmt: skip


if __name__ == "__main__":
    run_script(main)
