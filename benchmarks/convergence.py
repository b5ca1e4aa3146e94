"""Convergence: accuracy against bytes sent, dense gossip vs the compressed algorithms.

What it measures
    From one invocation, the same job run once per setting and topology: iid MNIST-1D
    shards, an MLP 40-1024-512-10 (571,914 parameters, so the byte ratios reflect
    payloads rather than message headers), SGD with the config defaults and a cosine
    learning-rate schedule (``--lr-schedule constant`` for the flat one), the same number
    of steps and the same seed, on a ring of ``--peers`` (default 8) and on the
    exponential graph of ``--exponential-peers`` (default 16). Every γ is chosen
    automatically (``averaging.choco.auto_gamma``; PowerGossip's is 1). Settings:

    * ``dense``: dense gossip (D-PSGD), the uncompressed baseline;
    * ``choco-topk``, ``choco-sign``, ``choco-topk-qsgd``, ``choco-powersgd``: CHOCO-SGD
      with ``topk:0.01``, ``sign``, ``topk:0.01+qsgd:16`` and ``powersgd:1`` (per layer);
    * ``powergossip``: PowerGossip, rank 1 per layer and edge;
    * ``beer-topk``, ``beer-topk-qsgd``, ``beer-topk05-qsgd``, ``beer-topk05-trits``: BEER
      (gradient tracking through CHOCO's public copies) with top-1%, with QSGD values on
      it, with QSGD values on top-0.5%, and the same with those values' levels coded as
      trits and exceptions (``qsgd:16:trits``: the same run, fewer bytes); ``beer-sign``:
      BEER with 1-bit values of every coordinate, a scale per 512 (``sign:512``), and a
      far larger automatic γ (with one scale for the whole model, on the Dirichlet
      shards the last layer drifted: its norm grew with every step, to 530);
    * ``stacked-sign``, ``stacked``: the savings together, a message every 4th step
      (``periodic:4``) of 1-bit values (``sign``), or of top-1% with QSGD values and
      Golomb-coded indices (``topk:0.01+qsgd:16``);
    * ``beer-stacked``: BEER's savings together, a message every 16th step of 1-bit
      values of a random half of the coordinates (drawn from a seed the message carries,
      so no indices travel), a scale per 4096 (``randomk:0.5:noscale+sign:4096``,
      ``periodic:16``): sign's large γ keeps the peers together across 16 local steps,
      where top-k's small one did not;
    * non-IID rows: each of ``--non-iid-setting`` (a comma list; default
      ``beer-stacked``, the best setting, ``beer-topk05-trits`` and ``beer-sign``) on the
      ring with ``dirichlet:0.1`` shards, beside its iid row.

    Each run is simulated (``--engine sim``, the default: the protocol's own code on a
    virtual clock, every message encoded as on the wire, so bytes and accuracy are those
    of a real swarm; ``--engine real`` launches processes) into ``OUT/<topology>/<setting>``
    (a previous run there is replaced); ``--jobs N`` runs N at once. Per run: the final
    mean test accuracy over the peers, the gap to dense (same topology) in points, total
    bytes sent (every frame, headers included), and **the bytes sent until the mean
    accuracy first reached dense's final accuracy minus 1 point** (``-`` when never), with
    dense's over this one's as ``ratio_to_target``. One plot per topology,
    ``OUT/accuracy_vs_bytes_<topology>.png``, shows mean accuracy against bytes (log x) for
    its runs, with the target (dense's accuracy minus 1 point) dashed.

Targets, on the ring
    At least one setting within 1 point of dense with >= 100x fewer bytes to that accuracy;
    at least one with >= 1000x fewer bytes to dense's accuracy minus 1 point; CHOCO top-1%
    within 1.5 points of dense; no setting diverges (ends below 20% accuracy, or with its
    models over 100 apart: consensus distance); the non-IID row of the best setting within 3
    points of its iid accuracy (the verdict names every setting whose non-IID row is, and
    has not diverged).

Run
    python benchmarks/convergence.py --json runs/bench-convergence.json --jobs 2
    python benchmarks/convergence.py --only dense,powergossip --topologies ring
    python benchmarks/convergence.py --quick          # tiny MLP, 60 steps: a smoke test

    On a 2-core machine the defaults take about 2 hours with ``--jobs 2``.

JSON (``--json FILE``): ``{"benchmark": "convergence", "rows": [...], "meta": {...}}``;
each row has ``setting``, ``topology``, ``peers``, ``partition``, ``algorithm``,
``codec``, ``trigger``, ``gamma``, ``accuracy``, ``gap_points``, ``bytes``,
``header_bytes``, ``ratio`` (dense's bytes / bytes), ``bytes_to_target``,
``ratio_to_target`` (null when the target was never reached), ``consensus_distance``,
``wall_time_s``, ``peers_finished``, ``run_dir`` and ``curve`` (``step``, ``time_s``,
``bytes_sent``, ``accuracy`` points); ``meta`` holds the job, the plots' paths (``plots``,
one per topology; ``plot``, the first) and each target with whether it was met (and by
which rows; null, "not run", when the rows it needs were not run: no ring, where the
targets are set, or settings ``--only`` left out).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    Column,
    add_only_option,
    add_swarm_options,
    at_least,
    benchmark_parser,
    fill_defaults,
    fresh_run_dir,
    mark,
    report,
    run_script,
    run_swarm,
    run_tasks,
    usage_errors,
)

from gossipdl.averaging import auto_gamma
from gossipdl.compression import build_codec
from gossipdl.config import Config, load_config
from gossipdl.experiments.plots import plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.models import build_model
from gossipdl.rundir import RunDir
from gossipdl.topologies import build_topology

TARGET_POINTS, TARGET_RATIO, TARGET_FAR = 1.0, 100.0, 1000.0
TOPK_POINTS, NON_IID_POINTS, DIVERGED = 1.5, 3.0, 0.2
# Models this far apart at the end (consensus distance) drifted, even if each still predicts:
# BEER with one sign scale for the whole model (``sign``) on the Dirichlet shards ended at
# 1.2e5 and 0.683 accuracy, its last layer's norm growing with every step (to 220-530;
# 14 iid); healthy rows end below 10 (``sign:512``: 0.56).
DRIFTED = 100.0
DEFAULT_STEPS, DEFAULT_HIDDEN = 3000, "1024,512"
QUICK_STEPS, QUICK_PEERS, QUICK_HIDDEN = 60, 4, "64"
NON_IID = "dirichlet:0.1"


@dataclass(frozen=True)
class Setting:
    """One compared configuration: the algorithm, its codec and when peers talk."""

    key: str
    algorithm: str
    codec: str
    trigger: str = "always"


SETTINGS = [
    Setting("dense", "dense", "none"),
    Setting("choco-topk", "choco", "topk:0.01"),
    Setting("choco-sign", "choco", "sign"),
    Setting("choco-topk-qsgd", "choco", "topk:0.01+qsgd:16"),
    Setting("choco-powersgd", "choco", "powersgd:1"),
    Setting("powergossip", "powergossip", "powersgd:1"),
    Setting("beer-topk", "beer", "topk:0.01"),
    Setting("beer-topk-qsgd", "beer", "topk:0.01+qsgd:16"),
    Setting("beer-topk05-qsgd", "beer", "topk:0.005+qsgd:16"),
    Setting("beer-topk05-trits", "beer", "topk:0.005+qsgd:16:trits"),
    Setting("beer-sign", "beer", "sign:512"),
    Setting("stacked-sign", "choco", "sign", "periodic:4"),
    Setting("stacked", "choco", "topk:0.01+qsgd:16", "periodic:4"),
    Setting("beer-stacked", "beer", "randomk:0.5:noscale+sign:4096", "periodic:16"),
]


@dataclass(frozen=True)
class Job:
    """One run: a setting on a topology of ``peers`` with shards ``partition``."""

    setting: Setting
    topology: str
    peers: int
    partition: str = "iid"

    @property
    def name(self) -> str:
        return self.setting.key + ("" if self.partition == "iid" else f"-{self.partition}")


def config_for(job: Job, args: argparse.Namespace) -> Config:
    """The shared job with this run's algorithm, codec, trigger, topology and shards."""
    setting = job.setting
    return load_config(
        args.config,
        peers=job.peers,
        steps=args.steps,
        model="mlp",
        hidden=args.hidden,
        dataset="mnist1d",
        partition=job.partition,
        seed=args.seed,
        lr_schedule=args.lr_schedule,
        eval_every=max(1, args.steps // 30),
        algorithm=setting.algorithm,
        codec=setting.codec,
        trigger=setting.trigger,
        topology=job.topology,
        threads=1 if args.jobs > 1 else 0,
        out=str(args.out / job.topology / job.name),
    )


def gamma_of(config: Config, numel: int) -> float | None:
    """The consensus step the run used (given, or chosen automatically)."""
    if config.algorithm == "powergossip":
        return config.gamma or 1.0
    if config.algorithm not in ("choco", "beer"):
        return None
    codec = build_codec(config.codec)
    model = build_model("mlp", (40,), 10, list(config.hidden))
    codec.bind_layout([tuple(p.shape) for p in model.parameters()])  # as the peers do
    self_weight = float(build_topology(config.topology, config.peers).mixing_matrix()[0, 0])
    return config.gamma or auto_gamma(codec, numel, self_weight)  # the graphs are regular


def run_job(task: tuple[Job, Config, str, int]) -> dict[str, Any]:
    """Run (or simulate) one job and read its row (dense-relative columns come later)."""
    job, config, engine, numel = task
    if engine == "sim":
        torch.set_num_threads(max(1, config.threads))
    fresh_run_dir(Path(config.out))
    summary = run_swarm(config, engine)
    return {
        "setting": job.setting.key,
        "topology": job.topology,
        "peers": job.peers,
        "partition": job.partition,
        "algorithm": job.setting.algorithm,
        "codec": job.setting.codec,
        "trigger": job.setting.trigger,
        "gamma": gamma_of(config, numel),
        "accuracy": summary["mean_accuracy"],
        "bytes": summary["total_bytes_sent"],
        "header_bytes": summary["total_header_bytes_sent"],
        "consensus_distance": summary["consensus_distance"],
        "wall_time_s": summary["wall_time_s"],
        "peers_finished": summary["peers_finished"],
        "run_dir": config.out,
        "curve": accuracy_curve(RunDir(config.out)),
    }


def run_all(tasks: list[tuple[Job, Config, str, int]], jobs: int) -> list[dict[str, Any]]:
    """Every task's row, in the tasks' order, ``jobs`` at a time (:func:`_common.run_tasks`)."""
    return run_tasks(
        run_job,
        tasks,
        jobs,
        lambda row: f"done: {row['topology']}/{row['setting']} ({row['partition']})",
    )


def bytes_to(curve: list[dict[str, Any]], accuracy: float) -> int | None:
    """Bytes sent until the mean accuracy first reached ``accuracy`` (None: never)."""
    return next((p["bytes_sent"] for p in curve if p["accuracy"] >= accuracy - 1e-12), None)


def compare(rows: list[dict[str, Any]]) -> None:
    """Fill each row's columns relative to dense on its topology (iid)."""
    dense = {r["topology"]: r for r in rows if r["setting"] == "dense" and r["partition"] == "iid"}
    for row in rows:
        base = dense.get(row["topology"])
        row["gap_points"] = row["ratio"] = row["bytes_to_target"] = row["ratio_to_target"] = None
        if base is None or base["accuracy"] is None or row["accuracy"] is None:
            continue
        row["gap_points"] = (base["accuracy"] - row["accuracy"]) * 100
        row["ratio"] = base["bytes"] / row["bytes"]
        target = base["accuracy"] - TARGET_POINTS / 100
        row["bytes_to_target"] = bytes_to(row["curve"], target)
        theirs = bytes_to(base["curve"], target)
        if row["bytes_to_target"] and theirs:
            row["ratio_to_target"] = theirs / row["bytes_to_target"]


def diverged(row: dict[str, Any]) -> bool:
    """Whether a run ended below :data:`DIVERGED` accuracy or with its models
    :data:`DRIFTED` apart."""
    return row["accuracy"] < DIVERGED or (row["consensus_distance"] or 0.0) > DRIFTED


def meeting(rows: list[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> list[str] | None:
    """The settings of ``rows`` that pass ``test``; None when there are no rows to judge (the
    runs the target needs were not run: not run, as against missed)."""
    return [r["setting"] for r in rows if test(r)] if rows else None


def verdicts(rows: list[dict[str, Any]]) -> dict[str, list[str] | None]:
    """Each ring target and the rows that meet it (None: the rows it needs were not run)."""
    ring = [r for r in rows if r["topology"] == "ring" and r["gap_points"] is not None]
    iid = [r for r in ring if r["partition"] == "iid" and r["setting"] != "dense"]
    ran = [r for r in rows if r["topology"] == "ring" and r["accuracy"] is not None]
    healthy = [r for r in ran if not diverged(r)]  # needs no dense row
    same = {r["setting"]: r for r in iid}
    shards = [r for r in ring if r["partition"] != "iid" and r["setting"] in same]
    return {
        f"within {TARGET_POINTS:g} point with >= {TARGET_RATIO:g}x fewer bytes to it": meeting(
            iid,
            lambda r: (
                r["gap_points"] <= TARGET_POINTS and (r["ratio_to_target"] or 0) >= TARGET_RATIO
            ),
        ),
        f">= {TARGET_FAR:g}x fewer bytes to dense - {TARGET_POINTS:g} point": meeting(
            iid, lambda r: (r["ratio_to_target"] or 0) >= TARGET_FAR
        ),
        f"CHOCO top-1% within {TOPK_POINTS:g} points": meeting(
            [r for r in iid if r["setting"] == "choco-topk"],
            lambda r: r["gap_points"] <= TOPK_POINTS,
        ),
        f"no run diverged (below {DIVERGED:.0%} accuracy, or models over {DRIFTED:g} apart)": (
            None if not ran else [f"all {len(ran)} ring runs"] if len(healthy) == len(ran) else []
        ),
        f"non-IID ({NON_IID}) within {NON_IID_POINTS:g} points of iid": meeting(
            shards,
            lambda r: (
                (same[r["setting"]]["accuracy"] - r["accuracy"]) * 100 <= NON_IID_POINTS
                and not diverged(r)
            ),
        ),
    }


TOPOLOGY_NAMES = {"ring": "ring", "exponential": "exponential graph"}


def plot_topology(rows: list[dict[str, Any]], topology: str, out: Path, title: str) -> Path:
    """``OUT/accuracy_vs_bytes_<topology>.png``: accuracy against bytes for that topology's
    runs, with a dashed line at dense's accuracy minus 1 point (the target)."""
    mine = [r for r in rows if r["topology"] == topology]
    dense = next((r for r in mine if r["setting"] == "dense" and r["partition"] == "iid"), None)
    return plot_curves(
        {r["name"]: r["curve"] for r in mine},
        out / f"accuracy_vs_bytes_{topology}.png",
        title,
        mark_y=None if dense is None else dense["accuracy"] - TARGET_POINTS / 100,
    )


def parameter_count(hidden: tuple[int, ...]) -> int:
    """Parameters of the benchmarked MLP on MNIST-1D (40 inputs, 10 classes)."""
    model = build_model("mlp", (40,), 10, list(hidden))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = benchmark_parser(
        __doc__, quick=f"{QUICK_PEERS} peers, MLP {QUICK_HIDDEN}, {QUICK_STEPS} steps"
    )
    add_swarm_options(
        parser, "convergence", peers="ring peers, default 8", steps=f"default {DEFAULT_STEPS}"
    )
    parser.add_argument(
        "--exponential-peers",
        type=at_least(1),
        default=None,
        help="peers on the exponential graph, default 16 (quick: the ring's)",
    )
    parser.add_argument(
        "--topologies",
        default="ring,exponential",
        help="which topologies to run, default ring,exponential",
    )
    parser.add_argument("--hidden", default=None, help=f"MLP widths, default {DEFAULT_HIDDEN}")
    parser.add_argument(
        "--lr-schedule",
        default="cosine",
        help="cosine (default: lr anneals to 0, so every setting ends on a settled model) "
        "or constant",
    )
    parser.add_argument(
        "--non-iid-setting",
        default="beer-stacked,beer-topk05-trits,beer-sign",
        help=f"the settings also run on {NON_IID} shards (ring), a comma list, default "
        "beer-stacked,beer-topk05-trits,beer-sign; 'none': skip",
    )
    parser.add_argument(
        "--engine",
        choices=("sim", "real"),
        default="sim",
        help="sim: the simulator (default); real: local processes",
    )
    parser.add_argument(
        "--jobs",
        type=at_least(1),
        default=1,
        help="runs at once (sim only), each with one torch thread",
    )
    add_only_option(parser, [s.key for s in SETTINGS])
    args = parser.parse_args()
    if args.jobs > 1 and args.engine != "sim":
        parser.error("--jobs N: N > 1 only with --engine sim")
    fill_defaults(
        args,
        steps=(QUICK_STEPS, DEFAULT_STEPS),
        peers=(QUICK_PEERS, 8),
        hidden=(QUICK_HIDDEN, DEFAULT_HIDDEN),
    )
    exponential = args.exponential_peers
    if exponential is None:
        exponential = args.peers if args.quick else 16
    peers = {"ring": args.peers, "exponential": exponential}
    topologies = [t for t in args.topologies.split(",") if t]
    if not topologies or not set(topologies) <= set(peers):
        parser.error(f"--topologies: choose from {', '.join(peers)}")
    chosen = [s for s in SETTINGS if s.key in args.only]
    jobs = [Job(s, t, peers[t]) for t in topologies for s in chosen]
    extra = [k for k in args.non_iid_setting.split(",") if k and k != "none"]
    unknown = sorted(set(extra) - {s.key for s in SETTINGS})
    if unknown:
        parser.error(f"--non-iid-setting {','.join(unknown)}: choose from the settings of --only")
    if "ring" in topologies:
        jobs += [Job(s, "ring", args.peers, NON_IID) for s in chosen if s.key in extra]
    configs = []
    for job in jobs:  # every run's config before the first run
        flags = {"peers": "--exponential-peers"} if job.topology == "exponential" else {}
        with usage_errors(parser, args, flags):
            configs.append(config_for(job, args))
    numel = parameter_count(configs[0].hidden)
    tasks = [(job, config, args.engine, numel) for job, config in zip(jobs, configs, strict=True)]

    rows = run_all(tasks, args.jobs)
    for row in rows:
        row["name"] = row["setting"] + (
            "" if row["partition"] == "iid" else f" ({row['partition']})"
        )
    compare(rows)
    targets = {
        name: {"met": None if by is None else bool(by), "by": by}
        for name, by in verdicts(rows).items()
    }
    on_ring = any(r["topology"] == "ring" for r in rows)  # the targets are the ring's
    job = f"MLP {args.hidden} on MNIST-1D, {args.steps} steps"
    plots = {
        t: plot_topology(rows, t, args.out, f"{job}, {TOPOLOGY_NAMES[t]} of {peers[t]}")
        for t in topologies
    }
    meta = {
        "steps": args.steps,
        "peers": peers,
        "model": f"mlp {args.hidden}",
        "parameters": numel,
        "seed": args.seed,
        "lr_schedule": args.lr_schedule,
        "engine": args.engine,
        "config": str(args.config) if args.config else None,
        "plot": str(next(iter(plots.values()))),
        "plots": {t: str(path) for t, path in plots.items()},
        "targets": targets,
    }
    columns = [
        Column("topology", "graph"),
        Column("name", "setting"),
        Column("codec", "codec"),
        Column("trigger", "when"),
        Column("gamma", "γ", "{:.3g}"),
        Column("accuracy", "final acc", "{:.4f}"),
        Column("gap_points", "gap (pts)", "{:+.2f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("ratio", "fewer bytes", "{:,.0f}x"),
        Column("bytes_to_target", "bytes to dense−1pt", lambda v: f"{v / 1e6:,.1f} MB"),
        Column("ratio_to_target", "fewer to target", "{:,.0f}x"),
        Column("consensus_distance", "consensus dist", "{:.3g}"),
        Column("wall_time_s", "wall s", "{:.0f}"),
    ]
    notes = [
        f"target ({name}): {mark(t['met'])}" + (f" by {', '.join(t['by'])}" if t["by"] else "")
        for name, t in targets.items()
    ]
    if not on_ring:
        notes = ["targets (each on the ring): not measured, no ring in --topologies"]
    report(
        "convergence",
        f"Convergence: MLP {args.hidden} ({numel:,} parameters) on MNIST-1D, {args.steps} "
        f"steps, {args.lr_schedule} lr, γ automatic ({args.engine} engine)",
        columns,
        rows,
        meta,
        args.json,
        notes=[*notes, *(f"plot ({t}): {path}" for t, path in plots.items())],
    )


if __name__ == "__main__":
    run_script(main)
