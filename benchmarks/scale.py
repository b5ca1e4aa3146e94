"""Scale: how many simulated peers one machine runs, batched and per peer.

What it measures
    From one invocation, ``gossipdl simulate --batched`` for each peer count of ``--peers``
    (default 16, 64, 256, 1000, 4000, 10000), each model, topology and algorithm:

    * models: the 1-D CNN on MNIST-1D for up to 1,000 peers (``--cnn-steps``, 1500 steps)
      and logistic regression on the synthetic blobs for every count (``--logistic-steps``,
      500 steps); each peer gets ``--samples-per-peer`` (250) generated training samples,
      iid;
    * topologies: ``exponential`` and ``random-regular:4``;
    * algorithms: CHOCO with top-1% (``choco-topk``) and dense gossip (``dense``).

    The rows of up to ``--unbatched-up-to`` (64) peers also run through the per-peer
    simulator. Each run happens in a fresh child process: ``peak_rss_mb`` is its own peak
    resident memory (start-up, torch and the data included); ``wall_s`` its host time,
    start-up included; ``s_per_step`` the wall time over the steps; ``accuracy`` the peers'
    mean final test accuracy. One plot, ``OUT/seconds_per_step.png``: seconds per step
    against peers, log-log, a line per model, algorithm and engine (exponential graph).

Targets (this 2-core machine)
    1,000 peers x 1,500 steps of the 1-D CNN with CHOCO top-1% in under 10 minutes and
    under 8 GB; 10,000 logistic peers x 500 steps in under 15 minutes; the batched path
    at least 10x faster than the per-peer one at 256 peers or more, the per-peer cost
    taken from its largest row (its seconds per step grow with the peers: it runs them
    one after another).

Run
    python benchmarks/scale.py --json runs/bench-scale.json
    python benchmarks/scale.py --peers 16,64,256 --only choco-topk --topologies exponential
    python benchmarks/scale.py --quick          # 16 and 64 peers, 30 steps: a smoke test

JSON (``--json FILE``): ``{"benchmark": "scale", "rows": [...], "meta": {...}}``; each row
has ``peers``, ``model``, ``algorithm``, ``topology``, ``engine`` (``batched`` or
``per-peer``), ``device`` (the batched rows': ``--device``, a GPU where there is one),
``steps``, ``s_per_step``, ``wall_s``, ``peak_rss_mb``, ``accuracy`` and
``bytes``; ``meta`` the settings, the plot and each target's verdict.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    Column,
    add_only_option,
    at_least,
    benchmark_parser,
    check_device,
    fill_defaults,
    fresh_run_dir,
    mark,
    peer_counts,
    report,
    run_script,
    usage_errors,
)
from rich.console import Console
from rich.progress import Progress
from simulate import run_simulated

from gossipdl.config import Config, load_config
from gossipdl.experiments.plots import pyplot
from gossipdl.peers.device import pick_device

PEERS = (16, 64, 256, 1000, 4000, 10000)
QUICK_PEERS, QUICK_STEPS = (16, 64), 30
CNN_UP_TO, UNBATCHED_UP_TO = 1000, 64
ALGORITHMS = {"choco-topk": ("choco", "topk:0.01"), "dense": ("dense", "none")}
TOPOLOGIES = ("exponential", "random-regular:4")
CNN_GOAL = (1000, 600.0, 8192.0)  # peers, seconds, MiB
LOGISTIC_GOAL = (10000, 900.0)
SPEEDUP, SPEEDUP_FROM = 10.0, 256


@dataclass(frozen=True)
class Run:
    """One row: a model on a topology of ``peers`` with an algorithm, on one engine."""

    peers: int
    model: str
    algorithm: str
    topology: str
    batched: bool
    steps: int

    @property
    def engine(self) -> str:
        return "batched" if self.batched else "per-peer"

    @property
    def name(self) -> str:
        topology = self.topology.replace(":", "")
        return f"{self.model}-{self.algorithm}-{topology}-{self.peers}-{self.engine}"


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs of this invocation, smallest first."""
    runs = []
    for peers in args.peers:
        for model, steps in (("cnn1d", args.cnn_steps), ("logistic", args.logistic_steps)):
            if model == "cnn1d" and peers > CNN_UP_TO:
                continue
            for topology in args.topologies:
                for algorithm in args.only:
                    for batched in (True, False):
                        if batched or peers <= args.unbatched_up_to:
                            runs.append(Run(peers, model, algorithm, topology, batched, steps))
    return runs


