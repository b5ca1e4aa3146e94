"""Edge: how soon does each way of training reach a target accuracy over slow links?

What it measures
    From one invocation, the same job once per setting: ``peers`` processes
    (default 8), iid MNIST-1D shards, an MLP 40-1024-512-10 (571,914
    parameters), SGD lr 0.05 momentum 0.9 (constant), every peer's access
    link emulated in user space at 10 Mbit/s up and down with 20 ms latency
    (``--link``). Settings:

    - ``ring``: ring all-reduce of dense gradients every step (synchronous
      SGD on the global batch, the data-centre default);
    - ``ps``: a synchronous parameter server (the server's own link is not
      shaped: a server in a data centre, the workers on the edge);
    - ``dense``: dense gossip on a ring;
    - ``choco``: CHOCO-SGD with top-1% sparsification on a ring;
    - ``choco-dynamic``: the same, talking only when a model has moved by
      ``--delta`` (Kamp et al. 2018's dynamic averaging).

    Each run ends when the peers' mean test accuracy (every peer evaluates
    at the same steps) first reaches ``--target``, or after ``--budget``
    seconds of training. Time to target is the slowest peer's training time
    at that evaluation (process start-up and swarm forming are not counted);
    a setting that did not get there within the budget is reported as not
    reached, its time only known to exceed the budget. Bytes are everything
    the processes sent until then (the ps row includes the server's replies).

Target
    The best gossipdl setting reaches the target at least 10x sooner than
    dense ring all-reduce (when the ring does not reach it within the
    budget, the ratio is at least budget / best time).

Run
    python benchmarks/edge.py --json runs/bench-edge.json
    python benchmarks/edge.py --quick       # 3 peers, synthetic data, small model: a smoke test

    On a 2-core machine the defaults take about 35 minutes, most of it the
    dense settings spending their budget.

JSON (``--json FILE``): ``{"benchmark": "edge", "rows": [...], "meta": {...}}``;
each row has ``setting``, ``reached`` (true/false), ``time_to_target_s``
(null when not reached), ``bytes``, ``steps`` (the slowest peer's, at the
end), ``s_per_step``, ``final_accuracy`` (the mean at the accuracy curve's last
point), ``wall_time_s`` and ``run_dir``; ``meta`` holds the settings,
``target``, ``budget_s``, ``best``, ``speedup_vs_ring`` (with
``speedup_is_lower_bound``), ``met`` (null when the ring or every gossipdl setting
was not run) and the plot's path.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
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
from gossipdl.experiments.plots import ACCURACY_VS_BYTES, Panel, plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.rundir import RunDir

SETTINGS = ("choco", "choco-dynamic", "ring", "ps", "dense")
TARGET_SPEEDUP = 10.0
TIME_LOG = Panel(
    "training_s", "accuracy", "training time (s, log scale)", "mean test accuracy", True
)


def name_of(key: str, args: argparse.Namespace) -> str:
    """The row's ``setting``: what a reader needs to know the method by."""
    return {
        "ring": "ring all-reduce (dense)",
        "ps": "ps sync (dense)",
        "dense": "dense gossip",
        "choco": "CHOCO top-1%",
        "choco-dynamic": f"CHOCO top-1% + dynamic:{args.delta}",
    }[key]


def config_for(key: str, args: argparse.Namespace) -> Config:
    """One setting's config; the slow dense settings evaluate every step, the rest every 10."""
    settings: dict[str, Any] = {
        "ring": {"mode": "ring", "eval_every": 1},
        "ps": {"mode": "ps", "ps": "sync", "eval_every": 1},
        "dense": {"codec": "none", "eval_every": 1},
        "choco": {"codec": "topk:0.01", "eval_every": 10},
        "choco-dynamic": {
            "codec": "topk:0.01",
            "trigger": f"dynamic:{args.delta}",
            "eval_every": 10,
        },
    }[key]
    job: dict[str, Any] = (
        {"dataset": "synthetic", "model": "mlp", "hidden": [64]}
        if args.quick
        else {"dataset": "mnist1d", "model": "mlp", "hidden": [1024, 512]}
    )
    return load_config(
        args.config,
        **{
            **job,
            "peers": args.peers,
            "topology": "ring",
            "steps": 1_000_000,  # the target or the budget ends the run
            "lr_schedule": "constant",
            "seed": args.seed,
            "link": args.link,
            "log_every": 10,
            # A 2.3 MB model takes 1.8 s on a 10 Mbit/s link, and heartbeats queue behind it.
            "round_timeout": 120.0,
            "dead_after": 60.0,
            **settings,
            "out": str(args.out / key),
        },
    )


