"""All-reduce: gossipdl's all-reduce vs torch.distributed gloo, on one machine.

What it measures
    For every number of local processes (default 2 and 4) and every vector
    size (default 1M, 10M and 25M float32 elements), one fresh set of
    processes (spawn, ``torch.set_num_threads(1)`` in each) holds a seeded
    standard-normal vector per rank and averages it with both implementations,
    back to back in the same processes:

    * ``gossipdl``: ``RingGroup(rank, addresses, numel, codec="none")`` and
      ``allreduce_mean_(t)``, in place on ``t``, a clone of the input made
      before the timed region. The ranks are on one host, so the group averages
      through shared memory (each rank copies its piece in, reduces its share
      of all ranks' pieces and copies the mean out; ``gossipdl.coordinator.
      shared_reduce``), as it does by default;
    * ``gossipdl-tcp``: the same with ``shared=False``: the ring over gossipdl's
      ZeroMQ transport (reduce-scatter + all-gather, sums in numpy, every
      received piece validated), as ranks on different machines run it;
    * ``gloo``: ``dist.all_reduce(t)`` on a process group initialised with
      ``init_process_group("gloo", init_method="tcp://127.0.0.1:PORT")``,
      followed by ``t /= world_size``. gloo's all-reduce is a SUM, so the
      division is timed with it to compare the same result, a mean; ``t`` is
      likewise a clone made before the timed region.

    Each config gets fresh addresses and a fresh gloo port chosen by the parent.
    A repetition is one call of each implementation (gossipdl, gossipdl-tcp,
    then gloo), so they alternate and machine noise hits all. Before every timed call all
    ranks meet at the same ``multiprocessing.Barrier`` (for both
    implementations); every rank times its own call, a repetition's time is
    the slowest rank's, and the reported time is the median over the timed
    repetitions (default 7, after 2 untimed warm-up repetitions that also open
    the connections). The first warm-up's results are compared once per config:
    ``correct`` means every rank's gossipdl mean equals its gloo mean within
    1e-5 relative (max |ours − gloo| <= 1e-5 · max |gloo|), for both of ours.

Target
    gossipdl's all-reduce takes at most 1.0x gloo's time for 25M floats on 4
    processes (the TCP ring's ratio is printed beside it).

Run
    python benchmarks/allreduce.py                   # 2 and 4 processes x 1M, 10M, 25M floats
    python benchmarks/allreduce.py --procs 4 --sizes 25M --repeats 9
    python benchmarks/allreduce.py --quick           # 2 processes, 100k floats, 1 + 3: a smoke test
    python benchmarks/allreduce.py --json runs/bench-allreduce.json
    python benchmarks/allreduce.py --device cuda     # GPU tensors: rank r on cuda:(r mod GPUs);
                                                     # ours reduces them on the GPU (CUDA IPC)

    Every config spawns its own processes (each imports torch); the defaults
    take about a minute on a 2-core machine. With fewer cores than processes all
    implementations share the oversubscribed cores alike, so there the times
    track CPU use (including page faults on freshly allocated buffers) as much
    as bandwidth.

JSON (``--json FILE``): ``{"benchmark": "allreduce", "rows": [...], "meta": {...}}``;
one row per implementation per config, with ``impl`` (``gossipdl``, ``gossipdl-tcp`` or
``gloo``), ``procs``, ``numel``, ``median_ms``, ``times_ms`` (per timed repetition, the
slowest rank), ``correct`` and ``max_rel_error`` (the same on every row of a config:
the worse of ours), and on our rows ``ratio`` (ours / gloo median); ``meta``
holds the settings, ``target``, whether it was ``met`` (null when the run did
not include 4 processes x 25M) and the environment.
"""

from __future__ import annotations

import argparse
import datetime
import queue
import re
import socket
import statistics
import time
from typing import Any

import torch
from _common import (
    Column,
    at_least,
    benchmark_parser,
    check_device,
    mark,
    peer_counts,
    report,
    run_script,
    start_worker,
)

from gossipdl.experiments import forking

IMPLS = ("gossipdl", "gossipdl-tcp", "gloo")
OURS = IMPLS[:2]
TARGET_PROCS, TARGET_NUMEL, TARGET_RATIO = 4, 25_000_000, 1.0
RTOL = 1e-5
WORKER_TIMEOUT_S = 300.0
_SUFFIXES = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_size(text: str) -> int:
    """``"25M"`` -> 25_000_000; accepts k/M/G suffixes (decimal), ``_`` and ``1e6``."""
    match = re.fullmatch(r"\s*([0-9][0-9_.eE+]*?)\s*([kKmMgG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 100k, 1M, 2.5M)")
    try:
        value = float(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"size must be a positive whole number: {text!r}")
    return int(value)


