"""Convergence: accuracy against bytes sent, dense gossip vs the compressed algorithms.

What it measures
    From one invocation, the same job run once per setting: ``peers`` processes
    (default 8), iid MNIST-1D shards, an MLP 40-1024-512-10 (571,914
    parameters, so the byte ratios reflect payloads rather than message
    headers), SGD with the config defaults and a cosine learning-rate schedule
    (``--lr-schedule constant`` for the flat one), the same number of steps
    and the same seed. Settings:

    * ``dense``: dense gossip (D-PSGD) on a ring, the uncompressed baseline;
    * ``choco-topk``, ``choco-sign``, ``choco-topk-qsgd``, ``choco-powersgd``:
      CHOCO-SGD on the ring with ``topk:0.01``, ``sign``, ``topk:0.01+qsgd:16``
      and ``powersgd:2``, each with its codec's default γ;
    * ``broadcast``: Strom's compressed broadcast, ``threshold:auto:0.005+sign``
      (the top ~0.5% of each update plus residual, as ±scale), which needs the
      complete topology.

    Each run is started with ``gossipdl.experiments.launcher.launch`` into
    ``OUT/<setting>`` (a previous run there is replaced). Per setting, from
    its run directory: the final mean test accuracy over the peers, the mean
    accuracy at half the steps, the gap to dense in points, total bytes sent
    (every frame handed to a socket, the dense first round included), the
    header bytes within them, bytes ratio vs dense, consensus distance and
    wall time. The plot ``OUT/accuracy_vs_bytes.png`` shows mean accuracy
    against total bytes sent (log x) for every setting over the run.

Target
    At least one compressed setting ends within 1 accuracy point of dense
    gossip with at least 100x fewer bytes (aim: 1000x).

Run
    python benchmarks/convergence.py --json runs/bench-convergence.json
    python benchmarks/convergence.py --only dense,broadcast --steps 1500
    python benchmarks/convergence.py --quick          # 4 peers, tiny MLP, 60 steps: a smoke test

    On a 2-core machine the defaults take about 20 minutes (six runs of 8
    processes; dense gossip moves ~110 GB through loopback).

JSON (``--json FILE``): ``{"benchmark": "convergence", "rows": [...], "meta": {...}}``;
each row has ``setting``, ``algorithm``, ``codec``, ``topology``, ``gamma``,
``accuracy``, ``half_accuracy``, ``gap_points``, ``bytes``, ``header_bytes``,
``ratio`` (dense bytes / bytes), ``consensus_distance``, ``wall_time_s``,
``peers_finished``, ``run_dir`` and ``curve`` (``step``, ``time_s``,
``bytes_sent``, ``accuracy`` points); ``meta`` holds the settings, the plot's
path, ``target`` and whether it was ``met`` (and by which settings).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_engine_option,
    add_only_option,
    add_swarm_options,
    benchmark_parser,
    fresh_run_dir,
    report,
    run_script,
    run_swarm,
)
from rich.console import Console

from gossipdl.averaging import default_gamma
from gossipdl.config import Config, load_config
from gossipdl.experiments.plots import plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.models import build_model
from gossipdl.rundir import RunDir

TARGET_POINTS, TARGET_RATIO = 1.0, 100.0
DEFAULT_STEPS, DEFAULT_HIDDEN = 3000, "1024,512"
QUICK_STEPS, QUICK_PEERS, QUICK_HIDDEN = 60, 4, "64"


@dataclass(frozen=True)
class Setting:
    """One compared run: the algorithm, its codec and the topology it needs."""

    key: str
    algorithm: str
    codec: str
    topology: str = "ring"


SETTINGS = [
    Setting("dense", "dense", "none"),
    Setting("choco-topk", "choco", "topk:0.01"),
    Setting("choco-sign", "choco", "sign"),
    Setting("choco-topk-qsgd", "choco", "topk:0.01+qsgd:16"),
    Setting("broadcast", "broadcast", "threshold:auto:0.005+sign", "complete"),
    Setting("choco-powersgd", "choco", "powersgd:2"),
]


def config_for(setting: Setting, args: argparse.Namespace) -> Config:
    """The shared job with this setting's algorithm, codec and topology."""
    return load_config(
        args.config,
        peers=args.peers,
        steps=args.steps,
        model="mlp",
        hidden=[int(w) for w in args.hidden.split(",")],
        dataset="mnist1d",
        partition="iid",
        seed=args.seed,
        lr_schedule=args.lr_schedule,
        eval_every=max(1, args.steps // 12),
        algorithm=setting.algorithm,
        codec=setting.codec,
        topology=setting.topology,
        out=str(args.out / setting.key),
    )


def run_setting(setting: Setting, config: Config, engine: str = "real") -> dict[str, Any]:
    """Launch (or simulate) one run and read its row (dense-relative columns are filled in
    later)."""
    summary = run_swarm(config, engine)
    curve = accuracy_curve(RunDir(config.out))
    half = [p["accuracy"] for p in curve if p["step"] <= config.steps // 2]
    return {
        "setting": setting.key,
        "algorithm": setting.algorithm,
        "codec": setting.codec,
        "topology": setting.topology,
        "gamma": (config.gamma or default_gamma(setting.codec))
        if setting.algorithm == "choco"
        else None,
        "accuracy": summary["mean_accuracy"],
        "half_accuracy": half[-1] if half else None,
        "bytes": summary["total_bytes_sent"],
        "header_bytes": summary["total_header_bytes_sent"],
        "consensus_distance": summary["consensus_distance"],
        "wall_time_s": summary["wall_time_s"],
        "peers_finished": summary["peers_finished"],
        "run_dir": config.out,
        "curve": curve,
    }


def parameter_count(hidden: str) -> int:
    """Parameters of the benchmarked MLP on MNIST-1D (40 inputs, 10 classes)."""
    model = build_model("mlp", (40,), 10, [int(w) for w in hidden.split(",")])
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = benchmark_parser(
        __doc__, quick=f"{QUICK_PEERS} peers, MLP {QUICK_HIDDEN}, {QUICK_STEPS} steps"
    )
    add_swarm_options(parser, "convergence", steps=f"default {DEFAULT_STEPS}")
    parser.add_argument("--hidden", default=None, help=f"MLP widths, default {DEFAULT_HIDDEN}")
    parser.add_argument(
        "--lr-schedule",
        default="cosine",
        help="cosine (default: lr anneals to 0, so every setting ends on a settled model) "
        "or constant",
    )
    add_only_option(parser, [s.key for s in SETTINGS])
    add_engine_option(parser)
    args = parser.parse_args()
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    args.peers = args.peers or (QUICK_PEERS if args.quick else 8)
    args.hidden = args.hidden or (QUICK_HIDDEN if args.quick else DEFAULT_HIDDEN)
    chosen = [s for s in SETTINGS if s.key in args.only]

    console = Console(stderr=True)
    rows = []
    for setting in chosen:
        config = config_for(setting, args)
        fresh_run_dir(Path(config.out))
        console.print(f"running {setting.key}: {setting.algorithm}, {setting.codec} …")
        rows.append(run_setting(setting, config, args.engine))

    dense = next((r for r in rows if r["setting"] == "dense"), None)
    for row in rows:
        if dense is not None and row["accuracy"] is not None and dense["accuracy"] is not None:
            row["gap_points"] = (dense["accuracy"] - row["accuracy"]) * 100
            row["ratio"] = dense["bytes"] / row["bytes"]
        else:
            row["gap_points"] = row["ratio"] = None
    winners = [
        r["setting"]
        for r in rows
        if r is not dense
        and r["gap_points"] is not None
        and r["gap_points"] <= TARGET_POINTS
        and r["ratio"] >= TARGET_RATIO
    ]
    plot = plot_curves(
        {f"{r['setting']} ({r['codec']})": r["curve"] for r in rows},
        args.out / "accuracy_vs_bytes.png",
        f"{args.peers} peers, MLP {args.hidden} on MNIST-1D, {args.steps} steps",
    )
    meta = {
        "steps": args.steps,
        "peers": args.peers,
        "model": f"mlp {args.hidden}",
        "parameters": parameter_count(args.hidden),
        "seed": args.seed,
        "lr_schedule": args.lr_schedule,
        "config": str(args.config) if args.config else None,
        "plot": str(plot),
        "target": f"within {TARGET_POINTS:g} point of dense with >= {TARGET_RATIO:g}x fewer bytes",
        "met": bool(winners),
        "met_by": winners,
    }
    columns = [
        Column("setting", "setting"),
        Column("codec", "codec"),
        Column("gamma", "γ", "{:g}"),
        Column("accuracy", "final acc", "{:.4f}"),
        Column("half_accuracy", "acc @ half", "{:.4f}"),
        Column("gap_points", "gap (pts)", "{:+.2f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("header_bytes", "of which headers", lambda v: f"{v / 1e6:,.2f} MB"),
        Column("ratio", "fewer bytes", "{:,.0f}x"),
        Column("consensus_distance", "consensus dist", "{:.3g}"),
        Column("wall_time_s", "wall s", "{:.0f}"),
        Column("peers_finished", "finished"),
    ]
    verdict = f"[green]met[/] by {', '.join(winners)}" if winners else "[red]missed[/]"
    report(
        "convergence",
        f"Convergence: {args.peers} peers, MLP {args.hidden} ({meta['parameters']:,} parameters) "
        f"on MNIST-1D, {args.steps} steps, {args.lr_schedule} lr",
        columns,
        rows,
        meta,
        args.json,
        notes=[f"target ({meta['target']}): {verdict}", f"plot: {plot}"],
    )


if __name__ == "__main__":
    run_script(main)
