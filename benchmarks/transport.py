"""Transport throughput: one 40 MB model per message, gossipdl's real path vs raw pyzmq.

What it measures
    One sender process ships a float32 parameter vector (default 10M elements,
    40 MB) to one receiver process over loopback TCP, one message at a time,
    with two implementations side by side in the same run:

    * ``gossipdl``: ``encode("params", ...)`` + ``Transport.send`` on the sender;
      a receiving ``Transport`` whose ``on_message`` gets the decoded Message,
      i.e. after ``decode`` has checked version, sizes, dtypes, shapes and
      finiteness and built the array.
    * ``raw-pyzmq``: the same bytes as one frame over a PUSH/PULL pair
      (``send(copy=False)`` / ``recv(copy=False)`` + ``np.frombuffer``), no checks.

    Timing is per message and end to end: the sender reads the clock, sends,
    and stops the clock when the receiver's acknowledgement arrives. The
    receiver acknowledges from inside its handler, after it holds the decoded
    array (gossipdl: in ``on_message``, so after validation). The
    acknowledgement is an 8-byte message on the same kind of raw PUSH/PULL
    socket for both implementations, so its (~0.1 ms) cost is common to both.
    Only one message is in flight at a time, so nothing is pipelined away and
    nothing is measured that the receiver has not finished with. The two
    implementations alternate message by message (A B A B ...), so machine
    noise hits both; each has its own sender and receiver process (spawn).

    Reported per implementation: median (and p10/p90) ms per message,
    throughput = payload bytes / median time in GB/s (10^9 bytes), and for
    gossipdl the ratio of its throughput to raw pyzmq's. ``decode_ms`` in the
    notes is ``decode`` alone on the same frames, in this process, for scale.

Target
    gossipdl reaches at least 80% of raw pyzmq throughput (ratio >= 0.80).

Run
    python benchmarks/transport.py                       # 10M floats, 5 warm-up + 50 messages each
    python benchmarks/transport.py --quick               # 1M floats, 1 + 5: a smoke test
    python benchmarks/transport.py --json runs/bench-transport.json

JSON (``--json FILE``): ``{"benchmark": "transport", "rows": [...], "meta": {...}}``;
each row has ``impl``, ``numel``, ``payload_bytes``, ``wire_bytes``, ``messages``,
``median_ms``, ``p10_ms``, ``p90_ms``, ``mean_ms``, ``throughput_gbps`` and, on the
gossipdl row, ``ratio``; ``meta`` holds the settings, ``ratio``, ``target``,
``meets_target``, ``decode_ms`` and the environment.
"""

from __future__ import annotations

import struct
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq
from _common import Column, at_least, benchmark_parser, report, run_script, start_worker

from gossipdl.experiments import forking
from gossipdl.transport import Message, Transport, decode, encode

IMPLS = ("gossipdl", "raw-pyzmq")
TARGET_RATIO = 0.80
ACK_TIMEOUT_MS = 30_000
_ACK = struct.Struct("<qq")  # sequence number, elements received


# --- receivers -------------------------------------------------------------------------------


def _ack_socket(ctx: zmq.Context, ack_address: str) -> zmq.Socket:
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.LINGER, 0)
    ack.connect(ack_address)
    return ack


def _gossipdl_receiver(conn: Connection, ack_address: str, numel: int) -> None:
    ctx = zmq.Context()
    ack: zmq.Socket | None = None  # created and used on the transport's receive thread only

    def on_message(message: Message) -> None:
        nonlocal ack
        if ack is None:
            ack = _ack_socket(ctx, ack_address)
        (array,) = message.arrays
        ack.send(_ACK.pack(message.seq, array.size))

    transport = Transport(
        "tcp://127.0.0.1:0", on_message, max_message_bytes=8 * numel + (1 << 20), name="bench-rx"
    )
    conn.send(transport.address)
    conn.recv()  # stop
    transport.close()
    if ack is not None:
        ack.close()
    ctx.term()
    conn.send(transport.stats.snapshot())