def _size_list(text: str) -> list[int]:
    return [parse_size(v) for v in text.split(",") if v.strip()]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# --- one rank ------------------------------------------------------------------------------------


def _worker(
    rank: int,
    procs: int,
    numel: int,
    addresses: list[str],
    tcp_addresses: list[str],
    gloo_port: int,
    warmup: int,
    repeats: int,
    barrier: Any,
    results: Any,
    device_kind: str = "cpu",
) -> None:
    """One rank of one config: time every implementation, alternating, and report. On a
    GPU each call's time runs until the device is done with it (ours through shared memory
    reduces on the GPU, the TCP ring on the host through pinned memory, gloo's CUDA path its
    own way)."""
    import torch.distributed as dist

    from gossipdl.coordinator import RingGroup
    from gossipdl.peers.device import pick_device

    torch.set_num_threads(1)
    device = pick_device(device_kind, local_index=rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 7)).to(device)

    def done() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    ok, err = True, 0.0
    rings = {
        "gossipdl": RingGroup(rank, addresses, numel, codec="none"),
        "gossipdl-tcp": RingGroup(rank, tcp_addresses, numel, codec="none", shared=False),
    }
    try:
        barrier.wait(WORKER_TIMEOUT_S)  # every ring address is bound before gloo picks ports
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{gloo_port}",
            rank=rank,
            world_size=procs,
            timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S),
        )
        for rep in range(warmup + repeats):
            means, took = {}, {}
            for impl, ring in rings.items():
                means[impl] = x.clone()
                barrier.wait(WORKER_TIMEOUT_S)
                start = time.perf_counter()
                ring.allreduce_mean_(means[impl])
                took[impl] = done() - start

            t = x.clone()
            barrier.wait(WORKER_TIMEOUT_S)
            start = time.perf_counter()
            dist.all_reduce(t)
            t /= procs
            took["gloo"] = done() - start

            if rep == 0:
                scale = float(t.abs().max()) or 1.0
                err = max(float((means[impl] - t).abs().max()) / scale for impl in OURS)
                ok = bool(err <= RTOL)
            if rep >= warmup:
                for impl in IMPLS:
                    times[impl].append(took[impl])
            del means, t
        dist.destroy_process_group()
    finally:
        for ring in rings.values():
            ring.close()
    results.put((rank, times, ok, err))


# --- orchestration -------------------------------------------------------------------------------


