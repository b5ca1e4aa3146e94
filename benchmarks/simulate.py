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
      (1000) steps, with the step time measured on this host. MNIST-1D is
      generated with 250 training samples for every peer (``mnist1d:64000``
      for 256 peers: the standard set's 4,000 would leave each iid shard about
      15) and the standard 1,000 test samples; generating 64,000 takes about
      half a minute the first time, cached after that (``gossipdl.data``);
    * ``speed``: the edge benchmark's comparison (``benchmarks/edge.py``, its
      settings and defaults: 8 peers, MNIST-1D, MLP 40-1024-512-10, SGD lr
      0.05 momentum 0.9, every link 10 Mbit/s up and down with 20 ms latency)
      of CHOCO top-1% on a ring, dense ring all-reduce, a synchronous
      parameter server (dense) and dense gossip on a ring, each until the
      peers' mean accuracy reaches 0.45 or the budget (600 s of training)
      passes, simulated with the step time measured on this host; against the
      same settings run for real here (``edge.run_setting``, about 25
      minutes), or against a recorded real run (``--real-edge-json``, what
      ``benchmarks/edge.py --json`` wrote with the same settings). Its
      ranking (time to target per setting), CHOCO's speed-up over the ring,
      and the host time each engine took.

    Every simulated run happens in a fresh child process, so ``peak_rss_mb``
    is that run's own peak resident memory (``ru_maxrss``, start-up and
    torch included); a real swarm is one process per peer and its rows leave
    the column empty. ``wall_s`` is the host time each run took, start-up
    included; for a real speed row it is the launch's wall time, start-up
    included (``wall_time_s`` of the edge benchmark's row).

Target
    Fidelity: on ``quickstart`` and ``choco`` the simulated mean accuracy is
    within 1 point of the real one and its total bytes within 1%; on
    ``edge`` its time to target is within 15% of the real one. Scale: 256
    peers for 1000 steps in under 20 minutes and under 6 GB. Speed: the
    four simulated settings take at least 20x less host time than the real
    ones (the same ranking is reported, not a target).

Run
    python benchmarks/simulate.py --json runs/bench-simulate.json
    python benchmarks/simulate.py --cases scale --scale-peers 64 --scale-steps 200
    python benchmarks/simulate.py --cases speed --real-edge-json runs/bench-edge.json
    python benchmarks/simulate.py --quick      # small swarms, tiny MLP, 40 steps: a smoke test

JSON (``--json FILE``): ``{"benchmark": "simulate", "rows": [...], "meta": {...}}``;
each row has ``case``, ``engine`` (``real`` or ``sim``), ``setting`` (speed
rows: the edge benchmark's name of it), ``peers``, ``steps``, ``accuracy``
(the peers' mean final test accuracy; speed rows: at the last common
evaluation), ``bytes`` (total sent; speed rows: until the target),
``time_to_target_s`` (edge and speed cases; null when not reached),
``simulated_time_s`` (sim rows), ``wall_s``, ``peak_rss_mb`` (sim rows) and
``run_dir``; ``meta`` holds the settings, per fidelity case the
``accuracy_gap_points``, ``bytes_ratio`` (sim / real) and ``time_ratio``
(sim / real) with whether each target holds, the scale case's verdicts, the
speed case's (``ranking`` and ``choco_vs_ring`` per engine, ``same_ranking``,
``wall_ratio``: real / sim host time), and ``met`` (every target of the cases run).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    Column,
    at_least,
    benchmark_parser,
    fresh_run_dir,
    mark,
    report,
    run_script,
    start_worker,
    usage_errors,
)
from edge import TIME_LOG, config_for, name_of, options, over, run_setting, setting_row
from rich.console import Console

from gossipdl.config import Config, from_dict, to_dict
from gossipdl.experiments import forking
from gossipdl.experiments.launcher import Interrupted, launch
from gossipdl.experiments.plots import ACCURACY_VS_TIME, plot_curves
from gossipdl.experiments.summary import accuracy_curve
from gossipdl.rundir import RunDir

