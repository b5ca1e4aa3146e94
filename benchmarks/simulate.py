"""Simulate: does a simulated swarm tell the truth about a real one, and how large can it get?

What it measures
    From one invocation, each case's job run by the real engine
    (``gossipdl.experiments.launcher.launch``: one process per peer, sockets,
    wall clock) and by the simulated one (``gossipdl.sim.engine.simulate``:
    virtual peers in one process on virtual time, over the same encoder and
    codecs), into ``OUT/<case>/<engine>`` (a previous run there is replaced):

    * ``quickstart`` (fidelity): the quick start's job, ``gossipdl run`` with no
      arguments: 4 peers, a 1-D CNN on MNIST-1D, dense gossip on a ring,
      1500 steps (``--steps``). Mean final test accuracy and total bytes sent
      (every frame handed to a socket), real against simulated;
    * ``choco`` (fidelity): ``--peers`` (8) peers, CHOCO-SGD with top-1% on a
      ring, the convergence benchmark's MLP 40-1024-512-10 (571,914
      parameters, so payloads rather than headers make up the bytes), 1500
      steps (``--steps``). The same two comparisons;
    * ``edge`` (fidelity): the ``choco`` job on device links: every peer
      behind 10 Mbit/s up and down with 20 ms latency, and a step that takes
      at least 300 ms (the profile's ``step_time``; the real engine waits out
      what the host does faster), ``--edge-steps`` (400) steps, evaluated
      every 10. Time to ``--target`` (0.45) accuracy: the slowest peer's
      training time (start-up excluded) at the first evaluation where the
      peers' mean reached it, in wall seconds for the real run and in
      simulated seconds for the simulated one;
    * ``scale`` (simulated only): ``--scale-peers`` (256) virtual peers, the 1-D
      CNN on MNIST-1D, an exponential graph, CHOCO top-1%, ``--scale-steps``
      (1000) steps, with the step time measured on this host. MNIST-1D here is
      the fixed set every run generates (4,000 training samples, no size
      option), so each of 256 iid shards holds about 15 samples.

    Every simulated run happens in a fresh child process, so ``peak_rss_mb``
    is that run's own peak resident memory (``ru_maxrss``, start-up and
    torch included); a real swarm is one process per peer and its rows leave
    the column empty. ``wall_s`` is the host time each run took, start-up
    included. The parameter server is not simulated yet, so the edge
    comparison (ring all-reduce, parameter server and gossip) is not made here.

Target
    Fidelity: on ``quickstart`` and ``choco`` the simulated mean accuracy is
    within 1 point of the real one and its total bytes within 1%; on
    ``edge`` its time to target is within 15% of the real one. Scale: 256
    peers for 1000 steps in under 20 minutes and under 6 GB.

Run
    python benchmarks/simulate.py --json runs/bench-simulate.json
    python benchmarks/simulate.py --cases scale --scale-peers 64 --scale-steps 200
    python benchmarks/simulate.py --quick      # small swarms, tiny MLP, 40 steps: a smoke test

JSON (``--json FILE``): ``{"benchmark": "simulate", "rows": [...], "meta": {...}}``;
each row has ``case``, ``engine`` (``real`` or ``sim``), ``peers``, ``steps``,
``accuracy`` (the peers' mean final test accuracy), ``bytes`` (total sent),
``time_to_target_s`` (edge case only; null when not reached),
``simulated_time_s`` (sim rows), ``wall_s``, ``peak_rss_mb`` (sim rows) and
``run_dir``; ``meta`` holds the settings, per fidelity case the
``accuracy_gap_points``, ``bytes_ratio`` (sim / real) and ``time_ratio``
(sim / real) with whether each target holds, the scale case's verdicts, and
``met`` (every target of the cases run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    Column,
    benchmark_parser,
    fresh_run_dir,
    report,
    run_script,
    start_worker,
)
from rich.console import Console

from gossipdl.config import Config, from_dict, to_dict
from gossipdl.experiments.launcher import Interrupted, launch
from gossipdl.experiments.plots import ACCURACY_VS_TIME, plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.rundir import RunDir

FIDELITY = ("quickstart", "choco", "edge")
CASES = (*FIDELITY, "scale")
GROUPS = {"fidelity": FIDELITY, "scale": ("scale",)}
ACCURACY_POINTS, BYTES_FRACTION, TIME_FRACTION = 1.0, 0.01, 0.15
SCALE_WALL_S, SCALE_RSS_MB = 20 * 60.0, 6 * 1024.0
MLP, QUICK_MLP = (1024, 512), (64,)
EDGE_LINK = {"up": "10mbit", "down": "10mbit", "latency": "20ms"}


@dataclass(frozen=True)
class Case:
    """One compared job: its config and which engines run it."""

    key: str
    config: Config
    engines: tuple[str, ...] = ("real", "sim")
    target: float | None = None  # the accuracy whose time is compared


def cases_option(value: str) -> list[str]:
    """``--cases``: case names or the groups ``fidelity`` and ``scale``, in table order."""
    keys: set[str] = set()
    for name in value.split(","):
        if name not in CASES and name not in GROUPS:
            raise argparse.ArgumentTypeError(
                f"unknown case {name!r}; known: {', '.join([*GROUPS, *FIDELITY])}"
            )
        keys.update(GROUPS.get(name, (name,)))
    return [c for c in CASES if c in keys]


def cases_for(args: argparse.Namespace) -> list[Case]:
    """The chosen cases' configs (``--quick`` shrinks each to a few seconds)."""
    quick = args.quick
    hidden = QUICK_MLP if quick else MLP
    mlp_job: dict[str, Any] = {
        "peers": args.peers,
        "model": "mlp",
        "hidden": hidden,
        "dataset": "mnist1d",
        "topology": "ring",
        "algorithm": "choco",
        "codec": "topk:0.01",
        "seed": args.seed,
    }
    edge_profile = {"peers": "*", **EDGE_LINK, "step_time": args.step_time}
    everything = {
        "quickstart": Case("quickstart", Config(steps=args.steps, seed=args.seed)),
        "choco": Case("choco", from_dict({**mlp_job, "steps": args.steps})),
        "edge": Case(
            "edge",
            from_dict(
                {
                    **mlp_job,
                    "steps": args.edge_steps,
                    "eval_every": 10,
                    "profiles": {"edge": edge_profile},
                    # the first, dense CHOCO round moves 2.3 MB per neighbour at 10 Mbit/s
                    "round_timeout": 30.0,
                    "dead_after": 15.0,
                }
            ),
            target=args.target,
        ),
        "scale": Case(
            "scale",
            Config(
                peers=args.scale_peers,
                model="cnn1d",
                dataset="mnist1d",
                topology="exponential",
                algorithm="choco",
                codec="topk:0.01",
                steps=args.scale_steps,
                eval_every=max(1, args.scale_steps // 4),
                log_every=max(10, args.scale_steps // 20),
                seed=args.seed,
            ),
            engines=("sim",),
        ),
    }
    return [everything[key] for key in args.cases]


# ------------------------------------------------------------------ the simulated engine
def _simulate_worker(values: dict[str, Any], conn: Connection) -> None:
    """In a fresh process: simulate the config, send back its summary and this process's
    peak resident memory (MiB), or the traceback."""
    from gossipdl.experiments.simulated import simulate

    exit_code = 0
    try:
        summary = simulate(from_dict(values))
        keep = ("mean_accuracy", "total_bytes_sent", "simulated_time_s", "host_time_s")
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        conn.send({"summary": {k: summary[k] for k in keep}, "peak_rss_mb": peak_mb})
    except Interrupted as exc:  # the script stops us: it says so, once
        conn.send({"error": str(exc)})
        exit_code = exc.exit_code
    except BaseException:  # the script prints the traceback
        conn.send({"error": traceback.format_exc()})
        exit_code = 1
    finally:
        conn.close()
    if exit_code:
        raise SystemExit(exit_code)


def run_simulated(config: Config) -> tuple[dict[str, Any], float]:
    """Simulate ``config`` in a child process; its summary and peak RSS (MiB). A stop signal
    here stops the child too (it writes what it simulated and exits)."""
    context = multiprocessing.get_context("spawn")  # a fresh process: its own peak memory
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_simulate_worker, args=(to_dict(config), send), name="simulate", daemon=True
    )
    start_worker(child)
    send.close()
    try:
        try:
            answer = receive.recv()
        except EOFError:
            answer = {"error": f"the simulating process died (exit code {child.exitcode})"}
        child.join()
    finally:
        if child.is_alive():
            child.terminate()  # SIGTERM: the simulation stops and writes its summary
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    if "error" in answer:
        raise SystemExit(f"simulating {config.out} failed:\n{answer['error']}")
    return answer["summary"], answer["peak_rss_mb"]


# ------------------------------------------------------------------ one row
def run_case(case: Case, engine: str, out: Path) -> dict[str, Any]:
    """Run ``case`` on ``engine`` into ``out/<case>/<engine>`` and read its row."""
    config = case.config.replace(out=str(out / case.key / engine))
    run = RunDir(config.out)
    fresh_run_dir(run.root)
    started = time.perf_counter()
    if engine == "real":
        summary, peak_mb = launch(config, progress=False), None
    else:
        summary, peak_mb = run_simulated(config)
    wall = time.perf_counter() - started
    curve = accuracy_curve(run)
    hit = None
    if case.target is not None:
        hit = next((p for p in curve if p["accuracy"] >= case.target), None)
    return {
        "case": case.key,
        "engine": engine,
        "peers": config.peers,
        "steps": config.steps,
        "accuracy": summary["mean_accuracy"],
        "bytes": summary["total_bytes_sent"],
        "time_to_target_s": None if hit is None else hit["training_s"],
        "simulated_time_s": summary.get("simulated_time_s"),
        "wall_s": wall,
        "peak_rss_mb": peak_mb,
        "run_dir": config.out,
        "curve": curve,
    }


# ------------------------------------------------------------------ verdicts
def fidelity(case: Case, real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Simulated against real: the accuracy gap, the bytes and time ratios, and the targets."""
    verdict: dict[str, Any] = {"accuracy_gap_points": None, "bytes_ratio": None}
    if real["accuracy"] is not None and sim["accuracy"] is not None:
        verdict["accuracy_gap_points"] = (sim["accuracy"] - real["accuracy"]) * 100
    if real["bytes"]:
        verdict["bytes_ratio"] = sim["bytes"] / real["bytes"]
    if case.target is not None:  # the edge case: time is what it compares
        real_s, sim_s = real["time_to_target_s"], sim["time_to_target_s"]
        ratio = sim_s / real_s if real_s and sim_s is not None else None
        verdict.update(
            target_accuracy=case.target,
            time_ratio=ratio,
            time_within_15pct=ratio is not None and abs(ratio - 1) <= TIME_FRACTION,
        )
        verdict["met"] = verdict["time_within_15pct"]
        return verdict
    gap, ratio = verdict["accuracy_gap_points"], verdict["bytes_ratio"]
    verdict["accuracy_within_1_point"] = gap is not None and abs(gap) <= ACCURACY_POINTS
    verdict["bytes_within_1pct"] = ratio is not None and abs(ratio - 1) <= BYTES_FRACTION
    verdict["met"] = verdict["accuracy_within_1_point"] and verdict["bytes_within_1pct"]
    return verdict


def scale_verdict(row: dict[str, Any]) -> dict[str, Any]:
    under_time, under_memory = row["wall_s"] < SCALE_WALL_S, row["peak_rss_mb"] < SCALE_RSS_MB
    return {
        "wall_s": row["wall_s"],
        "peak_rss_mb": row["peak_rss_mb"],
        "under_20_min": under_time,
        "under_6_gb": under_memory,
        "met": under_time and under_memory,
    }


def note_for(key: str, verdict: dict[str, Any]) -> str:
    """One line per case under the table."""
    mark = "[green]met[/]" if verdict["met"] else "[red]missed[/]"

    def show(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    if key == "scale":
        return (
            f"scale: {verdict['wall_s'] / 60:.1f} min (< 20), "
            f"{verdict['peak_rss_mb'] / 1024:.2f} GB peak (< 6): {mark}"
        )
    if "time_ratio" in verdict:
        return (
            f"{key}: time to {verdict['target_accuracy']:g} sim/real "
            f"{show(verdict['time_ratio'], '{:.3f}')} (within 15%): {mark}"
        )
    return (
        f"{key}: accuracy sim − real {show(verdict['accuracy_gap_points'], '{:+.2f}')} points "
        f"(within 1), bytes sim/real {show(verdict['bytes_ratio'], '{:.4f}')} (within 1%): {mark}"
    )


def main() -> None:
    parser = benchmark_parser(
        __doc__,
        quick="4-peer swarms, MLP 64, 40 steps, scale 16 peers x 20 steps",
    )
    parser.add_argument(
        "--cases",
        type=cases_option,
        default=list(CASES),
        help="comma-separated: fidelity (= quickstart,choco,edge), scale, or single cases; "
        "default all",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="quickstart and choco steps, default 1500"
    )
    parser.add_argument("--peers", type=int, default=None, help="choco and edge peers, default 8")
    parser.add_argument("--edge-steps", type=int, default=None, help="edge steps, default 400")
    parser.add_argument("--step-time", default=None, help='edge profile step_time, default "300ms"')
    parser.add_argument(
        "--target", type=float, default=None, help="edge target accuracy, default 0.45"
    )
    parser.add_argument("--scale-peers", type=int, default=None, help="default 256")
    parser.add_argument("--scale-steps", type=int, default=None, help="default 1000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-simulate"))
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (40 if quick else 1500)
    args.peers = args.peers or (4 if quick else 8)
    args.edge_steps = args.edge_steps or (40 if quick else 400)
    args.step_time = args.step_time or ("50ms" if quick else "300ms")
    args.target = args.target or (0.2 if quick else 0.45)
    args.scale_peers = args.scale_peers or (16 if quick else 256)
    args.scale_steps = args.scale_steps or (20 if quick else 1000)

    console = Console(stderr=True)
    rows, verdicts = [], {}
    for case in cases_for(args):
        by_engine = {}
        for engine in case.engines:
            console.print(f"running {case.key} ({engine}): {case.config.peers} peers …")
            by_engine[engine] = run_case(case, engine, args.out)
            rows.append(by_engine[engine])
        if case.key == "scale":
            verdicts["scale"] = scale_verdict(by_engine["sim"])
        else:
            verdicts[case.key] = fidelity(case, by_engine["real"], by_engine["sim"])

    plot = None
    edge = {r["engine"]: r["curve"] for r in rows if r["case"] == "edge"}
    if edge:
        plot = plot_curves(
            {f"{engine} ({'wall' if engine == 'real' else 'simulated'} s)": curve
             for engine, curve in edge.items()},
            args.out / "edge_time.png",
            f"edge: {args.peers} peers, 10 Mbit/s, step_time {args.step_time}, real vs simulated",
            panels=(ACCURACY_VS_TIME,),
            mark_y=args.target,
        )  # fmt: skip
    meta = {
        "cases": args.cases,
        "steps": args.steps,
        "peers": args.peers,
        "edge_steps": args.edge_steps,
        "edge_link": EDGE_LINK,
        "step_time": args.step_time,
        "target": args.target,
        "scale_peers": args.scale_peers,
        "scale_steps": args.scale_steps,
        "seed": args.seed,
        "quick": quick,
        "targets": {
            "accuracy_points": ACCURACY_POINTS,
            "bytes_fraction": BYTES_FRACTION,
            "time_fraction": TIME_FRACTION,
            "scale_wall_s": SCALE_WALL_S,
            "scale_peak_rss_mb": SCALE_RSS_MB,
        },
        "fidelity": {k: v for k, v in verdicts.items() if k != "scale"},
        "scale": verdicts.get("scale"),
        "met": all(v["met"] for v in verdicts.values()),
        "plot": None if plot is None else str(plot),
    }
    columns = [
        Column("case", "case"),
        Column("engine", "engine"),
        Column("peers", "peers"),
        Column("steps", "steps"),
        Column("accuracy", "mean acc", "{:.4f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.2f} MB"),
        Column("time_to_target_s", "time to target s", "{:.1f}"),
        Column("simulated_time_s", "simulated s", "{:.2f}"),
        Column("wall_s", "wall s", "{:.1f}"),
        Column("peak_rss_mb", "peak RSS MB", "{:,.0f}"),
    ]
    notes = [note_for(key, verdict) for key, verdict in verdicts.items()]
    if plot is not None:
        notes.append(f"plot: {plot}")
    table_rows = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    report(
        "simulate",
        "Simulate: real vs simulated engine, and a large simulated swarm",
        columns,
        table_rows,
        meta,
        args.json,
        notes=notes,
    )


if __name__ == "__main__":
    run_script(main)
