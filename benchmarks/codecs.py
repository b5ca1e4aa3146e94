"""Codecs on one large tensor: payload bytes, encode/decode time and error, per codec.

What it measures
    One seeded standard-normal float32 vector (default 10M elements, 40 MB)
    goes through every codec in ``CODECS``. Per codec: payload bytes
    (``Payload.nbytes``: every array byte plus the packed meta), the ratio to
    plain float32 (``4n / bytes``), the median ``encode`` and ``decode`` times
    over the timed runs (``encode`` includes the sender's estimate, which
    CHOCO-SGD and error feedback need), their sum (round trip), and the
    relative L2 error ``‖x − decode(encode(x))‖ / ‖x‖`` of the first message
    (for ``+ef`` rows: before any residual has built up). Two reference rows
    time one plain ``torch.topk(x.abs(), k)`` at 1% and one ``x.half()`` cast
    on the same tensor. Runs are interleaved (every codec once per round,
    rounds repeated), so machine noise hits all rows alike; each codec is
    warmed up by one untimed round first.

    The floor: the least memory traffic a round trip needs, at the copy bandwidth
    measured in the same rounds (``y.copy_(x)``: 8n bytes read and written). Encode reads
    ``x`` (4n bytes) and writes the sender's estimate (4n) and the payload (P); decode
    reads the payload and writes the tensor (4n): ``12n + 2P`` bytes; error feedback
    adds its residual, read and written (8n). ``floor_ms`` is those bytes over the
    bandwidth, ``x_floor`` the round trip's multiple of it. On a GPU the payload also
    crosses the bus twice (to the host to be sent, back to the device when received):
    ``2P`` more bytes at the bus bandwidth measured in the same rounds (a pinned host
    buffer of ``x`` copied from the device and back: 8n bytes).

Targets
    * ``topk:0.01+ef`` (top-1%, indices coded with the default delta-golomb,
      error feedback) round-trips (encode + decode) faster than the one
      ``torch.topk`` call;
    * every codec without data-dependent entropy coding (of indices: delta-golomb,
      delta-varint, delta-zlib; of values: ``qsgd:LEVELS:trits``) round-trips within 2x
      its floor, with the kernels this machine runs (the extra "(numpy kernels)" rows
      show what a build without a C compiler would run, and are not held to it).

Run
    python benchmarks/codecs.py                      # 10M floats, 1 warm-up + 7 timed rounds
    python benchmarks/codecs.py --quick              # 200k floats, 1 + 3 rounds: a smoke test
    python benchmarks/codecs.py --json runs/bench-codecs.json
    python benchmarks/codecs.py --device cuda        # on a GPU: codecs run where the tensor is

JSON (``--json FILE``): ``{"benchmark": "codecs", "rows": [...], "meta": {...}}``;
each row has ``codec``, ``bytes``, ``ratio``, ``encode_ms``, ``decode_ms``,
``roundtrip_ms``, ``floor_ms``, ``x_floor``, ``rel_error`` (reference rows: ``encode_ms``
is the timed call, the rest null); ``meta`` holds the settings, each target's numbers and
whether it is met, and the environment.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from _common import Column, at_least, benchmark_parser, check_device, mark, report, run_script

from gossipdl.compression import build_codec
from gossipdl.compression._kernels import native_kernels, numpy_kernels


def native_isa() -> str | None:
    """The instruction set of the C kernels that run on CPU, or None when they are not built."""
    native = native_kernels(torch.device("cpu"))
    return None if native is None else native.use_isa()


CODECS = (
    "none",
    "fp16",
    "bf16",
    "sign",
    "sign+ef",
    "sign:4096",
    "ternary",
    "uniform:4",
    "uniform:8:1024",
    "qsgd:16",
    "topk:0.01",
    "topk:0.01+ef",
    "topk:0.01+fp16",
    "topk:0.01+qsgd:16+delta-golomb",
    "topk:0.01+qsgd:16:trits",
    "topk:0.01+raw",
    "topk:0.01+delta-varint",
    "topk:0.01+delta-zlib",
    "threshold:auto",
    "threshold:auto+sign",
    "randomk:0.01",
    "powersgd:2",
    "powersgd:2+ef",
)
# Also timed with the numpy kernels (what runs when the C kernels could not be built).
NUMPY_ROWS = ("sign",)
NUMPY_SUFFIX = " (numpy kernels)"
TOPK_REFERENCE = "torch.topk 1% (reference)"
FP16_REFERENCE = "fp16 cast (reference)"
COPY_REFERENCE = "copy (bandwidth reference)"
BUS_REFERENCE = "device to host and back (bus reference)"
TOPK_TARGET = "topk:0.01+delta-golomb+ef"
FLOOR_FACTOR = 2.0
ENTROPY_CODERS = ("delta-golomb", "delta-varint", "delta-zlib")


def floor_bytes(numel: int, payload: int, error_feedback: bool) -> int:
    """The bytes a round trip must read and write: ``x`` in, the estimate and the payload
    out (encode), the payload in and the tensor out (decode); a residual in and out."""
    return 12 * numel + 2 * payload + (8 * numel if error_feedback else 0)


def entropy_coded(spec: str) -> bool:
    """Whether ``spec``'s indices are entropy coded, or its values' size depends on them
    (``qsgd:LEVELS:trits``): their cost depends on the data."""
    codec = build_codec(spec.removesuffix(NUMPY_SUFFIX))
    codec = getattr(codec, "codec", codec)  # under +ef too
    indices = getattr(codec, "indices", None)
    values = getattr(codec, "values", codec)
    coded = indices is not None and indices.name in ENTROPY_CODERS
    return coded or not getattr(values, "fixed_layout", True)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Milliseconds ``fn`` takes: on a GPU between two ``torch.cuda.Event`` s (its queued
    kernels included, and whatever the host spends between them), on a CPU by the clock."""
    if device.type == "cuda":
        start_event, end_event = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        torch.cuda.synchronize(device)
        start_event.record()
        out = fn()
        end_event.record()
        end_event.synchronize()
        return start_event.elapsed_time(end_event), out
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def main() -> None:
    parser = benchmark_parser(__doc__, quick="200k elements, 3 rounds")
    parser.add_argument("--numel", type=at_least(1), default=10_000_000, help="float32 elements")
    parser.add_argument(
        "--rounds", type=at_least(1), default=7, help="timed rounds (median of these)"
    )
    parser.add_argument(
        "--threads", type=at_least(0), default=0, help="torch threads (0: torch default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the tensor lives: cpu, cuda")
    args = parser.parse_args()
    check_device(parser, args.device)
    if args.quick:
        args.numel, args.rounds = 200_000, 3
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed)).to(device)
    k = max(1, args.numel // 100)
    numpy_rows = NUMPY_ROWS if device.type == "cpu" else ()  # host kernels: a CPU's rows
    labels = [*CODECS, *(spec + NUMPY_SUFFIX for spec in numpy_rows)]
    codecs = {
        label: build_codec(label.removesuffix(NUMPY_SUFFIX), seed=args.seed) for label in labels
    }

    def kernels(label: str) -> AbstractContextManager[None]:
        return numpy_kernels() if label.endswith(NUMPY_SUFFIX) else nullcontext()

    rows: dict[str, dict[str, Any]] = {}
    for spec, codec in codecs.items():
        with kernels(spec):
            payload, sent = codec.encode(x)
            decoded = codec.decode(payload, x.numel(), x.device)
        assert torch.equal(decoded, sent), f"{spec}: decode differs from the sender's estimate"
        rows[spec] = {
            "codec": codec.spec + (NUMPY_SUFFIX if spec.endswith(NUMPY_SUFFIX) else ""),
            "bytes": payload.nbytes,
            "ratio": 4 * x.numel() / payload.nbytes,
            "rel_error": float((x - decoded).norm() / x.norm()),
        }
    bus = device.type == "cuda"
    reference_names = [TOPK_REFERENCE, FP16_REFERENCE, COPY_REFERENCE]
    reference_names += [BUS_REFERENCE] if bus else []
    times: dict[str, dict[str, list[float]]] = {
        name: {"encode": [], "decode": []} for name in [*labels, *reference_names]
    }
    y = torch.empty_like(x)
    pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=bus)
    references_fns: list[tuple[str, Callable[[], Any]]] = [
        (TOPK_REFERENCE, lambda: torch.topk(x.abs(), k)),
        (FP16_REFERENCE, lambda: x.half()),
        (COPY_REFERENCE, lambda: y.copy_(x)),
    ]
    if bus:
        references_fns.append(
            (BUS_REFERENCE, lambda: y.copy_(pinned.copy_(x, non_blocking=True), non_blocking=True))
        )
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for spec, codec in codecs.items():
            with kernels(spec):
                encode_ms, (payload, _) = _timed(partial(codec.encode, x), device)
                decode_ms, _ = _timed(partial(codec.decode, payload, x.numel(), device), device)
            if round_:
                times[spec]["encode"].append(encode_ms)
                times[spec]["decode"].append(decode_ms)
        for name, fn in references_fns:
            elapsed, _ = _timed(fn, device)
            if round_:
                times[name]["encode"].append(elapsed)

    references = {name: statistics.median(times[name]["encode"]) for name in reference_names}
    bytes_per_ms = 8 * x.numel() / references[COPY_REFERENCE]  # the copy reads and writes
    # The payload's two crossings of the bus, at the speed of x's way down and back up.
    bus_per_ms = 8 * x.numel() / references[BUS_REFERENCE] if bus else float("inf")
    table = []
    for spec in labels:
        row = rows[spec]
        row["encode_ms"] = statistics.median(times[spec]["encode"])
        row["decode_ms"] = statistics.median(times[spec]["decode"])
        row["roundtrip_ms"] = row["encode_ms"] + row["decode_ms"]
        ef = "+ef" in spec
        row["floor_ms"] = (
            floor_bytes(x.numel(), row["bytes"], ef) / bytes_per_ms + 2 * row["bytes"] / bus_per_ms
        )
        row["x_floor"] = row["roundtrip_ms"] / row["floor_ms"]
        table.append(row)
    for name, value in references.items():
        table.append(
            {
                "codec": name,
                "bytes": None,
                "ratio": None,
                "encode_ms": value,
                "decode_ms": None,
                "roundtrip_ms": None,
                "floor_ms": None,
                "x_floor": None,
                "rel_error": None,
            }
        )

    by_name = {row["codec"]: row for row in table}
    topk_ms = by_name[TOPK_TARGET]["roundtrip_ms"]
    bounded = [rows[spec] for spec in CODECS if not entropy_coded(spec)]
    over = [row["codec"] for row in bounded if row["x_floor"] > FLOOR_FACTOR]
    targets = {
        "topk_ef_faster_than_torch_topk": {
            "codec": TOPK_TARGET,
            "roundtrip_ms": topk_ms,
            "reference_ms": references[TOPK_REFERENCE],
            "met": topk_ms < references[TOPK_REFERENCE],
        },
        "within_2x_floor": {
            "codecs": [row["codec"] for row in bounded],
            "over": over,
            "copy_gb_s": bytes_per_ms / 1e6,
            "bus_gb_s": bus_per_ms / 1e6 if bus else None,
            "met": not over,
        },
    }
    meta = {
        "numel": args.numel,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "device": str(device),
        "c_kernels": native_isa(),
        "method": "median of interleaved rounds after one warm-up round; encode includes "
        "the sender's estimate; rel_error of the first message",
        "targets": targets,
    }

    def verdict(met: bool) -> str:
        return mark(met)

    top, floor = targets.values()
    notes = [
        f"target 1: {TOPK_TARGET} round trip {top['roundtrip_ms']:.1f} ms vs one torch.topk "
        f"{top['reference_ms']:.1f} ms — {verdict(top['met'])}",
        f"target 2: within {FLOOR_FACTOR:g}x the memory-traffic floor (copy at "
        f"{floor['copy_gb_s']:.1f} GB/s"
        + (f", the payload over the bus at {floor['bus_gb_s']:.1f} GB/s" if bus else "")
        + "), all but entropy-coded indices — "
        f"{verdict(floor['met'])}" + (f"; over: {', '.join(over)}" if over else ""),
        f"{args.numel:,} float32 on {device}, torch threads {torch.get_num_threads()}, "
        f"C kernels: {native_isa() or 'not built'}, median of {args.rounds} interleaved rounds",
    ]
    columns = [
        Column("codec", "codec"),
        Column("bytes", "bytes", "{:,}"),
        Column("ratio", "ratio vs fp32", "{:.1f}x"),
        Column("encode_ms", "encode ms", "{:.1f}"),
        Column("decode_ms", "decode ms", "{:.1f}"),
        Column("roundtrip_ms", "round trip ms", "{:.1f}"),
        Column("floor_ms", "floor ms", "{:.1f}"),
        Column("x_floor", "x floor", "{:.1f}x"),
        Column("rel_error", "rel. L2 error", "{:.4f}"),
    ]
    report(
        "codecs",
        f"Codecs on {args.numel:,} float32 values ({4 * args.numel / 1e6:.0f} MB)",
        columns,
        table,
        meta,
        args.json,
        notes=notes,
    )


if __name__ == "__main__":
    run_script(main)