FIDELITY = ("quickstart", "choco", "edge")
CASES = (*FIDELITY, "scale", "speed")
GROUPS = {"fidelity": FIDELITY, "scale": ("scale",)}
ACCURACY_POINTS, BYTES_FRACTION, TIME_FRACTION = 1.0, 0.01, 0.15
SCALE_WALL_S, SCALE_RSS_MB = 20 * 60.0, 6 * 1024.0
SCALE_SAMPLES_PER_PEER = 250  # the scale case's MNIST-1D: this many training samples a peer
SPEED = ("choco", "ring", "ps", "dense")  # the edge benchmark's settings the speed case runs
SPEED_WALL_RATIO = 20.0  # the simulated settings take at least this much less host time
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
                f"unknown case {name!r}; known: {', '.join([*GROUPS, *FIDELITY, 'speed'])}"
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
                dataset=f"mnist1d:{SCALE_SAMPLES_PER_PEER * args.scale_peers}",
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
    return [everything[key] for key in args.cases if key != "speed"]


# ------------------------------------------------------------------ the simulated engine
def _simulate_worker(
    values: dict[str, Any], conn: Connection, until: Callable[[RunDir], bool] | None
) -> None:
    """In a fresh process: simulate the config (until ``until`` says), send back its summary
    and this process's peak resident memory (MiB), or the traceback."""
    from gossipdl.experiments.simulated import simulate

    exit_code = 0
    try:
        summary = simulate(from_dict(values), until=until)
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


def run_simulated(
    config: Config, until: Callable[[RunDir], bool] | None = None
) -> tuple[dict[str, Any], float]:
    """Simulate ``config`` in a child process (``until``: a picklable early end, as
    ``simulate`` takes it); its summary and peak RSS (MiB). A stop signal here stops the
    child too (it writes what it simulated and exits)."""
    context = forking.context()  # forked, preloaded: its own peak memory, no import cost
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_simulate_worker, args=(to_dict(config), send, until), name="simulate", daemon=True
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


# ------------------------------------------------------------------ the speed case
def edge_options(args: argparse.Namespace) -> argparse.Namespace:
    """The edge benchmark's settings for the speed case: its own defaults (``--quick``'s
    with ``--quick``), its real runs under ``OUT/speed/real``."""
    argv = ["--seed", str(args.seed), "--out", str(args.out / "speed" / "real"), "--no-progress"]
    return options(argv + (["--quick"] if args.quick else []))


def speed_row(
    engine: str, edge_row: dict[str, Any], peers: int, wall_s: float, peak_mb: float | None
) -> dict[str, Any]:
    """A speed row from the edge benchmark's row of one setting (``curve`` when it has one)."""
    return {
        "case": "speed",
        "engine": engine,
        "setting": edge_row["setting"],
        "peers": peers,
        "steps": edge_row["steps"],
        "accuracy": edge_row["final_accuracy"],
        "bytes": edge_row["bytes"],
        "reached": edge_row["reached"],
        "time_to_target_s": edge_row["time_to_target_s"],
        "simulated_time_s": edge_row["wall_time_s"] if engine == "sim" else None,
        "wall_s": wall_s,
        "peak_rss_mb": peak_mb,
        "run_dir": edge_row["run_dir"],
        "curve": edge_row.get("curve", []),
    }


def simulate_setting(key: str, edge: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Simulate one edge setting (in a child process) until its target or budget."""
    config = config_for(key, edge).replace(out=str(out / "speed" / "sim" / key))
    run = RunDir(config.out)
    fresh_run_dir(run.root)
    started = time.perf_counter()
    until = functools.partial(over, target=edge.target, budget=edge.budget)
    _, peak_mb = run_simulated(config, until)
    wall = time.perf_counter() - started
    summary = json.loads(run.summary.read_text())
    return speed_row("sim", setting_row(key, edge, run, summary), edge.peers, wall, peak_mb)


def recorded_edge_rows(path: Path, edge: argparse.Namespace) -> list[dict[str, Any]]:
    """The real speed rows from ``benchmarks/edge.py --json``'s file, which must hold every
    speed setting, run with the settings the simulation runs."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--real-edge-json {path}: cannot read it ({exc})") from None
    if document.get("benchmark") != "edge":
        raise SystemExit(f"--real-edge-json {path}: not a `benchmarks/edge.py --json` file")
    meta = document["meta"]
    for key in ("peers", "target", "budget_s", "link", "seed", "quick"):
        ours = getattr(edge, "budget" if key == "budget_s" else key)
        if meta.get(key) != ours:
            raise SystemExit(
                f"--real-edge-json {path} was run with {key} = {meta.get(key)!r}, the simulation "
                f"runs {ours!r}; record it again with the edge benchmark's defaults"
                + (" and --quick" if edge.quick else "")
            )
    by_name = {row["setting"]: row for row in document["rows"]}
    missing = [name_of(k, edge) for k in SPEED if name_of(k, edge) not in by_name]
    if missing:
        raise SystemExit(
            f"--real-edge-json {path} has no row for {', '.join(missing)}; record it with "
            f"--only {','.join(SPEED)}"
        )
    return [
        speed_row("real", by_name[name_of(k, edge)], edge.peers,
                  by_name[name_of(k, edge)]["wall_time_s"], None)
        for k in SPEED
    ]  # fmt: skip