def config_for(run: Run, args: argparse.Namespace) -> Config:
    """The simulated swarm of ``run``."""
    algorithm, codec = ALGORITHMS[run.algorithm]
    return load_config(
        args.config,
        peers=run.peers,
        max_members=max(512, run.peers),
        model=run.model,
        dataset="mnist1d" if run.model == "cnn1d" else "synthetic",
        samples_per_peer=args.samples_per_peer,
        topology=run.topology,
        algorithm=algorithm,
        codec=codec,
        steps=run.steps,
        eval_every=0,
        log_every=max(1, run.steps // 10),
        seed=args.seed,
        batched=run.batched,
        device=args.device,
        out=str(args.out / run.name),
    )


def run_one(run: Run, config: Config) -> dict[str, Any]:
    """Simulate ``run`` (its ``config``) in a child process; its row."""
    fresh_run_dir(Path(config.out))
    summary, peak_mb = run_simulated(config)
    wall = summary["host_time_s"]
    return {
        "peers": run.peers,
        "model": run.model,
        "algorithm": run.algorithm,
        "topology": run.topology,
        "engine": run.engine,
        "device": str(pick_device(config.device)) if run.batched else "cpu",
        "steps": run.steps,
        "s_per_step": wall / run.steps,
        "wall_s": wall,
        "peak_rss_mb": peak_mb,
        "accuracy": summary["mean_accuracy"],
        "bytes": summary["total_bytes_sent"],
    }


def verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target's rows and whether it holds (None: its rows were not run)."""

    def find(**keys: Any) -> list[dict[str, Any]]:
        return [r for r in rows if all(r[k] == v for k, v in keys.items())]

    peers, seconds, mib = CNN_GOAL
    cnn = find(peers=peers, model="cnn1d", algorithm="choco-topk", engine="batched")
    many, limit = LOGISTIC_GOAL
    logistic = find(peers=many, model="logistic", engine="batched")
    speedups = []
    for slow in rows:
        if slow["engine"] != "per-peer":
            continue
        per_peer = slow["s_per_step"] / slow["peers"]  # it runs the peers one by one
        for fast in find(model=slow["model"], algorithm=slow["algorithm"],
                         topology=slow["topology"], engine="batched"):  # fmt: skip
            if fast["peers"] >= SPEEDUP_FROM:
                speedups.append(per_peer * fast["peers"] / fast["s_per_step"])
    return {
        "cnn_1000": {
            "met": all(r["wall_s"] < seconds and r["peak_rss_mb"] < mib for r in cnn)
            if cnn
            else None,
            "wall_s": [r["wall_s"] for r in cnn],
            "peak_rss_mb": [r["peak_rss_mb"] for r in cnn],
        },
        "logistic_10000": {
            "met": all(r["wall_s"] < limit for r in logistic) if logistic else None,
            "wall_s": [r["wall_s"] for r in logistic],
        },
        "speedup": {
            "met": min(speedups) >= SPEEDUP if speedups else None,
            "smallest": min(speedups, default=None),
        },
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Seconds per step against peers (log-log) on the exponential graph."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["topology"] == "exponential":
            device = r.get("device", "cpu")
            where = "" if device == "cpu" else f" on {device.split(':')[0].upper()}"
            key = f"{r['model']}, {r['algorithm']}, {r['engine']}{where}"
            lines.setdefault(key, []).append((r["peers"], r["s_per_step"]))
    for key, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points), strict=True)
        style = "--" if "per-peer" in key else ":" if " on " in key else "-"
        ax.plot(xs, ys, marker="s" if " on " in key else "o", linestyle=style, label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peers")
    ax.set_ylabel("wall seconds per simulated step")
    ax.set_title("Simulating many peers on one machine (exponential graph)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _topologies(value: str) -> list[str]:
    names = value.split(",")
    unknown = sorted(set(names) - set(TOPOLOGIES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown topologies {unknown}; known: {TOPOLOGIES}")
    return [t for t in TOPOLOGIES if t in names]


def main() -> None:
    parser = benchmark_parser(__doc__, quick=f"16 and 64 peers, {QUICK_STEPS} steps")
    parser.add_argument("--peers", type=peer_counts, default=None, help="default 16,...,10000")
    parser.add_argument("--topologies", type=_topologies, default=list(TOPOLOGIES))
    parser.add_argument("--cnn-steps", type=at_least(1), default=None, help="default 1500")
    parser.add_argument("--logistic-steps", type=at_least(1), default=None, help="default 500")
    parser.add_argument(
        "--samples-per-peer",
        type=at_least(0),
        default=250,
        help="generated training samples a peer, default 250 (0: the data set's own size)",
    )
    parser.add_argument("--unbatched-up-to", type=at_least(0), default=UNBATCHED_UP_TO)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="auto",
        help="the batched rows' device: auto (a GPU where there is one), cpu, cuda",
    )
    parser.add_argument("--config", type=Path, default=None, help="base TOML config")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-scale"))
    add_only_option(parser, list(ALGORITHMS))
    args = parser.parse_args()
    check_device(parser, args.device)
    args.peers = sorted(set(args.peers or (QUICK_PEERS if args.quick else PEERS)))
    fill_defaults(args, cnn_steps=(QUICK_STEPS, 1500), logistic_steps=(QUICK_STEPS, 500))
    runs = plan(args)
    with usage_errors(parser, args):  # every run's config before the first run
        configs = [config_for(run, args) for run in runs]
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        bar = progress.add_task("simulating", total=len(runs))
        for run, config in zip(runs, configs, strict=True):
            progress.update(bar, description=run.name)
            rows.append(run_one(run, config))
            progress.advance(bar)
    plot_path = args.out / "seconds_per_step.png"
    plot(rows, plot_path)
    met = verdicts(rows)
    notes = [f"target ({name}): " + mark(v["met"]) for name, v in met.items()]
    columns = [
        Column("peers", "peers"),
        Column("model", "model"),
        Column("algorithm", "algorithm"),
        Column("topology", "topology"),
        Column("engine", "engine"),
        Column("device", "device"),
        Column("steps", "steps"),
        Column("s_per_step", "s / step", "{:.4f}"),
        Column("wall_s", "wall s", "{:.0f}"),
        Column("peak_rss_mb", "peak MiB", "{:.0f}"),
        Column("accuracy", "accuracy", "{:.4f}"),
        Column("bytes", "bytes", "{:,}"),
    ]
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "config", "out")}
    meta = {"settings": settings, "plot": str(plot_path), "targets": met}
    report("scale", "Simulated peers on one machine", columns, rows, meta, args.json, notes=notes)


if __name__ == "__main__":
    run_script(main)
