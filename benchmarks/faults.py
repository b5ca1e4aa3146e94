"""Faults: what deaths, restarts, message loss and a partition cost a CHOCO swarm.

What it measures
    From one invocation, the same job once per scenario: 8 peers (``--peers``) on
    iid MNIST-1D shards, the default 1-D CNN, CHOCO-SGD with ``topk:0.01`` on a
    ring, a cosine learning rate, checkpoints every 100 steps, heartbeats every
    0.5 s and death after 3 s of silence. Peers run on three emulated hosts
    (network namespaces on a bridge; peer k on host k mod 3) when this runs as
    root, else all on 127.0.0.1 and the partition is skipped, saying why.

    * ``baseline``: no faults.
    * ``kill``: once peer 0 passes a third of the steps, kill -9 of two peers.
    * ``restart``: the same two killed, then restarted ``--down`` seconds later
      with ``gossipdl peer --resume`` (from their last checkpoint).
    * ``loss``: 5% of model messages dropped (gaps are detected and resynced).
    * ``partition``: once peer 0 passes a tenth of the steps, host 2's link is cut
      for ``--cut`` seconds (20), then restored. It comes earlier than the kill:
      the cut-off peers train on alone, faster than the rest, and must still be
      running when the link comes back for there to be a rejoin to time.

    Per scenario: peers that finished all their steps, their mean final test
    accuracy, its gap to the baseline in points, and the time to recover — from
    the kill until every survivor counts the smaller swarm (the dead were declared
    dead and dropped), from the restart until every peer counts all 8 members
    again, or from the link coming back until every cut-off peer has rejoined —
    read from the peers' metrics lines.

Run
    python benchmarks/faults.py --json runs/bench-faults.json
    python benchmarks/faults.py --only baseline,kill --steps 600
    python benchmarks/faults.py --quick     # 4 peers, logistic, 2 s down, 5 s cut: a smoke test

    The defaults take about 8 minutes on 2 cores.

JSON (``--json FILE``): ``{"benchmark": "faults", "rows": [...], "meta": {...}}``; each row
has ``scenario``, ``peers_finished``, ``accuracy``, ``gap``, ``recovery_s``, ``wall_time_s``,
``bytes``, ``declared_dead``, ``rejoins``, ``run_dir`` (``accuracy`` and ``gap`` None for a
skipped scenario, with ``skipped`` saying why).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from _common import (
    Column,
    add_only_option,
    add_swarm_options,
    benchmark_parser,
    fill_defaults,
    fresh_run_dir,
    report,
    run_script,
    usage_errors,
)
from rich.console import Console

from gossipdl.config import Config, load_config, to_toml
from gossipdl.experiments.display import LiveProgress
from gossipdl.experiments.launcher import Placement, Swarm, preflight
from gossipdl.experiments.namespaces import Hosts, why_not
from gossipdl.experiments.summary import summarize
from gossipdl.rundir import RunDir

SCENARIOS = ("baseline", "kill", "restart", "loss", "partition")
DEFAULT_STEPS, QUICK_STEPS = 3000, 600
HOSTS = 3


def config_for(key: str, args: argparse.Namespace, host: str) -> Config:
    """The shared job, with 5% loss for the loss scenario."""
    quick = {"dataset": "synthetic", "model": "logistic"} if args.quick else {}
    return load_config(
        args.config,
        peers=args.peers,
        steps=args.steps,
        seed=args.seed,
        codec="topk:0.01",
        topology="ring",
        lr_schedule="cosine",
        eval_every=0,
        log_every=10,
        checkpoint_every=100,
        heartbeat=0.5,
        dead_after=3.0,
        round_timeout=10.0,
        loss=0.05 if key == "loss" else 0.0,
        host=host,
        out=str(args.out / key),
        **quick,
    )


def victims(peers: int) -> list[int]:
    """The two peers killed: far apart on the ring, neither the founder."""
    return [peers // 2 - 1, peers - 2]


def members_back(run: RunDir, ids: list[int], count: int, since: float) -> float | None:
    """Seconds from ``since`` (unix time) until every peer in ``ids`` logged ``count``
    members; None if one never did."""
    latest = 0.0
    for i in ids:
        hit = next(
            (
                r["unix_time"]
                for r in run.records(i)
                if r.get("unix_time", 0) >= since and r.get("members") == count
            ),
            None,
        )
        if hit is None:
            return None
        latest = max(latest, hit)
    return round(latest - since, 2)


def rejoined(run: RunDir, ids: list[int], since: float) -> float | None:
    """Seconds from ``since`` until every peer in ``ids`` had rejoined the swarm (peers that
    ran ahead while cut off may finish, and leave, before the last one is back)."""
    times = [
        next((r["unix_time"] for r in run.records(i) if r.get("unix_time", 0) >= since
              and r.get("rejoins", 0) >= 1), None)
        for i in ids
    ]  # fmt: skip
    return None if None in times else round(max(t for t in times if t is not None) - since, 2)


@contextlib.contextmanager
def placement(
    use_hosts: bool,
) -> Iterator[tuple[Hosts | None, Callable[[int], Placement] | None]]:
    """Three namespace hosts (peer k on host k mod 3), or None and no placement."""
    if not use_hosts:
        yield None, None
        return
    with Hosts(HOSTS) as hosts:

        def place(k: int) -> Placement:
            return Placement(prefix=tuple(hosts.prefix(k % HOSTS)), host=hosts.ip(k % HOSTS))

        yield hosts, place


def run_scenario(key: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Run one scenario to the end and read its row."""
    use_hosts = why_not() is None and not args.loopback
    with placement(use_hosts) as (hosts, place):
        config = config_for(key, args, hosts.ip(0) if hosts else "127.0.0.1")
        run = RunDir(config.out)
        fresh_run_dir(run.root)
        run.create()
        preflight(config)
        run.config.write_text(to_toml(config))
        swarm = Swarm(config, run, place=place)
        fault_at = args.steps // (10 if key == "partition" else 3)
        fault_time = recover_time = None
        killed = victims(config.peers)
        started = time.monotonic()
        with LiveProgress(run, config.steps, console=console) as display:
            try:
                swarm.start()
                while swarm.running():
                    time.sleep(0.2)
                    display.refresh()
                    step = int(_last(run, 0).get("step", 0))
                    if fault_time is None and step >= fault_at and key != "loss":
                        fault_time = time.time()
                        if key in ("kill", "restart"):
                            for k in killed:
                                swarm.kill(k)
                        elif key == "partition":
                            assert hosts is not None
                            hosts.cut(2)
                    down = 0.0 if fault_time is None else time.time() - fault_time
                    if recover_time is None and key == "restart" and down >= args.down:
                        recover_time = time.time()
                        for k in killed:
                            swarm.restart(k)
                    if recover_time is None and key == "partition" and down >= args.cut:
                        assert hosts is not None
                        recover_time = time.time()
                        hosts.restore(2)
            finally:
                if swarm.running():  # interrupted: stop the peers, keep what they measured
                    swarm.stop()
                swarm.close()
        summary = summarize(run, time.monotonic() - started)
    survivors = [i for i in range(config.peers) if key != "kill" or i not in killed]
    recovery = None
    if key == "kill" and fault_time is not None:
        recovery = members_back(run, survivors, len(survivors), fault_time)
    elif key == "restart" and recover_time is not None:
        recovery = members_back(run, survivors, config.peers, recover_time)
    elif key == "partition" and recover_time is not None:
        cut_off = [i for i in range(config.peers) if i % HOSTS == 2]
        recovery = rejoined(run, cut_off, recover_time)
    ids = [p["id"] for p in summary["peers"]]
    return {
        "scenario": key,
        "peers_finished": summary["peers_finished"],
        "accuracy": summary["mean_accuracy_finished"],
        "recovery_s": recovery,
        "wall_time_s": summary["wall_time_s"],
        "bytes": summary["total_bytes_sent"],
        "declared_dead": sum(_last(run, i).get("declared_dead", 0) for i in ids),
        "rejoins": sum(_last(run, i).get("rejoins", 0) for i in ids),
        "hosts": HOSTS if use_hosts else 1,
        "run_dir": config.out,
    }