def _raw_receiver(conn: Connection, ack_address: str, numel: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack = _ack_socket(ctx, ack_address)
    conn.send(f"tcp://127.0.0.1:{port}")
    seq = 0
    while not conn.poll(0):
        if not pull.poll(100):
            continue
        frame = pull.recv(copy=False)
        array = np.frombuffer(frame.buffer, dtype=np.float32)
        ack.send(_ACK.pack(seq, array.size))
        seq += 1
    conn.recv()
    pull.close()
    ack.close()
    ctx.term()
    conn.send({"messages_received": seq})


# --- sender --------------------------------------------------------------------------------------


def _sender(conn: Connection, impl: str, numel: int) -> None:
    """Send one message per requested count and time each until its acknowledgement."""
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PULL)
    ack.setsockopt(zmq.LINGER, 0)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{ack_port}")
    data_address = conn.recv()
    vector = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)

    transport: Transport | None = None
    push: zmq.Socket | None = None
    if impl == "gossipdl":
        transport = Transport("tcp://127.0.0.1:0", lambda _m: None, name="bench-tx")
    else:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(data_address)

    def send(seq: int) -> None:
        if transport is not None:
            transport.send(data_address, encode("params", 0, seq, seq, [vector]))
        else:
            assert push is not None
            push.send(vector, copy=False)

    seq = 0
    while (count := conn.recv()) is not None:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            send(seq)
            if not ack.poll(ACK_TIMEOUT_MS):
                raise RuntimeError(f"{impl}: no acknowledgement for message {seq} in 30 s")
            got_seq, got_numel = _ACK.unpack(ack.recv())
            times.append(time.perf_counter() - start)
            if (got_seq, got_numel) != (seq, numel):
                raise RuntimeError(f"{impl}: ack {got_seq, got_numel}, expected {seq, numel}")
            seq += 1
        conn.send(times)
    stats = transport.stats.snapshot() if transport is not None else {"messages_sent": seq}
    if transport is not None:
        transport.close()
    if push is not None:
        push.close()
    ack.close()
    ctx.term()
    conn.send(stats)


# --- orchestration -------------------------------------------------------------------------------


