"""Workloads: time per step and bytes per round on the data sets and models papers use.

What it measures
    For each workload (CIFAR-10 with ResNet-20 and with VGG-11, CIFAR-100 with ResNet-20,
    FEMNIST with LEAF's CNN and with LeNet-5, Shakespeare with LEAF's LSTM, and FedProx's
    Synthetic(1, 1) with logistic regression), 8 peers on a ring train for ``--steps``
    steps with dense gossip and with CHOCO top-1%, a round after every step: a peer's
    seconds per step (from its metrics lines after a warm-up, averaged over the peers)
    and the bytes a peer sends per round. CIFAR splits iid; LEAF and Synthetic(α, β)
    split naturally, by writer, speaker or device. A workload whose files are not in
    ``--data-dir`` (``gossipdl data fetch NAME`` puts them there) is a row that says so,
    with no figures: the script never downloads.

Run
    gossipdl data fetch cifar10                       # once: the data, checked
    python benchmarks/workloads.py --json runs/bench-workloads.json
    python benchmarks/workloads.py --only fedprox-logistic --quick   # needs no files
    python benchmarks/workloads.py --engine sim   # simulated: exact bytes, the host's step times

JSON (``--json FILE``): ``{"benchmark": "workloads", "rows": [...], "meta": {...}}``; each row
has ``workload``, ``dataset``, ``model``, ``parameters``, ``setting`` (``dense`` or
``choco-topk``), ``s_per_step``, ``bytes_per_round`` and ``skipped`` (why there are no
figures, or null); ``meta`` holds the settings and the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_engine_option,
    add_only_option,
    add_swarm_options,
    at_least,
    benchmark_parser,
    fill_defaults,
    fresh_run_dir,
    parameters,
    report,
    run_script,
    run_swarm,
    step_time,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config
from gossipdl.data import DataError
from gossipdl.rundir import RunDir
from gossipdl.training import dataset_of

WORKLOADS = {  # name: (dataset, model, partition)
    "cifar10-resnet20": ("cifar10", "resnet20", "iid"),
    "cifar10-vgg11": ("cifar10", "vgg11", "iid"),
    "cifar100-resnet20": ("cifar100", "resnet20", "iid"),
    "femnist-leaf-cnn": ("femnist", "leaf-cnn", "natural"),
    "femnist-lenet5": ("femnist", "lenet5", "natural"),
    "shakespeare-leaf-lstm": ("shakespeare", "leaf-lstm", "natural"),
    "fedprox-logistic": ("synthetic-fedprox:1:1", "logistic", "natural"),
}
SETTINGS = {"dense": ("dense", "none"), "choco-topk": ("choco", "topk:0.01")}
STEPS, QUICK_STEPS = 30, 12


def config_for(args: Any, workload: str, setting: str) -> Config:
    """The swarm of one workload and setting."""
    dataset, model, split = WORKLOADS[workload]
    algorithm, codec = SETTINGS[setting]
    return load_config(
        args.config,
        peers=args.peers,
        topology="ring",
        dataset=dataset,
        data_dir=str(args.data_dir or ""),
        model=model,
        partition=split,
        batch_size=32,
        steps=args.steps,
        algorithm=algorithm,
        codec=codec,
        threads=1,
        eval_every=0,
        log_every=args.log_every,
        seed=args.seed,
        out=str(args.out / f"{workload}-{setting}"),
    )


def measure(args: Any, workload: str, setting: str, config: Config, warm_up: int) -> dict[str, Any]:
    """One row: the swarm's (``config``'s) step time and bytes per round, or why it did not
    run."""
    dataset, model, _ = WORKLOADS[workload]
    row: dict[str, Any] = {"workload": workload, "dataset": dataset, "model": model,
                           "setting": setting, "parameters": None, "s_per_step": None,
                           "bytes_per_round": None, "skipped": None}  # fmt: skip
    try:
        dataset_of(config)
    except DataError as exc:
        row["skipped"] = str(exc)
        return row
    fresh_run_dir(Path(config.out))
    summary = run_swarm(config, args.engine)
    rounds = max(1, min(p["syncs"] for p in summary["peers"]))
    row.update(
        parameters=parameters(config),
        s_per_step=step_time(RunDir(config.out), config.peers, warm_up),
        bytes_per_round=summary["total_bytes_sent"] / config.peers / rounds,
    )
    return row


def main() -> None:
    parser = benchmark_parser(__doc__ or "", f"{QUICK_STEPS} steps")
    add_swarm_options(parser, "workloads", peers="default 8", steps=f"default {STEPS}")
    add_only_option(parser, list(WORKLOADS))
    add_engine_option(parser)
    parser.add_argument("--data-dir", type=Path, default=None, help="where the data sets are")
    parser.add_argument("--log-every", type=at_least(1), default=3)
    args = parser.parse_args()
    fill_defaults(args, peers=(8, 8), steps=(QUICK_STEPS, STEPS))
    warm_up = min(2 * args.log_every, args.steps // 3)
    with usage_errors(parser, args):  # every swarm's config before the first run
        configs = {(w, s): config_for(args, w, s) for w in args.only for s in SETTINGS}
    console = Console(stderr=True)
    rows = []
    for (workload, setting), config in configs.items():
        console.print(f"running {workload}, {setting}: {args.peers} peers …")
        rows.append(measure(args, workload, setting, config, warm_up))
    skipped = sorted({f"{r['workload']}: {r['skipped']}" for r in rows if r["skipped"]})
    columns = [
        Column("workload", "workload"),
        Column("setting", "setting"),
        Column("parameters", "parameters", "{:,}"),
        Column("s_per_step", "s / step", "{:.4f}"),
        Column("bytes_per_round", "bytes / peer / round", "{:,.0f}"),
    ]
    meta = {"peers": args.peers, "steps": args.steps, "warm_up_steps": warm_up,
            "engine": args.engine, "data_dir": str(args.data_dir or "")}  # fmt: skip
    notes = [f"{args.peers} peers on a ring, {args.steps} steps, engine {args.engine}"]
    notes += [f"[yellow]skipped[/] {line}" for line in skipped]
    report("workloads", "Workloads: step time and bytes", columns, rows, meta, args.json,
           notes=notes)  # fmt: skip


if __name__ == "__main__":
    run_script(main)
