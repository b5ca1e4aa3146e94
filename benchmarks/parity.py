"""Parity: does dense gossip on a ring reach the accuracy of training on one machine?

What it measures
    Two runs of the same model, data and seed, back to back:

    * ``single``: one process, all the training data, mini-batch
      ``batch_size × peers`` for ``steps`` steps (``--mode single``; see
      ``gossipdl/peers/runner.py``);
    * ``gossip``: ``peers`` processes (default 8) on a ring, dense gossip
      averaging (D-PSGD), iid shards, mini-batch ``batch_size`` each, ``steps``
      rounds.

    Both therefore see the same number of samples per step and in total. Each
    run is started with ``gossipdl.experiments.launcher.launch`` into
    ``OUT/single`` and ``OUT/gossip`` (a previous run directory there is
    replaced). Reported per run, from its ``summary.json``: mean/min/max final
    test accuracy over peers, wall time (process start to last exit, start-up
    included), total bytes sent, consensus distance (1/n) Σ ||x_i − x̄||² of the
    final models, and peers finished. Then the gap: single − gossip mean
    accuracy, in percentage points.

Target
    The gap is at most 2 points (gossip may also come out ahead).

Run
    python benchmarks/parity.py                          # cnn1d on MNIST-1D, 8 peers, 1500 steps
    python benchmarks/parity.py --quick                  # 4 peers, 100 steps: a smoke test
    python benchmarks/parity.py --json runs/bench-parity.json

    On a 2-core machine the defaults take about 1–1.5 minutes, most of it
    the 8 peer processes starting (importing torch) and training at one thread each.

JSON (``--json FILE``): ``{"benchmark": "parity", "rows": [...], "meta": {...}}``;
each row has ``setting``, ``mode``, ``processes``, ``steps``, ``batch``,
``mean_accuracy``, ``min_accuracy``, ``max_accuracy``, ``wall_time_s``,
``total_bytes_sent``, ``consensus_distance``, ``peers_finished``, ``run_dir``;
``meta`` holds the settings, ``gap_points``, ``target_points``,
``within_target`` (null when a run has no accuracy) and the environment.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_swarm_options,
    benchmark_parser,
    fill_defaults,
    fresh_run_dir,
    report,
    run_script,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config
from gossipdl.experiments.launcher import launch

TARGET_POINTS = 2.0
DEFAULT_STEPS = 1500
QUICK_STEPS, QUICK_PEERS = 100, 4


def configs(args: argparse.Namespace) -> dict[str, Config]:
    """The two runs: identical but for the mode (and, in gossip, topology and algorithm)."""
    common = dict(
        peers=args.peers,
        model=args.model,
        dataset=args.dataset,
        seed=args.seed,
        steps=args.steps,
        partition="iid",
        topology="ring",
        algorithm="dense",
    )
    return {
        "single": load_config(args.config, mode="single", out=str(args.out / "single"), **common),
        "gossip": load_config(args.config, mode="gossip", out=str(args.out / "gossip"), **common),
    }


def row(name: str, config: Config, summary: dict[str, Any]) -> dict[str, Any]:
    """One table row from a run's summary."""
    if config.mode == "single":
        setting = f"single, batch {config.batch_size * config.peers}"
    else:
        setting = f"gossip: {config.peers} peers, {config.topology}, {config.algorithm}"
    return {
        "setting": setting,
        "mode": name,
        "processes": config.processes,
        "steps": config.steps,
        "batch": config.batch_size * (config.peers if config.mode == "single" else 1),
        "mean_accuracy": summary["mean_accuracy"],
        "min_accuracy": summary["min_accuracy"],
        "max_accuracy": summary["max_accuracy"],
        "wall_time_s": summary["wall_time_s"],
        "total_bytes_sent": summary["total_bytes_sent"],
        "consensus_distance": summary["consensus_distance"],
        "peers_finished": summary["peers_finished"],
        "run_dir": config.out,
    }


def judge(single: float | None, gossip: float | None) -> tuple[float | None, bool | None]:
    """The gap (single − gossip mean accuracy, points) and whether it is within the target;
    both None when a run has no accuracy (nothing to judge: not outside the target)."""
    if single is None or gossip is None:
        return None, None
    gap = (single - gossip) * 100
    return gap, gap <= TARGET_POINTS


def main() -> None:
    parser = benchmark_parser(__doc__, quick=f"{QUICK_PEERS} peers, {QUICK_STEPS} steps")
    add_swarm_options(parser, "parity", steps=f"default {DEFAULT_STEPS}")
    parser.add_argument("--model", default="cnn1d")
    parser.add_argument("--dataset", default="mnist1d")
    args = parser.parse_args()
    fill_defaults(args, steps=(QUICK_STEPS, DEFAULT_STEPS), peers=(QUICK_PEERS, 8))

    with usage_errors(parser, args):  # both configs before the first run
        runs = configs(args)

    console = Console(stderr=True)
    rows = []
    for name, config in runs.items():
        fresh_run_dir(Path(config.out))
        console.print(f"running {name}: {config.processes} process(es), {config.steps} steps …")
        rows.append(row(name, config, launch(config, progress=False)))

    gap, within = judge(*(r["mean_accuracy"] for r in rows))
    meta = {
        "steps": args.steps,
        "peers": args.peers,
        "model": args.model,
        "dataset": args.dataset,
        "seed": args.seed,
        "config": str(args.config) if args.config else None,
        "gap_points": gap,
        "target_points": TARGET_POINTS,
        "within_target": within,
    }
    columns = [
        Column("setting", "setting"),
        Column("steps", "steps"),
        Column("mean_accuracy", "mean acc", "{:.4f}"),
        Column("min_accuracy", "min acc", "{:.4f}"),
        Column("max_accuracy", "max acc", "{:.4f}"),
        Column("wall_time_s", "wall s", "{:.1f}"),
        Column("total_bytes_sent", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("consensus_distance", "consensus dist", "{:.3g}"),
        Column("peers_finished", "finished"),
    ]
    verdict = {None: "not judged against", True: "[green]within[/]", False: "[red]outside[/]"}
    gap_text = f"{gap:+.2f} points" if gap is not None else "unknown (no accuracy)"
    report(
        "parity",
        f"Parity: {args.model} on {args.dataset}, single vs {args.peers}-peer ring gossip",
        columns,
        rows,
        meta,
        args.json,
        notes=[
            f"gap (single − gossip mean accuracy) = {gap_text} — {verdict[within]} the "
            f"{TARGET_POINTS:g}-point target"
        ],
    )


if __name__ == "__main__":
    run_script(main)
