"""Ring all-reduce over gossipdl's transport: reduce-scatter, then all-gather.

The vector is cut into N chunks (sizes differ by at most one element). In the
reduce-scatter phase (share-reduce), at step s = 0..N−2 rank r sends chunk
(r − s) mod N to its successor and adds chunk (r − s − 1) mod N, received from
its predecessor, to its own; afterwards rank r holds the full sum of chunk
(r + 1) mod N. In the all-gather phase (share-only), at step s it passes
chunk (r + 1 − s) mod N on unchanged. Each rank sends 2(N−1)/N of the vector
per all-reduce. Every chunk travels in pieces of at most ``piece`` values, so
a successor adds piece 0 while piece 1 is still on the wire (pipelining).

The sum is done on the host in numpy (what travels is the whole vector
anyway); ranks end with bit-identical results because every chunk's sum is
computed once and copied. ``fp16`` halves the bytes on the wire: each hop
sends float16, sums stay in float32.

Nothing non-finite gets through: every all-gather piece is checked for NaN
and Inf on arrival, and the partial sums of the reduce-scatter once, by the
rank that completes each chunk (NaN and Inf survive every addition), which
reads a quarter as much on four ranks as checking every piece would.

A rank that stops answering makes its successor raise ``RingError`` naming it
after ``timeout`` seconds; the error then reaches every rank the same way, so
a ring with a dead member stops instead of hanging.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gossipdl.transport.sockets import Transport
from gossipdl.transport.wire import Message, WireError, all_finite, encode

RING_CODECS = ("none", "fp16", "powersgd:RANK")  # see ring_powersgd for the low-rank one
DEFAULT_PIECE = 1 << 22  # values per message (16 MB of float32): fastest of 1M-8M measured
RING_CHECKS_FINITE = frozenset({"chunk"})  # each finished sum is checked once, not every piece
RING_SEND_HWM = 4096  # a whole all-reduce's pieces may queue for a successor that is starting
_POLL_S = 0.2
WAITING_FOR = "waiting_for"  # meta of a notice "I am stuck waiting for this peer"


class RingError(RuntimeError):
    """A ring all-reduce that cannot finish; the message names the rank it waited for."""


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges covering ``0..numel``, sizes within one.

    Example:
        >>> chunk_bounds(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_ring_codec(codec: str) -> None:
    """Reject a codec that reduce-scatter cannot carry, explaining why."""
    if codec in ("none", "fp16") or re.fullmatch(r"powersgd:[1-9]\d*", codec):
        return
    raise ValueError(
        f"codec {codec!r} cannot ride a ring all-reduce: every hop adds the incoming chunk to "
        "the local one, so a sparse or quantized chunk stops being sparse (or on the same "
        "grid) after the first addition and would have to be re-compressed at every hop, "
        "compounding the error N−1 times. Use one of "
        f"{', '.join(RING_CODECS)} with --mode ring, or gossip (--mode gossip) for sparse "
        "and quantized codecs."
    )


class RingAllReduce:
    """The all-reduce of one rank in a fixed ring of peer ids.

    ``send(peer_id, frames)`` queues a message for that peer; the owner of the
    transport hands every ``chunk`` message to ``deliver`` (receive thread).
    ``gone(peer_id)`` is None while a peer is in, else why it left (possibly
    ""), so a wait ends at once instead of at the timeout, naming the cause.
    """

    def __init__(
        self,
        me: int,
        ids: list[int],
        numel: int,
        send: Callable[[int, list[Any]], None],
        *,
        codec: str = "none",
        timeout: float = 10.0,
        piece: int = DEFAULT_PIECE,
        gone: Callable[[int], str | None] = lambda _: None,
    ) -> None:
        if codec not in ("none", "fp16"):  # powersgd rides on a plain ring (ring_powersgd)
            raise ValueError(f"a ring carries none or fp16 values, got {codec!r}")
        if me not in ids:
            raise ValueError(f"peer {me} is not in the ring {ids}")
        self.ids = sorted(ids)
        self.size = len(self.ids)
        self.rank = self.ids.index(me)
        self.me = me
        self.successor = self.ids[(self.rank + 1) % self.size]
        self.predecessor = self.ids[(self.rank - 1) % self.size]
        self.codec = codec
        self.wire_dtype = np.dtype(np.float16 if codec == "fp16" else np.float32)
        self.timeout = timeout
        self.numel = numel
        self._pieces_of = [
            [(a, min(a + piece, end)) for a in range(start, end, piece)] or [(start, end)]
            for start, end in chunk_bounds(numel, self.size)
        ]
        self._send = send
        self._gone = gone
        self._op = 0
        self._received: dict[tuple[int, int, int], np.ndarray] = {}
        self._upstream = (self.predecessor, -math.inf)  # whom the predecessor waits for, when
        self._arrived = threading.Condition()

    # ----------------------------------------------------------------- receive thread
    def deliver(self, msg: Message) -> None:
        """Keep one received piece for the all-reduce that needs it; WireError drops it."""
        if msg.sender != self.predecessor:
            raise WireError("unexpected", f"chunk from peer {msg.sender}, not my predecessor")
        if WAITING_FOR in msg.meta:
            culprit = msg.meta[WAITING_FOR]
            if culprit not in self.ids or isinstance(culprit, bool):
                raise WireError("bad_meta", f"{WAITING_FOR} {culprit!r} is not a ring member")
            self._upstream = (culprit, time.monotonic())
            return
        step, piece = msg.meta.get("step"), msg.meta.get("piece")
        if type(step) is not int or type(piece) is not int:  # bool is not a count either
            raise WireError("bad_meta", f"chunk step {step!r} / piece {piece!r} not integers")
        if not 0 <= step < 2 * (self.size - 1):
            raise WireError("bad_meta", f"chunk step {step} is outside 0..{2 * self.size - 3}")
        expected = self._pieces_of[self._chunk_received_at(step)]
        if not 0 <= piece < len(expected):
            raise WireError("bad_meta", f"chunk piece {piece} is outside 0..{len(expected) - 1}")
        a, b = expected[piece]
        array = msg.arrays[0].reshape(-1) if len(msg.arrays) == 1 else None
        if array is None or array.dtype != self.wire_dtype or array.size != b - a:
            raise WireError(
                "bad_payload", f"piece {piece} is one {self.wire_dtype} array of {b - a}"
            )
        if step >= self.size - 1 and not all_finite(array):  # a finished sum, passed on as is
            raise WireError("non_finite", f"all-gather piece {piece} contains NaN or Inf")
        with self._arrived:
            if not self._op <= msg.round <= self._op + 1:  # a ring is at most one op apart
                raise WireError("unexpected", f"chunk of all-reduce {msg.round}, at {self._op}")
            self._received[(msg.round, step, piece)] = array
            self._arrived.notify_all()

    def _chunk_received_at(self, step: int) -> int:
        """Which chunk this rank receives at ``step`` (reduce-scatter steps first)."""
        n = self.size
        return (self.rank - step - 1) % n if step < n - 1 else (self.rank - (step - n + 1)) % n

    # ----------------------------------------------------------------- training thread
    def allreduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise mean of ``x`` over the ring, as a new tensor (``x`` is kept)."""
        return self.allreduce_mean_(x.detach().clone())

    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by its element-wise mean over the ring, in place, and return it.

        A contiguous float32 CPU tensor is reduced where it lies (no copy, as gloo
        does); anything else goes through one host copy and back.
        """
        if x.numel() != self.numel:
            raise ValueError(f"this ring reduces {self.numel} values, got {x.numel()}")
        if self.size == 1:
            return x
        in_place = x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
        host = x.detach().numpy() if in_place else x.detach().to("cpu", torch.float32).numpy()
        self._allreduce_mean_(host.reshape(-1))
        if not in_place:
            x.copy_(torch.from_numpy(host).view_as(x))
        return x

    def _allreduce_mean_(self, x: np.ndarray) -> None:
        """Average ``x`` over the ring in place. The rank that completes a chunk's sum
        divides it by N before sharing it, so the division touches 1/N of the vector.

        Chunks are sent straight from ``x`` (zero-copy) and later overwritten
        there; that is safe because a chunk comes back to this rank only after
        its successor received everything this rank sent of it.
        """
        n, r, op = self.size, self.rank, self._op
        wire = self.wire_dtype
        exact = wire == np.float32
        pieces = self._pieces_of.__getitem__
        for p, (a, b) in enumerate(pieces(r)):  # reduce-scatter, step 0: my own chunk
            self._put(op, 0, p, x[a:b] if exact else x[a:b].astype(wire))
        for s in range(n - 1):  # reduce-scatter: add the predecessor's partial sum
            c = (r - s - 1) % n
            last = s == n - 2  # then chunk c = r + 1 holds the full sum: average, round, share
            for p, (a, b) in enumerate(pieces(c)):
                mine = x[a:b]
                np.add(mine, self._take(op, s, p), out=mine)
                if last:
                    mine /= n
                    if not all_finite(mine):  # NaN and Inf survive every addition
                        raise RingError(
                            f"peer {self.me}, ring all-reduce {op}: the mean of chunk {c} is "
                            "not finite: some peer sent NaN or Inf, or the sum overflowed"
                        )
                sent = mine if exact else mine.astype(wire)
                if last and not exact:
                    mine[:] = sent  # keep exactly what every other rank will receive
                self._put(op, n - 1 if last else s + 1, p, sent)
        for s in range(n - 1):  # all-gather: copy the finished chunk, pass it on unchanged
            c = (r - s) % n
            for p, (a, b) in enumerate(pieces(c)):
                got = self._take(op, n - 1 + s, p)
                x[a:b] = got
                if s < n - 2:
                    self._put(op, n + s, p, got)
        with self._arrived:
            self._op += 1
            for key in [k for k in self._received if k[0] < self._op]:
                del self._received[key]

    def _put(self, op: int, step: int, piece: int, values: np.ndarray) -> None:
        frames = encode("chunk", self.me, 0, op, [values], {"step": step, "piece": piece})
        self._send(self.successor, frames)

    def _take(self, op: int, step: int, piece: int) -> np.ndarray:
        """Wait for one piece from the predecessor, at most ``timeout`` seconds.

        While it waits, this rank tells its successor every second whom the
        ring is stuck on (its predecessor, or whoever the predecessor said it
        waits for), so when a peer dies every rank's error names that peer.
        """
        key = (op, step, piece)
        start = time.monotonic()
        told = start
        with self._arrived:
            while True:
                got = self._received.pop(key, None)
                if got is not None:
                    return got
                why = self._gone(self.predecessor)
                if why is not None:
                    raise RingError(
                        f"peer {self.me}, ring all-reduce {op}: peer {self.predecessor} (its "
                        f"predecessor) left the ring{f' — {why}' if why else ''}; a ring "
                        "cannot finish without every member"
                    )
                now = time.monotonic()
                culprit = self._stuck_on(now)
                if now - start >= self.timeout:
                    blame = (
                        "it died or stalled"
                        if culprit == self.predecessor
                        else f"it is waiting for peer {culprit}, which died or stalled"
                    )
                    raise RingError(
                        f"peer {self.me}, ring all-reduce {op}: nothing from peer "
                        f"{self.predecessor} (its predecessor) for {self.timeout:g}s at step "
                        f"{step}; {blame}. A ring cannot finish without every member, so this "
                        "peer stops."
                    )
                if now - told >= 1.0:
                    told = now
                    notice = encode("chunk", self.me, 0, op, (), {WAITING_FOR: culprit})
                    self._send(self.successor, notice)
                self._arrived.wait(min(_POLL_S, start + self.timeout - now))

    def _stuck_on(self, now: float) -> int:
        """Whom the ring waits for: the predecessor, or whom it recently said it waits for."""
        culprit, when = self._upstream
        return culprit if now - when < 2.5 else self.predecessor


class RingGroup:
    """A standalone ring over fixed addresses (rank i listens on ``addresses[i]``), for
    benchmarks and custom loops; a swarm's peers use ``RingAllReduce`` through their own
    endpoint (``gossipdl run --mode ring``).

    Example (one process per rank)::

        with RingGroup(rank, ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"], x.numel()) as ring:
            mean = ring.allreduce_mean(x)
    """

    def __init__(
        self,
        rank: int,
        addresses: list[str],
        numel: int,
        *,
        codec: str = "none",
        timeout: float = 30.0,
        piece: int = DEFAULT_PIECE,
    ) -> None:
        self.ring = RingAllReduce(
            rank,
            list(range(len(addresses))),
            numel,
            lambda j, frames: self.transport.send(addresses[j], frames),
            codec=codec,
            timeout=timeout,
            piece=piece,
        )
        self.transport = Transport(
            addresses[rank],
            self._on_message,
            name=f"ring-{rank}",
            send_hwm=RING_SEND_HWM,
            finite_checked_by=RING_CHECKS_FINITE,
        )

    def _on_message(self, msg: Message) -> None:
        if msg.kind != "chunk":
            raise WireError("unexpected", f"a ring takes chunk messages, got {msg.kind}")
        self.ring.deliver(msg)

    def allreduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise mean of ``x`` over every rank, as a new tensor."""
        return self.ring.allreduce_mean(x)

    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by its element-wise mean over every rank, in place."""
        return self.ring.allreduce_mean_(x)

    def close(self) -> None:
        """Flush what is queued and close the endpoint."""
        self.transport.close()

    def __enter__(self) -> RingGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
