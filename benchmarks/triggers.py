"""Triggers: how often must peers talk? Always, every H steps, or when their model has drifted.

What it measures
    Part 1, from one invocation: the same job once per trigger — ``peers``
    processes (default 8) on a complete graph, iid MNIST-1D shards, the 1-D
    CNN, dense gossip, the same steps and seed — with ``always``,
    ``periodic:{5,10,20,50}`` and ``dynamic:Δ%:10`` for several Δ (relative to
    ‖r‖², checked every 10 steps, the same points at which ``periodic:10``
    syncs). On a complete graph a sync is the exact average, the setting of
    Kamp et al. 2018 (``--topology ring`` to see a sparse graph, where one
    sync is one gossip step and disagreement outlives it). Per trigger, from
    its run directory: final mean test accuracy, model transmissions (every
    model-carrying message; the dynamic trigger's few-byte ``quiet`` votes
    are not transmissions but are in the bytes), total bytes, and how many
    times fewer transmissions than ``periodic:10``.

    Part 2, concept drift: at half the steps the labels of every peer go
    through one permutation (``--drift STEP:permute``). ``periodic:10`` and
    the dynamic setting that met the target (else the one that sent the
    fewest models, where staying quiet and reacting are easiest to see) run
    again; the plot ``OUT/drift.png`` shows mean accuracy and cumulative
    transmissions over the steps around the drift (Kamp et al. 2018: the
    dynamic trigger syncs more right after it).

Target
    A dynamic setting ends within 0.5 accuracy points of ``periodic:10``
    with at least 5x fewer transmissions (aim: 10x).

Run
    python benchmarks/triggers.py --json runs/bench-triggers.json
    python benchmarks/triggers.py --quick       # 3 peers, 60 steps, synthetic data: a smoke test
    python benchmarks/triggers.py --only always,periodic:10 --dynamic dynamic:1%:10

    On a 2-core machine the defaults take about 5 minutes (eleven runs of 8 processes).

JSON (``--json FILE``): ``{"benchmark": "triggers", "rows": [...], "meta": {...}}``;
each row has ``trigger``, ``accuracy``, ``transmissions``, ``bytes``,
``fewer_than_periodic10``, ``gap_points`` (periodic:10 − this), ``syncs``
(rounds a peer took part in, summed), ``wall_time_s``, ``run_dir``; ``meta``
holds the settings, ``target``, ``met`` / ``met_by``, the plot's path and
``drift`` (per trigger: accuracy just before the drift, at its lowest after
it, at the end, and transmissions in the 10% of steps after the drift vs the
10% before it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_engine_option,
    add_only_option,
    add_swarm_options,
    benchmark_parser,
    fill_defaults,
    fresh_run_dir,
    mark,
    report,
    run_script,
    run_swarm,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config
from gossipdl.experiments.plots import Panel, plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.rundir import RunDir

TARGET_POINTS, TARGET_FEWER = 0.5, 5.0
REFERENCE = "periodic:10"
TRIGGERS = ["always", "periodic:5", REFERENCE, "periodic:20", "periodic:50"]
DYNAMIC = [f"dynamic:{d}%:10" for d in ("0.4", "1.6", "3.2", "6.4")]


def config_for(trigger: str, args: argparse.Namespace, name: str, **extra: Any) -> Config:
    """The shared job with ``trigger``, writing to ``OUT/name``."""
    return load_config(
        args.config,
        peers=args.peers,
        steps=args.steps,
        dataset=args.dataset,
        model=args.model,
        topology=args.topology,
        algorithm="dense",
        partition="iid",
        seed=args.seed,
        trigger=trigger,
        out=str(args.out / name),
        **extra,
    )


def run(config: Config, engine: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Launch (or simulate) one run into a fresh directory; its summary and accuracy curve."""
    fresh_run_dir(Path(config.out))
    summary = run_swarm(config, engine)
    return summary, accuracy_curve(RunDir(config.out))


def _name(trigger: str) -> str:
    """A run directory's name for ``trigger``: ``dynamic:1%:10`` -> ``dynamic-1pct-10``."""
    return trigger.replace(":", "-").replace("%", "pct")