def run_config(
    ctx: Any, procs: int, numel: int, warmup: int, repeats: int, device: str = "cpu"
) -> dict[str, Any]:
    """Spawn ``procs`` ranks for one config; per implementation the slowest rank per repetition."""
    ports = _free_ports(2 * procs + 1)
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports[:procs]]
    tcp_addresses = [f"tcp://127.0.0.1:{p}" for p in ports[procs : 2 * procs]]
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                procs,
                numel,
                addresses,
                tcp_addresses,
                ports[-1],
                warmup,
                repeats,
                barrier,
                results,
                device,
            ),
            daemon=True,
        )
        for r in range(procs)
    ]
    by_rank: dict[int, tuple[dict[str, list[float]], bool, float]] = {}
    deadline = time.monotonic() + WORKER_TIMEOUT_S + 60
    try:
        for w in workers:
            start_worker(w)
        while len(by_rank) < procs:
            try:
                rank, times, ok, err = results.get(timeout=1.0)
                by_rank[rank] = (times, ok, err)
                continue
            except queue.Empty:
                pass
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{procs} procs x {numel:,}: a rank exited with {failed[0]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{procs} procs x {numel:,}: no result in time")
        for w in workers:
            w.join(30)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join(5)
    slowest = {
        impl: [max(by_rank[r][0][impl][i] * 1e3 for r in by_rank) for i in range(repeats)]
        for impl in IMPLS
    }
    return {
        "times_ms": slowest,
        "correct": all(ok for _, ok, _ in by_rank.values()),
        "max_rel_error": max(err for *_, err in by_rank.values()),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, quick="2 processes, 100k floats, 1 + 3")
    parser.add_argument(
        "--procs", type=peer_counts, default=[2, 4], help="comma-separated process counts (2,4)"
    )
    parser.add_argument(
        "--sizes",
        type=_size_list,
        default=[1_000_000, 10_000_000, 25_000_000],
        help="comma-separated float32 element counts; k/M/G suffixes (1M,10M,25M)",
    )
    parser.add_argument("--repeats", type=at_least(1), default=7, help="timed repetitions (median)")
    parser.add_argument(
        "--warmup", type=at_least(1), default=2, help="untimed repetitions first (>= 1: checked)"
    )
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where each rank's vector lives"
    )
    args = parser.parse_args()
    check_device(parser, args.device)
    if args.quick:
        args.procs, args.sizes, args.repeats, args.warmup = [2], [100_000], 3, 1

    ctx = forking.context()  # preloaded: a worker starts without importing torch
    table, rows = [], []
    for procs in args.procs:
        for numel in args.sizes:
            got = run_config(ctx, procs, numel, args.warmup, args.repeats, args.device)
            medians = {impl: statistics.median(got["times_ms"][impl]) for impl in IMPLS}
            ratios = {impl: medians[impl] / medians["gloo"] for impl in OURS}
            for impl in IMPLS:
                rows.append(
                    {
                        "impl": impl,
                        "procs": procs,
                        "numel": numel,
                        "median_ms": medians[impl],
                        "times_ms": got["times_ms"][impl],
                        "correct": got["correct"],
                        "max_rel_error": got["max_rel_error"],
                        **({"ratio": ratios[impl]} if impl in ratios else {}),
                    }
                )
            table.append(
                {
                    "procs": procs,
                    "numel": numel,
                    "gloo_ms": medians["gloo"],
                    "gossipdl_ms": medians["gossipdl"],
                    "ratio": ratios["gossipdl"],
                    "tcp_ms": medians["gossipdl-tcp"],
                    "tcp_ratio": ratios["gossipdl-tcp"],
                    "correct": got["correct"],
                }
            )

    at_target = next(
        (r for r in table if (r["procs"], r["numel"]) == (TARGET_PROCS, TARGET_NUMEL)), None
    )
    target = (
        f"gossipdl <= {TARGET_RATIO:g}x gloo's median time at {TARGET_NUMEL / 1e6:g}M floats "
        f"on {TARGET_PROCS} processes"
    )
    met = None if at_target is None else at_target["ratio"] <= TARGET_RATIO
    meta = {
        "procs": args.procs,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads_per_process": 1,
        "device": args.device,
        "method": "per repetition: mp.Barrier, then each rank times its call; the slowest "
        "rank's time; median over repetitions; gossipdl (shared memory on one host), "
        "gossipdl-tcp (the TCP ring) and gloo alternate in the same processes; gloo = "
        "all_reduce (SUM) + divide by world size",
        "rtol": RTOL,
        "target": target,
        "target_ratio": at_target["ratio"] if at_target else None,
        "met": met,
    }
    if met is None:
        verdict = f"not measured (needs --procs with {TARGET_PROCS} and --sizes with 25M)"
    else:
        verdict = f"ratio {at_target['ratio']:.2f}x — {mark(met)}"
    wrong = [f"{r['procs']}x{r['numel']:,}" for r in table if not r["correct"]]
    notes = [
        f"target ({target}): {verdict}",
        f"median of {args.repeats} repetitions after {args.warmup} warm-up, slowest rank each; "
        "gloo timed as all_reduce (sum) + t /= world_size",
        "[red]results differ from gloo's mean[/] for " + ", ".join(wrong)
        if wrong
        else f"every config: both of gossipdl's means equal gloo's within {RTOL:g} relative",
    ]
    columns = [
        Column("procs", "procs"),
        Column("numel", "numel", "{:,}"),
        Column("gloo_ms", "gloo median ms", "{:.1f}"),
        Column("gossipdl_ms", "gossipdl median ms", "{:.1f}"),
        Column("ratio", "ratio", "{:.2f}x"),
        Column("tcp_ms", "TCP ring median ms", "{:.1f}"),
        Column("tcp_ratio", "TCP ratio", "{:.2f}x"),
    ]
    # The table has one line per config, the JSON one row per implementation per config.
    report(
        "allreduce",
        f"All-reduce (mean) of float32 {args.device} vectors on one host: gossipdl "
        "(shared memory; and its TCP ring) vs torch.distributed gloo",
        columns,
        table,
        meta,
        args.json,
        notes=notes,
        json_rows=rows,
    )


if __name__ == "__main__":
    run_script(main)