def run_speed(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """The speed case's rows: the real settings (run here, or recorded), then simulated."""
    edge = edge_options(args)
    if args.real_edge_json is not None:
        real = recorded_edge_rows(args.real_edge_json, edge)
    else:
        real = []
        for key in SPEED:
            console.print(f"running speed ({name_of(key, edge)}, real): {edge.peers} peers …")
            row = run_setting(key, edge, console)
            real.append(speed_row("real", row, edge.peers, row["wall_time_s"], None))
    sim = []
    for key in SPEED:
        console.print(f"running speed ({name_of(key, edge)}, sim): {edge.peers} peers …")
        sim.append(simulate_setting(key, edge, args.out))
    return real + sim


def speed_verdict(rows: list[dict[str, Any]], edge: argparse.Namespace) -> dict[str, Any]:
    """Per engine the ranking by time to target and CHOCO's speed-up over the ring (a lower
    bound when the ring did not reach the target within the budget); the host time each
    engine took for the four settings, and whether the simulator took 20x less."""
    choco, ring = name_of("choco", edge), name_of("ring", edge)
    verdict: dict[str, Any] = {"target_accuracy": edge.target, "budget_s": edge.budget}
    for engine in ("real", "sim"):
        mine = {r["setting"]: r for r in rows if r["engine"] == engine}
        reached = sorted((r for r in mine.values() if r["reached"]),
                         key=lambda r: r["time_to_target_s"])  # fmt: skip
        ring_s = mine[ring]["time_to_target_s"] or edge.budget
        choco_s = mine[choco]["time_to_target_s"]
        verdict[engine] = {
            "ranking": [r["setting"] for r in reached],
            "not_reached": sorted(set(mine) - {r["setting"] for r in reached}),
            "choco_vs_ring": None if choco_s is None else ring_s / choco_s,
            "choco_vs_ring_is_lower_bound": not mine[ring]["reached"],
            "wall_s": sum(r["wall_s"] for r in mine.values()),
        }
    ratio = verdict["real"]["wall_s"] / verdict["sim"]["wall_s"]
    verdict.update(
        same_ranking=verdict["real"]["ranking"] == verdict["sim"]["ranking"],
        wall_ratio=ratio,
        wall_20x_less=ratio >= SPEED_WALL_RATIO,
        met=ratio >= SPEED_WALL_RATIO,
    )
    return verdict


def speed_notes(verdict: dict[str, Any]) -> list[str]:
    """Lines under the table: each engine's ranking and CHOCO-vs-ring ratio, the wall times."""
    lines = []
    for engine in ("real", "sim"):
        mine = verdict[engine]
        ranking = " < ".join(mine["ranking"]) or "none reached the target"
        if mine["not_reached"]:
            ranking += f" (not reached: {', '.join(mine['not_reached'])})"
        bound = "≥ " if mine["choco_vs_ring_is_lower_bound"] else ""
        ratio = mine["choco_vs_ring"]
        shown = "-" if ratio is None else f"{bound}{ratio:.1f}x"
        lines.append(f"speed ({engine}): {ranking}; CHOCO vs ring all-reduce: {shown} sooner")
    met = mark(verdict["met"])
    lines.append(
        f"speed: host time real {verdict['real']['wall_s']:,.0f} s, simulated "
        f"{verdict['sim']['wall_s']:,.0f} s: {verdict['wall_ratio']:.1f}x less (at least "
        f"{SPEED_WALL_RATIO:g}x): {met}; same ranking: "
        f"{'yes' if verdict['same_ranking'] else 'no'}"
    )
    return lines


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
    met = mark(verdict["met"])

    def show(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    if key == "scale":
        return (
            f"scale: {verdict['wall_s'] / 60:.1f} min (< 20), "
            f"{verdict['peak_rss_mb'] / 1024:.2f} GB peak (< 6): {met}"
        )
    if "time_ratio" in verdict:
        return (
            f"{key}: time to {verdict['target_accuracy']:g} sim/real "
            f"{show(verdict['time_ratio'], '{:.3f}')} (within 15%): {met}"
        )
    return (
        f"{key}: accuracy sim − real {show(verdict['accuracy_gap_points'], '{:+.2f}')} points "
        f"(within 1), bytes sim/real {show(verdict['bytes_ratio'], '{:.4f}')} (within 1%): {met}"
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
        help="comma-separated: fidelity (= quickstart,choco,edge), scale, speed, or single "
        "cases; default all",
    )
    parser.add_argument(
        "--real-edge-json",
        metavar="FILE",
        type=Path,
        default=None,
        help="speed: compare with this `benchmarks/edge.py --json` record of the same settings "
        "instead of running them for real here (~25 min)",
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=None, help="quickstart and choco steps, default 1500"
    )
    parser.add_argument(
        "--peers", type=at_least(2), default=None, help="choco and edge peers, default 8"
    )
    parser.add_argument(
        "--edge-steps", type=at_least(1), default=None, help="edge steps, default 400"
    )
    parser.add_argument("--step-time", default=None, help='edge profile step_time, default "300ms"')
    parser.add_argument(
        "--target", type=float, default=None, help="edge target accuracy, default 0.45"
    )
    parser.add_argument("--scale-peers", type=at_least(2), default=None, help="default 256")
    parser.add_argument("--scale-steps", type=at_least(1), default=None, help="default 1000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-simulate"))
    args = parser.parse_args()
    quick = args.quick
    defaults = {  # --quick's, the full run's
        "steps": (40, 1500), "peers": (4, 8), "edge_steps": (40, 400),
        "step_time": ("50ms", "300ms"), "target": (0.2, 0.45), "scale_peers": (16, 256),
        "scale_steps": (20, 1000),
    }  # fmt: skip
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if quick else full)
    with usage_errors(parser, args):  # each case's config before the first run
        cases = cases_for(args)
    console = Console(stderr=True)
    rows, verdicts = [], {}
    for case in cases:
        by_engine = {}
        for engine in case.engines:
            console.print(f"running {case.key} ({engine}): {case.config.peers} peers …")
            by_engine[engine] = run_case(case, engine, args.out)
            rows.append(by_engine[engine])
        if case.key == "scale":
            verdicts["scale"] = scale_verdict(by_engine["sim"])
        else:
            verdicts[case.key] = fidelity(case, by_engine["real"], by_engine["sim"])
    if "speed" in args.cases:
        speed = run_speed(args, console)
        rows += speed
        verdicts["speed"] = speed_verdict(speed, edge_options(args))

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
    speed_plot = None
    if "speed" in verdicts:
        speed_plot = plot_curves(
            {f"{r['setting']} ({r['engine']})": r["curve"] for r in rows
             if r["case"] == "speed" and r["curve"]},
            args.out / "speed_time.png",
            "speed: the edge settings, real (wall s) and simulated (simulated s)",
            panels=(TIME_LOG,),
            mark_y=verdicts["speed"]["target_accuracy"],
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
        "real_edge_json": None if args.real_edge_json is None else str(args.real_edge_json),
        "fidelity": {k: v for k, v in verdicts.items() if k not in ("scale", "speed")},
        "scale": verdicts.get("scale"),
        "speed": verdicts.get("speed"),
        "met": all(v["met"] for v in verdicts.values()),
        "plot": None if plot is None else str(plot),
        "speed_plot": None if speed_plot is None else str(speed_plot),
    }
    columns = [
        Column("case", "case"),
        Column("engine", "engine"),
        Column("setting", "setting"),
        Column("peers", "peers"),
        Column("steps", "steps"),
        Column("accuracy", "mean acc", "{:.4f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.2f} MB"),
        Column("time_to_target_s", "time to target s", "{:.1f}"),
        Column("simulated_time_s", "simulated s", "{:.2f}"),
        Column("wall_s", "wall s", "{:.1f}"),
        Column("peak_rss_mb", "peak RSS MB", "{:,.0f}"),
    ]
    notes = []
    for key, verdict in verdicts.items():
        notes += speed_notes(verdict) if key == "speed" else [note_for(key, verdict)]
    notes += [f"plot: {path}" for path in (plot, speed_plot) if path is not None]
    table_rows = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    report(
        "simulate",
        "Simulate: real vs simulated engine, a large simulated swarm, the edge settings' speed",
        columns,
        table_rows,
        meta,
        args.json,
        notes=notes,
    )


if __name__ == "__main__":
    run_script(main)