class Pair:
    """One implementation's sender and receiver processes."""

    def __init__(self, ctx: Any, impl: str, numel: int) -> None:
        self.impl = impl
        self.tx, tx_child = ctx.Pipe()
        self.rx, rx_child = ctx.Pipe()
        receiver = _gossipdl_receiver if impl == "gossipdl" else _raw_receiver
        self.sender_proc = ctx.Process(target=_sender, args=(tx_child, impl, numel), daemon=True)
        start_worker(self.sender_proc)
        ack_address = self.tx.recv()
        self.receiver_proc = ctx.Process(
            target=receiver, args=(rx_child, ack_address, numel), daemon=True
        )
        start_worker(self.receiver_proc)
        self.tx.send(self.rx.recv())

    def run(self, count: int) -> list[float]:
        """Send ``count`` messages; seconds per message."""
        self.tx.send(count)
        return self.tx.recv()

    def kill(self) -> None:
        """Stop both processes without asking (after a failure)."""
        for proc in (self.sender_proc, self.receiver_proc):
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    def close(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stop both processes; their final counters (sender, receiver)."""
        self.tx.send(None)
        sent = self.tx.recv()
        self.rx.send(None)
        received = self.rx.recv()
        self.sender_proc.join(10)
        self.receiver_proc.join(10)
        return sent, received


def interleaved(pairs: list[Pair], rounds: int) -> dict[str, list[float]]:
    """One message per implementation per round: A B A B ..., so every message follows one
    of the other implementation (a message right after one of its own runs measurably
    slower on a 2-core machine, so ABBA order would make the samples bimodal)."""
    times: dict[str, list[float]] = {p.impl: [] for p in pairs}
    for _ in range(rounds):
        for pair in pairs:
            times[pair.impl] += pair.run(1)
    return times


def decode_ms(numel: int, repeats: int = 5) -> float:
    """Median time of ``decode`` alone (header checks, frame join, finiteness) in this process."""
    vector = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)
    frames = encode("params", 0, 0, 0, [vector])
    limit = 8 * numel + (1 << 20)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode(frames, limit)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) * 1e3


def main() -> None:
    parser = benchmark_parser(__doc__, quick="1M elements, 1 + 5 messages")
    parser.add_argument(
        "--numel", type=at_least(1), default=10_000_000, help="float32 elements/message"
    )
    parser.add_argument("--messages", type=at_least(1), default=50, help="timed messages per impl")
    parser.add_argument(
        "--warmup", type=at_least(0), default=5, help="untimed messages per impl first"
    )
    args = parser.parse_args()
    if args.quick:
        args.numel, args.messages, args.warmup = 1_000_000, 5, 1

    ctx = forking.context()  # preloaded: a worker starts without importing torch
    pairs = [Pair(ctx, impl, args.numel) for impl in IMPLS]
    try:
        interleaved(pairs, args.warmup)
        times = interleaved(pairs, args.messages)
    except BaseException:
        for pair in pairs:
            pair.kill()
        raise
    counters = {pair.impl: pair.close() for pair in pairs}

    payload = 4 * args.numel
    rows = []
    for impl in IMPLS:
        seconds = np.asarray(times[impl])
        sent, received = counters[impl]
        wire = sent.get("bytes_sent", 0) / sent["messages_sent"] if "bytes_sent" in sent else None
        rows.append(
            {
                "impl": impl,
                "numel": args.numel,
                "payload_bytes": payload,
                "wire_bytes": wire if wire is not None else payload,
                "messages": len(seconds),
                "median_ms": float(np.median(seconds)) * 1e3,
                "p10_ms": float(np.percentile(seconds, 10)) * 1e3,
                "p90_ms": float(np.percentile(seconds, 90)) * 1e3,
                "mean_ms": float(seconds.mean()) * 1e3,
                "throughput_gbps": payload / float(np.median(seconds)) / 1e9,
                "dropped": sum(received.get("messages_dropped", {}).values()),
            }
        )
    ratio = rows[0]["throughput_gbps"] / rows[1]["throughput_gbps"]
    rows[0]["ratio"] = ratio
    decode_cost = decode_ms(args.numel)
    meta = {
        "method": "per-message round trip: send start -> receiver's ack after decode; "
        "one in flight; impls alternate A B A B",
        "numel": args.numel,
        "messages": args.messages,
        "warmup": args.warmup,
        "ratio": ratio,
        "target": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "decode_ms": decode_cost,
    }
    columns = [
        Column("impl", "impl"),
        Column("numel", "elements", "{:,}"),
        Column("wire_bytes", "wire MB", lambda v: f"{v / 1e6:.3f}"),
        Column("messages", "messages"),
        Column("median_ms", "median ms", "{:.2f}"),
        Column("p10_ms", "p10 ms", "{:.2f}"),
        Column("p90_ms", "p90 ms", "{:.2f}"),
        Column("throughput_gbps", "GB/s", "{:.3f}"),
        Column("dropped", "dropped"),
        Column("ratio", "ours/raw", "{:.1%}"),
    ]
    verdict = "[green]meets[/]" if meta["meets_target"] else "[red]misses[/]"
    report(
        "transport",
        f"Transport: {payload / 1e6:.0f} MB per message over loopback TCP",
        columns,
        rows,
        meta,
        args.json,
        notes=[
            f"gossipdl / raw throughput = {ratio:.1%} — {verdict} the target of "
            f">= {TARGET_RATIO:.0%}",
            f"decode() alone on these frames, in-process: {decode_cost:.2f} ms per message",
        ],
    )


if __name__ == "__main__":
    run_script(main)
