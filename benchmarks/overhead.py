"""Overhead: what gossip adds to a training step, on a model where compute dominates.

What it measures
    Real peer processes (default 2, a ring, one thread each, so each has a core) train
    an MLP of about 10.7M parameters (widths 2300, 2300, 2300) on MNIST-1D, batch 32
    (``--batch-size``: on a GPU a step of batch 32 is a millisecond or two, far less
    than any round, so a larger batch gives the compute-bound step the target is about),
    once without gossip (``periodic:H`` with H past the last step: the same swarm,
    processes and heartbeats, no round) and once per setting: dense gossip, CHOCO with
    top-1% and CHOCO with the scaled sign, a round after every step, each also with
    ``overlap`` (``+overlap``: the round runs behind the next step's compute), and the
    ring all-reduce of gradients (``--mode ring``; ``+overlap``: in buckets during
    backward; ``ring-shared``: through shared memory, ``--shared-memory``, on the GPU
    for GPU peers). A peer's step time
    is read from its metrics lines (one every ``--log-every`` steps, the first ones
    skipped as warm-up): the time between its first and last line over the steps
    between them, averaged over the peers. The overhead of a setting is the share of its
    step that the rounds add: ``1 − alone / setting``. Waiting for a slower neighbour
    counts: it is part of what a round costs. Each row also has the share of the run
    the peers spent idle (waiting for messages) and the bytes a peer sent per round.

Target
    Gossip at most 5% of the step time for dense, CHOCO top-1% and sign (this CPU; on
    a GPU when one is lent: ``--device cuda``).

Run
    python benchmarks/overhead.py                    # 10.7M parameters, 60 steps each
    python benchmarks/overhead.py --quick            # 100k parameters, 20 steps: a smoke test
    python benchmarks/overhead.py --json runs/bench-overhead.json
    python benchmarks/overhead.py --device cuda --batch-size 2048   # a GPU's compute-bound step

JSON (``--json FILE``): ``{"benchmark": "overhead", "rows": [...], "meta": {...}}``; each
row has ``setting``, ``algorithm``, ``codec``, ``parameters``, ``s_per_step``,
``overhead`` (a fraction; null for the run without gossip), ``idle_share``,
``bytes_per_round`` and ``run_dir``; ``meta`` holds the settings, the target and
whether each setting met it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_only_option,
    add_swarm_options,
    at_least,
    benchmark_parser,
    check_device,
    fill_defaults,
    fresh_run_dir,
    mark,
    parameters,
    report,
    run_script,
    step_time,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config
from gossipdl.experiments.launcher import launch
from gossipdl.rundir import RunDir

TARGET = 0.05
SETTINGS = {  # name: (algorithm or "ring[-shared]", codec, trigger, overlap); "alone": baseline
    "alone": ("dense", "none", None, False),
    "dense": ("dense", "none", "always", False),
    "choco-topk": ("choco", "topk:0.01", "always", False),
    "choco-sign": ("choco", "sign", "always", False),
    "dense+overlap": ("dense", "none", "always", True),
    "choco-topk+overlap": ("choco", "topk:0.01", "always", True),
    "choco-sign+overlap": ("choco", "sign", "always", True),
    "ring": ("ring", "none", "always", False),
    "ring+overlap": ("ring", "none", "always", True),
    "ring-shared": ("ring-shared", "none", "always", False),
    "ring-shared+overlap": ("ring-shared", "none", "always", True),
}
HIDDEN, QUICK_HIDDEN = "2300,2300,2300", "256,256"
STEPS, QUICK_STEPS = 60, 20


def config_for(args: Any, name: str) -> Config:
    """The swarm of setting ``name``: the same job, its algorithm (or the ring all-reduce of
    gradients), codec, trigger and overlap."""
    algorithm, codec, trigger, overlap = SETTINGS[name]
    ring = algorithm.startswith("ring")
    return load_config(
        args.config,
        mode="ring" if ring else "gossip",
        peers=args.peers,
        topology="ring",
        dataset="mnist1d",
        model="mlp",
        hidden=args.hidden,
        batch_size=args.batch_size,
        steps=args.steps,
        algorithm="auto" if ring else algorithm,
        codec=codec,
        trigger=trigger or f"periodic:{args.steps + 1}",
        overlap=overlap,
        shared_memory=algorithm == "ring-shared",
        threads=1,
        eval_every=0,
        log_every=args.log_every,
        device=args.device,
        seed=args.seed,
        out=str(args.out / name),
    )


def main() -> None:
    parser = benchmark_parser(__doc__ or "", f"widths {QUICK_HIDDEN}, {QUICK_STEPS} steps")
    add_swarm_options(parser, "overhead", peers="default 2", steps=f"default {STEPS}")
    add_only_option(parser, [name for name in SETTINGS if name != "alone"])
    parser.add_argument("--hidden", default=None, help=f"MLP widths, default {HIDDEN}")
    parser.add_argument("--log-every", type=at_least(1), default=5)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--batch-size", type=at_least(1), default=32, help="samples a step (32)")
    args = parser.parse_args()
    check_device(parser, args.device)
    fill_defaults(args, peers=(2, 2), hidden=(QUICK_HIDDEN, HIDDEN), steps=(QUICK_STEPS, STEPS))
    warm_up = min(2 * args.log_every, args.steps // 3)
    with usage_errors(parser, args):  # every setting's config before the first run
        configs = {name: config_for(args, name) for name in ["alone", *args.only]}

    console = Console(stderr=True)
    rows = []
    for name, config in configs.items():
        fresh_run_dir(Path(config.out))
        console.print(f"running {name}: {config.peers} peers, {config.steps} steps …")
        summary = launch(config, progress=False)
        run = RunDir(config.out)
        rounds = max(1, min(p["syncs"] for p in summary["peers"]))
        rows.append(
            {
                "setting": name,
                "algorithm": config.algorithm if name != "alone" else "none",
                "codec": config.codec,
                "parameters": parameters(config),
                "s_per_step": step_time(run, config.peers, warm_up),
                "idle_share": statistics.mean(p["idle_s"] for p in summary["peers"])
                / max(summary["training_s"], 1e-9),
                "bytes_per_round": summary["total_bytes_sent"] / config.peers / rounds
                if name != "alone"
                else None,
                "run_dir": config.out,
            }
        )
    alone = rows[0]["s_per_step"]
    rows[0]["overhead"] = None
    for row in rows[1:]:
        row["overhead"] = 1 - alone / row["s_per_step"]
    met = {row["setting"]: row["overhead"] <= TARGET for row in rows[1:]}
    columns = [
        Column("setting", "setting"),
        Column("codec", "codec"),
        Column("parameters", "parameters", "{:,}"),
        Column("s_per_step", "s / step", "{:.4f}"),
        Column("overhead", "gossip share of the step", "{:.1%}"),
        Column("idle_share", "idle share", "{:.1%}"),
        Column("bytes_per_round", "bytes / peer / round", "{:,.0f}"),
    ]
    notes = [f"{name}: gossip ≤ {TARGET:.0%} of the step — {mark(ok)}" for name, ok in met.items()]
    notes.append(
        f"{args.peers} peers on a ring, MLP widths {args.hidden}, batch {args.batch_size}, "
        f"{args.steps} steps, one thread each, device {args.device}"
    )
    meta = {
        "peers": args.peers,
        "hidden": args.hidden,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warm_up_steps": warm_up,
        "device": args.device,
        "target": TARGET,
        "met": met,
    }
    report("overhead", "Gossip overhead per step", columns, rows, meta, args.json, notes=notes)


if __name__ == "__main__":
    run_script(main)