def drift_figures(curve: list[dict[str, float]], step: int, window: int) -> dict[str, Any]:
    """Accuracy around the drift and transmissions just before vs just after it."""

    def sent_at(s: float) -> float:
        return max((p["messages_sent"] for p in curve if p["step"] <= s), default=0.0)

    before = [p["accuracy"] for p in curve if p["step"] <= step]
    after = [p["accuracy"] for p in curve if p["step"] > step]
    return {
        "accuracy_before": before[-1] if before else None,
        "accuracy_lowest_after": min(after, default=None),
        "accuracy_final": curve[-1]["accuracy"] if curve else None,
        "transmissions_before": sent_at(step) - sent_at(step - window),
        "transmissions_after": sent_at(step + window) - sent_at(step),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, quick="3 peers, 60 steps, synthetic data")
    add_swarm_options(parser, "triggers", steps="default 1500")
    parser.add_argument("--model", default=None, help="default cnn1d")
    parser.add_argument("--dataset", default=None, help="default mnist1d")
    parser.add_argument(
        "--dynamic",
        default=None,
        help="comma-separated dynamic triggers, default " + ",".join(DYNAMIC).replace("%", "%%"),
    )
    parser.add_argument("--topology", default="complete", help="default complete")
    add_only_option(parser, TRIGGERS)
    add_engine_option(parser)
    args = parser.parse_args()
    if REFERENCE not in args.only:
        parser.error(f"--only must include {REFERENCE}: every row is compared with it")
    fill_defaults(args, steps=(60, 1500), peers=(3, 8))
    args.model = args.model or ("logistic" if args.quick else "cnn1d")
    args.dataset = args.dataset or ("synthetic" if args.quick else "mnist1d")
    dynamic = args.dynamic.split(",") if args.dynamic else DYNAMIC
    if not all(trigger.startswith("dynamic:") for trigger in dynamic):
        parser.error(f"--dynamic {args.dynamic}: dynamic triggers only (dynamic:DELTA[%][:B])")
    drift_step = args.steps // 2
    eval_every = max(args.steps // 30, 1)
    with usage_errors(parser, args, {"trigger": "--dynamic"}):  # every run's, before the first
        configs = {t: config_for(t, args, _name(t)) for t in args.only + dynamic}
        config_for(REFERENCE, args, "drift", drift=f"{drift_step}:permute", eval_every=eval_every)
        # (the drift runs' settings: the second run's trigger is one of those above)

    console = Console(stderr=True)
    rows = []
    for trigger, config in configs.items():
        console.print(f"running {trigger} …")
        summary, _ = run(config, args.engine)
        rows.append(
            {
                "trigger": trigger,
                "accuracy": summary["mean_accuracy"],
                "transmissions": summary["total_messages_sent"],
                "bytes": summary["total_bytes_sent"],
                "syncs": sum(p["syncs"] for p in summary["peers"]),
                "wall_time_s": summary["wall_time_s"],
                "run_dir": config.out,
            }
        )
    reference = next(r for r in rows if r["trigger"] == REFERENCE)
    for row in rows:
        row["fewer_than_periodic10"] = reference["transmissions"] / max(row["transmissions"], 1)
        row["gap_points"] = (reference["accuracy"] - row["accuracy"]) * 100
    dynamic_rows = [r for r in rows if r["trigger"].startswith("dynamic")]
    winners = [
        r["trigger"]
        for r in dynamic_rows
        if r["gap_points"] <= TARGET_POINTS and r["fewer_than_periodic10"] >= TARGET_FEWER
    ]
    best = (
        max(
            (r for r in dynamic_rows if r["trigger"] in winners),
            key=lambda r: r["fewer_than_periodic10"],
        )
        if winners
        else max(dynamic_rows, key=lambda r: r["fewer_than_periodic10"])
    )

    window = max(args.steps // 10, 1)
    curves, drift = {}, {}
    for trigger in (REFERENCE, best["trigger"]):
        console.print(f"running {trigger} with drift at step {drift_step} …")
        config = config_for(
            trigger,
            args,
            f"drift-{_name(trigger)}",
            drift=f"{drift_step}:permute",
            eval_every=eval_every,
        )
        _, curve = run(config, args.engine)
        curves[trigger] = curve
        drift[trigger] = drift_figures(curve, drift_step, window)
    plot = plot_curves(
        curves,
        args.out / "drift.png",
        f"Concept drift at step {drift_step}: labels permuted on all {args.peers} peers",
        panels=[
            Panel("step", "accuracy", "step", "mean test accuracy"),
            Panel("step", "messages_sent", "step", "model transmissions so far (all peers)"),
        ],
        mark_x=drift_step,
    )
    meta = {
        "steps": args.steps,
        "peers": args.peers,
        "model": args.model,
        "dataset": args.dataset,
        "algorithm": "dense",
        "topology": args.topology,
        "seed": args.seed,
        "target": f"a dynamic trigger within {TARGET_POINTS:g} points of {REFERENCE} with "
        f">= {TARGET_FEWER:g}x fewer transmissions",
        "met": bool(winners),
        "met_by": winners,
        "drift_step": drift_step,
        "drift": drift,
        "plot": str(plot),
    }
    columns = [
        Column("trigger", "trigger"),
        Column("accuracy", "final acc", "{:.4f}"),
        Column("gap_points", f"gap to {REFERENCE} (pts)", "{:+.2f}"),
        Column("transmissions", "transmissions", "{:,}"),
        Column("fewer_than_periodic10", f"fewer than {REFERENCE}", "{:.1f}x"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("syncs", "peer syncs", "{:,}"),
        Column("wall_time_s", "wall s", "{:.0f}"),
    ]
    verdict = f"{mark(True)} by {', '.join(winners)}" if winners else mark(False)
    notes = [f"target ({meta['target']}): {verdict}"]
    for trigger, d in drift.items():
        notes.append(
            f"drift, {trigger}: accuracy {d['accuracy_before']:.3f} before → "
            f"{d['accuracy_lowest_after']:.3f} lowest → {d['accuracy_final']:.3f} final; "
            f"transmissions {d['transmissions_before']:,.0f} in the {window} steps before, "
            f"{d['transmissions_after']:,.0f} in the {window} after"
        )
    notes.append(f"plot: {plot}")
    report(
        "triggers",
        f"Triggers: {args.peers} peers, {args.topology}, dense gossip, {args.model} on "
        f"{args.dataset}, {args.steps} steps",
        columns,
        rows,
        meta,
        args.json,
        notes=notes,
    )


if __name__ == "__main__":
    run_script(main)
