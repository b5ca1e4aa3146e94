"""Modes: every way gossipdl can combine workers, on one job, side by side.

What it measures
    From one invocation, the same job run once per setting: 8 workers (``--peers``),
    iid MNIST-1D shards, the default 1-D CNN, SGD with the config defaults and a
    cosine learning rate, the same number of local steps and the same seed:

    * ``single``: one process on all the data (batch = 8 × the per-worker batch);
    * ``ps-sync``: parameter server, parameters averaged after every step
      (synchronous SGD on the global batch);
    * ``ps-async-none`` / ``-scale`` / ``-soft`` / ``-ssp``: asynchronous parameter
      server (Downpour) as it is, with the staleness-scaled step (lr/τ), soft sync
      of 4 updates, and stale synchronous parallel with slack 2;
    * ``fedavg``: FedAvg, half the workers per round, one local epoch each;
    * ``ring``: ring all-reduce of the gradients every step;
    * ``ring-powersgd``: the same with PowerSGD rank 2 (low-rank factors only);
    * ``gossip-dense``: dense gossip (D-PSGD) on a ring;
    * ``gossip-choco``: CHOCO-SGD with ``topk:0.01`` on a ring.

    Per setting, from its run directory: the mean final test accuracy over the
    workers, wall time (the launcher's, start-up included), and total bytes sent
    (every frame every worker and server handed to a socket).

Run
    python benchmarks/modes.py --json runs/bench-modes.json
    python benchmarks/modes.py --only ring,ps-sync --steps 300
    python benchmarks/modes.py --quick        # 3 workers, 40 steps, logistic: a smoke test

    The defaults take about 6 minutes on 2 cores.

JSON (``--json FILE``): ``{"benchmark": "modes", "rows": [...], "meta": {...}}``; each
row has ``setting``, ``mode``, ``detail``, ``accuracy``, ``wall_time_s``, ``bytes``,
``server_bytes``, ``steps``, ``peers_finished``, ``run_dir``.
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
    report,
    run_script,
    run_swarm,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config

SETTINGS: dict[str, dict[str, Any]] = {
    "single": {"mode": "single"},
    "ps-sync": {"mode": "ps", "ps": "sync"},
    "ps-async-none": {"mode": "ps", "ps": "async", "staleness": "none"},
    "ps-async-scale": {"mode": "ps", "ps": "async", "staleness": "scale"},
    "ps-async-soft": {"mode": "ps", "ps": "async", "staleness": "soft:4"},
    "ps-async-ssp": {"mode": "ps", "ps": "async", "staleness": "ssp:2"},
    "fedavg": {"mode": "ps", "ps": "fedavg", "fraction": 0.5, "local_epochs": 1},
    "ring": {"mode": "ring"},
    "ring-powersgd": {"mode": "ring", "codec": "powersgd:2"},
    "gossip-dense": {"mode": "gossip", "topology": "ring", "codec": "none"},
    "gossip-choco": {"mode": "gossip", "topology": "ring", "codec": "topk:0.01"},
}
DEFAULT_STEPS, QUICK_STEPS = 1000, 40


def config_for(key: str, args: argparse.Namespace) -> Config:
    """The shared job with this setting's mode and rule."""
    quick = {"dataset": "synthetic", "model": "logistic"} if args.quick else {}
    return load_config(
        args.config,
        peers=args.peers,
        steps=args.steps,
        seed=args.seed,
        lr_schedule="cosine",
        eval_every=0,
        out=str(args.out / key),
        **quick,
        **SETTINGS[key],
    )


def describe(config: Config) -> str:
    """A few words on what the setting does."""
    if config.mode == "ps":
        rule = {"async": f"async, {config.staleness}", "fedavg": f"fedavg C={config.fraction:g}"}
        return f"ps {rule.get(config.ps, config.ps)}"
    if config.mode == "gossip":
        return f"{config.topology}, codec {config.codec}"
    if config.mode == "ring":
        return f"all-reduce of gradients, codec {config.codec}"
    return "one process, global batch"


def run_setting(key: str, config: Config, engine: str = "real") -> dict[str, Any]:
    """Launch (or simulate) one setting and read its row."""
    summary = run_swarm(config, engine)
    return {
        "setting": key,
        "mode": config.mode,
        "detail": describe(config),
        "accuracy": summary["mean_accuracy"],
        "wall_time_s": summary["wall_time_s"],
        "bytes": summary["total_bytes_sent"],
        "server_bytes": summary.get("server_bytes_sent", 0),
        "steps": config.steps,
        "peers_finished": summary["peers_finished"],
        "run_dir": config.out,
    }


def main() -> None:
    parser = benchmark_parser(__doc__, quick="3 workers, 40 steps, logistic")
    add_swarm_options(parser, "modes", peers="workers, default 8", steps=f"default {DEFAULT_STEPS}")
    add_only_option(parser, list(SETTINGS))
    add_engine_option(parser)
    args = parser.parse_args()
    fill_defaults(args, steps=(QUICK_STEPS, DEFAULT_STEPS), peers=(3, 8))
    with usage_errors(parser, args):  # every setting's config before the first run
        configs = {key: config_for(key, args) for key in args.only}

    console = Console(stderr=True)
    rows = []
    for key, config in configs.items():
        fresh_run_dir(Path(config.out))
        console.print(f"running {key}: {describe(config)} …")
        rows.append(run_setting(key, config, args.engine))
    columns = [
        Column("setting", "setting"),
        Column("detail", "what"),
        Column("accuracy", "final acc", "{:.4f}"),
        Column("wall_time_s", "wall s", "{:.1f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("server_bytes", "of which servers", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("peers_finished", "finished"),
    ]
    job = "logistic on synthetic" if args.quick else "cnn1d on MNIST-1D"
    meta = {"steps": args.steps, "peers": args.peers, "seed": args.seed, "quick": args.quick}
    report(
        "modes",
        f"Modes: {args.peers} workers, {job}, {args.steps} steps, cosine lr",
        columns,
        rows,
        meta,
        args.json,
    )


if __name__ == "__main__":
    run_script(main)