def _last(run: RunDir, peer_id: int) -> dict[str, Any]:
    """A peer's latest metrics line ({} before it wrote one)."""
    with contextlib.suppress(OSError):
        last = deque(run.records(peer_id), maxlen=1)
        return last[0] if last else {}
    return {}


def main() -> None:
    parser = benchmark_parser(__doc__, quick="4 peers, logistic, 600 steps")
    add_swarm_options(parser, "faults", steps=f"default {DEFAULT_STEPS}")
    parser.add_argument(
        "--down", type=float, default=None, help="restart: seconds dead, >= 0 (10; --quick 2)"
    )
    parser.add_argument(
        "--cut", type=float, default=None, help="partition: seconds cut, > 0 (20; --quick 5)"
    )
    parser.add_argument("--loopback", action="store_true", help="no namespaces, even as root")
    add_only_option(parser, list(SCENARIOS))
    args = parser.parse_args()
    fill_defaults(
        args, steps=(QUICK_STEPS, DEFAULT_STEPS), peers=(4, 8), down=(2.0, 10.0), cut=(5.0, 20.0)
    )
    if args.down < 0:
        parser.error(f"--down {args.down:g}: the seconds the killed peers stay down, >= 0")
    if args.cut <= 0:
        parser.error(f"--cut {args.cut:g}: the seconds host 2's link is cut, > 0")
    if args.peers < 4 and {"kill", "restart"} & set(args.only):
        parser.error(f"--peers {args.peers}: kill and restart need 4 (two die, not the founder)")
    with usage_errors(parser, args):  # every scenario's config before the first run
        for key in args.only:
            config_for(key, args, "127.0.0.1")

    console = Console(stderr=True)
    rows = []
    for key in args.only:
        if key == "partition" and (why_not() is not None or args.loopback):
            reason = "--loopback" if args.loopback else why_not()
            console.print(f"skipping partition: {reason}")
            rows.append({"scenario": key, "accuracy": None, "gap": None, "skipped": reason})
            continue
        console.print(f"running {key} …")
        rows.append(run_scenario(key, args, console))
    base = next((r["accuracy"] for r in rows if r["scenario"] == "baseline"), None)
    for row in rows:
        acc = row.get("accuracy")
        row["gap"] = None if base is None or acc is None else round(100 * (base - acc), 2)
    columns = [
        Column("scenario", "scenario"),
        Column("peers_finished", "finished"),
        Column("accuracy", "mean acc", "{:.4f}"),
        Column("gap", "gap (points)", "{:+.2f}"),
        Column("recovery_s", "recovery s", "{:.1f}"),
        Column("declared_dead", "declared dead"),
        Column("rejoins", "rejoins"),
        Column("wall_time_s", "wall s", "{:.1f}"),
        Column("bytes", "bytes sent", lambda v: f"{v / 1e6:,.1f} MB"),
    ]
    job = "logistic on synthetic" if args.quick else "cnn1d on MNIST-1D"
    within = all(
        r["gap"] is not None and r["gap"] <= 1.0
        for r in rows
        if r["scenario"] in ("kill", "restart", "loss")
    )
    unmeasured = [
        "partition: the cut-off peers finished before the link came back, so no rejoin was "
        "timed; give more --steps or a shorter --cut"
        for r in rows
        if r["scenario"] == "partition" and "skipped" not in r and r["recovery_s"] is None
    ]
    meta = {
        "steps": args.steps,
        "peers": args.peers,
        "seed": args.seed,
        "down_s": args.down,
        "cut_s": args.cut,
        "quick": args.quick,
        "killed": victims(args.peers),
        "target_within_1_point": within,
    }
    report(
        "faults",
        f"Faults: {args.peers} peers, {job}, CHOCO topk:0.01 on a ring, {args.steps} steps",
        columns,
        rows,
        meta,
        args.json,
        notes=[f"kill / restart / loss within 1 point of the baseline: {within}", *unmeasured],
    )


if __name__ == "__main__":
    run_script(main)
