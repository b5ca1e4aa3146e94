"""Stability: the largest CHOCO step each codec and graph bear, beside the automatic γ.

What it measures
    For each codec and graph, CHOCO's consensus alone (``gossipdl.averaging.consensus``:
    gossipdl's own CHOCO and codecs in memory, no training, peers apart from one public
    copy, a small MLP's layout of 6,250 values so PowerSGD has layers): γ*, the largest
    step whose consensus distance does not grow over the second half of ``--rounds``
    rounds (bisection in log scale to 5.5%), the automatic step
    (``averaging.auto_gamma``) for a peer of that graph, and their ratio. Just above γ*
    nothing blows up at once: the spread stops shrinking and grows slowly, which
    training's pull hides until the learning rate anneals (README, *Accuracy against
    bytes*).

Target
    The automatic γ is at most 0.9 γ* for every codec and graph (a margin, not the
    edge), and not below 0.1 γ* for top-k (a step far below γ* mixes slowly).

Run
    python benchmarks/stability.py --json runs/bench-stability.json
    python benchmarks/stability.py --only topk:0.01,sign --graphs complete:16,torus:16
    python benchmarks/stability.py --only topk:0.01+qsgd:4 --graphs ring:8   # any codec
    python benchmarks/stability.py --quick          # top-1%, ring of 8, 300 rounds
    python benchmarks/stability.py --quick --only sign   # --only and --graphs still choose

    About 15 minutes on one core for the defaults (seven codecs, ring of 8, exponential
    graph of 16).

JSON (``--json FILE``): ``{"benchmark": "stability", "rows": [...], "meta": {...}}``; each
row has ``codec``, ``graph``, ``peers``, ``self_weight``, ``critical_gamma``,
``auto_gamma``, ``ratio`` (auto over critical) and ``wall_s``; ``meta`` holds ``rounds``,
the layout and each target's ``met`` under ``margin`` and ``slowest`` (null, not run, when
none of its rows ran: ``slowest`` without a top-k codec).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from _common import Column, at_least, benchmark_parser, mark, report, run_script
from rich.console import Console
from rich.progress import Progress

from gossipdl.averaging import auto_gamma
from gossipdl.averaging.consensus import critical_gamma
from gossipdl.compression import CodecError, build_codec
from gossipdl.topologies import build_topology

SHAPES = ((64, 40), (64,), (48, 64), (48,), (10, 48), (10,))  # 6,250 values in 3 layers
NUMEL = sum(math.prod(shape) for shape in SHAPES)
CODECS = ["topk:0.01", "topk:0.1", "topk:0.01+qsgd:16", "randomk:0.02:noscale", "qsgd:16", "sign",
          "powersgd:1"]  # fmt: skip
GRAPHS = "ring:8,exponential:16"
MARGIN, SLOWEST = 0.9, 0.1
QUICK_ROUNDS, ROUNDS = 300, 1500


def measure(spec: str, graph: str, peers: int, rounds: int) -> dict[str, Any]:
    """One row: γ* and the automatic γ for ``spec`` on ``graph`` of ``peers``."""
    topology = build_topology(graph, peers)
    self_weight = float(topology.mixing_matrix()[0, 0])  # these graphs are regular
    codec = build_codec(spec)
    codec.bind_layout(SHAPES)
    started = time.perf_counter()
    critical = critical_gamma(spec, topology, rounds, SHAPES)
    auto = auto_gamma(codec, NUMEL, self_weight)
    return {
        "codec": spec,
        "graph": graph,
        "peers": peers,
        "self_weight": self_weight,
        "critical_gamma": critical,
        "auto_gamma": auto,
        "ratio": auto / critical if critical > 0 else None,
        "wall_s": time.perf_counter() - started,
    }


def codec_list(value: str) -> list[str]:
    """``--only``'s codecs: any specs ``build_codec`` takes (e.g. ``topk:0.01+qsgd:4``)."""
    specs = [spec for spec in value.split(",") if spec.strip()]
    if not specs:
        raise argparse.ArgumentTypeError("give at least one codec spec")
    for spec in specs:
        try:
            build_codec(spec)
        except CodecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


def main() -> None:
    parser = benchmark_parser(
        __doc__,
        quick=f"top-1%% (unless --only) on a ring of 8 (unless --graphs), {QUICK_ROUNDS} rounds",
    )
    parser.add_argument("--graphs", default=None, help=f"GRAPH:PEERS,..., default {GRAPHS}")
    parser.add_argument(
        "--rounds", type=at_least(2), default=None, help=f"default {ROUNDS} (quick {QUICK_ROUNDS})"
    )
    parser.add_argument(
        "--only",
        type=codec_list,
        default=None,
        help=f"comma-separated codec specs (any codec), default {','.join(CODECS)}",
    )
    args = parser.parse_args()
    rounds = args.rounds
    if rounds is None:
        rounds = QUICK_ROUNDS if args.quick else ROUNDS
    codecs = args.only or (["topk:0.01"] if args.quick else CODECS)
    graphs = []
    for item in (args.graphs or ("ring:8" if args.quick else GRAPHS)).split(","):
        name, _, peers = item.partition(":")
        if not peers.isdigit():
            parser.error(f"--graphs: {item!r} is not GRAPH:PEERS (e.g. ring:8)")
        try:
            build_topology(name, int(peers))
        except ValueError as err:  # TopologyError: an unknown name, a count it cannot take
            parser.error(f"--graphs: {item!r}: {err}")
        graphs.append((name, int(peers)))
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        bar = progress.add_task("bisecting γ*", total=len(codecs) * len(graphs))
        for spec in codecs:
            for name, peers in graphs:
                rows.append(measure(spec, name, peers, rounds))
                progress.advance(bar)
    topk = [r for r in rows if r["codec"].startswith("topk")]
    targets = {  # each target: what it says, the rows it judges, those that miss it
        "margin": (f"auto γ <= {MARGIN:g} γ* everywhere", rows,
                   [r for r in rows if r["ratio"] is None or r["ratio"] > MARGIN]),  # None: γ* = 0
        "slowest": (f"top-k's auto γ >= {SLOWEST:g} γ*", topk,
                    [r for r in topk if (r["ratio"] or 0) < SLOWEST]),
    }  # fmt: skip
    # None: not run (``--only`` left out every top-k codec), not met
    met = {key: not failing if judged else None for key, (_, judged, failing) in targets.items()}
    notes = [
        f"target ({name}): {mark(met[key])}" + (f" by {_names(failing)}" if failing else "")
        for key, (name, _, failing) in targets.items()
    ]
    columns = [
        Column("codec", "codec"),
        Column("graph", "graph"),
        Column("peers", "peers"),
        Column("self_weight", "W_ii", "{:.3f}"),
        Column("critical_gamma", "γ*", "{:.4f}"),
        Column("auto_gamma", "auto γ", "{:.4f}"),
        Column("ratio", "auto / γ*", "{:.2f}"),
        Column("wall_s", "wall s", "{:.0f}"),
    ]
    meta = {"rounds": rounds, "shapes": [list(s) for s in SHAPES], "numel": NUMEL,
            **{key: {"met": value} for key, value in met.items()}}  # fmt: skip
    report(
        "stability",
        f"CHOCO's largest stable step (consensus alone, {rounds} rounds) and the automatic γ",
        columns,
        rows,
        meta,
        args.json,
        notes=notes,
    )


def _names(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['codec']} on {r['graph']}:{r['peers']}" for r in rows)


if __name__ == "__main__":
    run_script(main)