def reached_at(run: RunDir, target: float) -> dict[str, float] | None:
    """The first evaluation at which the peers' mean accuracy reached ``target``."""
    return next((p for p in accuracy_curve(run) if p["accuracy"] >= target), None)


def over(run: RunDir, target: float, budget: float) -> bool:
    """Whether a setting's run may end: the peers' mean accuracy at their last common
    evaluation reached ``target``, or ``budget`` seconds of training passed (start-up is
    not the device's; simulated seconds in a simulated run)."""
    curve = accuracy_curve(run)
    spent = curve[-1]["training_s"] if curve else 0.0
    return (curve != [] and curve[-1]["accuracy"] >= target) or spent >= budget


def run_setting(key: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Train one setting until it reaches the target or spends the budget; read its row."""
    config = config_for(key, args)
    run = RunDir(config.out)
    fresh_run_dir(run.root)
    started, checked = time.monotonic(), [0.0]

    def done(run: RunDir) -> bool:
        now = time.monotonic()
        if now - checked[0] < 1.0:  # reading every peer's metrics costs a little
            return False
        checked[0] = now
        stuck = now - started > args.budget + 120  # no evaluation at all: do not wait forever
        return stuck or over(run, args.target, args.budget)

    if args.engine == "sim":  # simulated seconds: the budget is the simulated training time
        until = functools.partial(over, target=args.target, budget=args.budget)
        summary = run_swarm(config, "sim", until)
    else:
        summary = run_swarm(config, "real", done, progress=not args.no_progress, console=console)
    return setting_row(key, args, run, summary)


def setting_row(
    key: str, args: argparse.Namespace, run: RunDir, summary: dict[str, Any]
) -> dict[str, Any]:
    """One setting's row from its run directory and summary (a real or a simulated run)."""
    curve = accuracy_curve(run)
    hit = reached_at(run, args.target)
    steps = max(p["steps"] for p in summary["peers"])
    training_s = summary["training_s"]
    sent = summary["total_bytes_sent"]  # until the end; until the target when it was reached
    if hit is not None:  # the peers' bytes at that evaluation, the server's prorated by time
        ran = max(p["time_s"] for p in summary["peers"])
        sent = hit["bytes_sent"] + summary["server_bytes_sent"] * hit["time_s"] / ran
    return {
        "setting": name_of(key, args),
        "reached": hit is not None,
        "time_to_target_s": None if hit is None else hit["training_s"],
        "bytes": sent,
        "steps": steps,
        "s_per_step": training_s / max(1, steps),
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "wall_time_s": summary["wall_time_s"],
        "run_dir": str(run.root),
        "curve": curve,
    }


def is_ring(row: dict[str, Any]) -> bool:
    """Whether ``row`` is dense ring all-reduce, the baseline."""
    return row["setting"].startswith("ring")


def is_gossip(row: dict[str, Any]) -> bool:
    """Whether ``row`` is a gossipdl setting (neither the ring nor the parameter server)."""
    return not is_ring(row) and not row["setting"].startswith("ps")


def speedup_met(rows: list[dict[str, Any]], speedup: float | None) -> bool | None:
    """Whether the best gossipdl setting got to the target :data:`TARGET_SPEEDUP` times
    sooner than the ring; None (not run, as against missed) when ``--only`` left out the
    ring or every gossipdl setting."""
    if not any(map(is_ring, rows)) or not any(map(is_gossip, rows)):
        return None
    return speedup is not None and speedup >= TARGET_SPEEDUP


def speedup_vs_ring(
    rows: list[dict[str, Any]], budget: float
) -> tuple[dict[str, Any] | None, float | None, bool | None]:
    """The best gossipdl setting that reached the target (not the ring, not the ps), how
    many times sooner than dense ring all-reduce it got there, and whether that is a lower
    bound (the ring did not get there within ``budget``)."""
    reached = [r for r in rows if r["reached"] and is_gossip(r)]
    best = min(reached, key=lambda r: r["time_to_target_s"], default=None)
    ring = next((r for r in rows if is_ring(r)), None)
    if best is None or ring is None:
        return best, None, None
    ring_s = ring["time_to_target_s"] if ring["reached"] else budget
    if best["time_to_target_s"] <= 0:  # reached at the start: no time to compare
        return best, None, None
    return best, ring_s / best["time_to_target_s"], not ring["reached"]


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings from ``argv`` (default: the command line), with the defaults
    of ``--quick`` or of the full run filled in."""
    parser = benchmark_parser(__doc__, quick="3 peers, synthetic, MLP 64")
    add_swarm_options(parser, "edge", peers="default 8 (--quick: 3)")
    parser.add_argument("--target", type=float, default=None, help="default 0.45 (--quick 0.6)")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds per setting, default 600 (--quick 20)"
    )
    parser.add_argument("--delta", default="0.01%:10", help="dynamic trigger DELTA[%%][:B]")
    parser.add_argument("--link", default="up=10mbit,down=10mbit,latency=20ms")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bars")
    add_only_option(parser, list(SETTINGS))
    add_engine_option(parser)
    args = parser.parse_args(argv)
    fill_defaults(args, peers=(3, 8), target=(0.6, 0.45), budget=(20.0, 600.0))
    if args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: give the seconds each setting may take, > 0")
    with usage_errors(parser, args, {"trigger": "--delta"}):  # every setting's, before the first
        for key in args.only:
            config_for(key, args)
    return args


def main() -> None:
    args = options()
    console = Console(stderr=True)
    rows = []
    for key in args.only:
        console.print(f"running {name_of(key, args)} …")
        rows.append(run_setting(key, args, console))
    best, speedup, lower_bound = speedup_vs_ring(rows, args.budget)
    for row in rows:
        if best is not None and row["reached"] and best["time_to_target_s"] > 0:
            row["vs_best"] = row["time_to_target_s"] / best["time_to_target_s"]
    plot = plot_curves(
        {r["setting"]: r["curve"] for r in rows},
        args.out / "edge.png",
        f"Edge: {args.peers} peers on {args.link} links, target accuracy {args.target}",
        panels=(TIME_LOG, ACCURACY_VS_BYTES),
        mark_y=args.target,
    )
    met = speedup_met(rows, speedup)
    columns = [
        Column("setting", "setting"),
        Column("reached", "reached", lambda v: "yes" if v else "no"),
        Column("time_to_target_s", "time to target s", "{:.1f}"),
        Column("vs_best", "x best", "{:.1f}x"),
        Column("steps", "steps"),
        Column("s_per_step", "s / step", "{:.3f}"),
        Column("final_accuracy", "last acc", "{:.4f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
    ]
    meta = {
        "peers": args.peers,
        "target": args.target,
        "budget_s": args.budget,
        "link": args.link,
        "delta": args.delta,
        "seed": args.seed,
        "quick": args.quick,
        "best": None if best is None else best["setting"],
        "speedup_vs_ring": speedup,
        "speedup_is_lower_bound": lower_bound,
        "target_speedup": TARGET_SPEEDUP,
        "met": met,
        "plot": str(plot),
    }
    bound = "≥ " if lower_bound else ""
    job = "MLP 64 on synthetic" if args.quick else "MLP 40-1024-512-10 on MNIST-1D"
    report(
        "edge",
        f"Edge: {args.peers} peers, {job}, links {args.link}, target accuracy {args.target}",
        columns,
        [{k: v for k, v in r.items() if k != "curve"} for r in rows],
        meta,
        args.json,
        notes=[
            f"best gossipdl setting: {meta['best']}; vs dense ring all-reduce: "
            + ("-" if speedup is None else f"{bound}{speedup:.1f}x sooner")
            + f" (target {TARGET_SPEEDUP:g}x: {mark(met)}); plot {plot}"
        ],
    )


if __name__ == "__main__":
    run_script(main)
