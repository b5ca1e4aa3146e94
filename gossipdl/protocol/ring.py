"""Ring all-reduce as a state machine: reduce-scatter, then all-gather; events in, frames out.

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

A rank that waits tells its successor every ``notice_every`` seconds whom the
ring is stuck on (its predecessor, or whoever the predecessor said it waits
for); after ``timeout`` seconds without a piece it fails naming that peer, and
at once if its predecessor left. So when a peer dies, every rank's error names it.

:class:`RingCore` is one rank of it, with no I/O (h11's way): the engine says
what happened — an all-reduce of this vector begins (:meth:`RingCore.start`), a
``chunk`` message came from the predecessor (:meth:`RingCore.receive`), a member
left (:meth:`RingCore.left`), time is now t (:meth:`RingCore.poll`) — and carries
out the :class:`RingProgress` each poll returns: frames to send, the reduced
vector once done, or a :class:`RingFailure` naming the peer it waited for. The
real engine (:mod:`gossipdl.coordinator.ring`) drives it from ZeroMQ and the
wall clock, the simulator (:mod:`gossipdl.sim.ring`) from its network and clock.

Example (two ranks, frames passed by hand; each poll does one piece of work):
    >>> import numpy as np
    >>> from gossipdl.transport.wire import decode
    >>> ranks = [RingCore(r, [0, 1], 4) for r in (0, 1)]
    >>> xs = [np.arange(4, dtype=np.float32), np.full(4, 2, np.float32)]
    >>> for core, x in zip(ranks, xs):
    ...     core.start(0.0, x)
    >>> done = {}
    >>> while len(done) < 2:
    ...     for core in ranks:
    ...         progress = core.poll(0.0)
    ...         for send in progress.sends:  # on a wire: the bytes, as they were when sent
    ...             frames = [bytes(f) for f in send.frames]
    ...             ranks[send.to].receive(0.0, decode(frames, 1 << 20))
    ...         if progress.result is not None:
    ...             done[core.me] = progress.result
    >>> done[0].tolist(), done[1].tolist()
    ([1.0, 1.5, 2.0, 2.5], [1.0, 1.5, 2.0, 2.5])
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from gossipdl.protocol.core import Send
from gossipdl.transport.wire import Message, WireError, all_finite, encode

RING_CODECS = ("none", "fp16", "powersgd:RANK")  # powersgd: ring_powersgd, over a plain ring
DEFAULT_PIECE = 1 << 22  # values per message (16 MB of float32): fastest of 1M-8M measured
RING_CHECKS_FINITE = frozenset({"chunk"})  # each finished sum is checked once, not every piece
WAITING_FOR = "waiting_for"  # meta of a notice "I am stuck waiting for this peer"
NOTICE_EVERY_S = 1.0  # how often a waiting rank tells its successor whom it waits for
UPSTREAM_FRESH_S = 2.5  # a predecessor's notice names the culprit for this long


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


@dataclass(frozen=True)
class RingFailure:
    """An all-reduce that cannot finish: ``culprit`` is the peer the ring waits for (None
    when no peer is to blame by name, e.g. a sum that is not finite)."""

    culprit: int | None
    message: str


@dataclass
class RingProgress:
    """What a poll moved: frames to send now (in order), the reduced vector once the
    all-reduce is done (the one :meth:`RingCore.start` got, reduced in place), or why it
    cannot finish. ``moved``: work was done, so poll again at once; else wait for a message
    or :attr:`RingCore.deadline`."""

    sends: list[Send] = field(default_factory=list)
    result: np.ndarray | None = None
    failure: RingFailure | None = None
    moved: bool = False


@dataclass(frozen=True)
class _Task:
    """One piece this rank receives and what it does with it: at reduce-scatter steps it
    adds it to its own (the last of them completes the chunk's sum), at all-gather steps
    it copies it; every step but the last passes the result on."""

    step: int
    piece: int
    start: int
    end: int
    chunk: int


@dataclass(frozen=True)
class _Piece:
    op: int
    step: int
    piece: int
    values: np.ndarray


@dataclass(frozen=True)
class _Notice:
    culprit: int


class RingCore:
    """Rank ``me`` of the all-reduce of ``numel`` float32 values over the ring of ``ids``
    (sorted: each rank sends to the next id, receives from the previous)."""

    def __init__(
        self,
        me: int,
        ids: list[int],
        numel: int,
        *,
        codec: str = "none",
        timeout: float = 10.0,
        piece: int = DEFAULT_PIECE,
        notice_every: float = NOTICE_EVERY_S,
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
        self.notice_every = notice_every
        self.numel = numel
        self._pieces_of = [
            [(a, min(a + piece, end)) for a in range(start, end, piece)] or [(start, end)]
            for start, end in chunk_bounds(numel, self.size)
        ]
        self._tasks = self._plan()
        self.op = 0  # the all-reduce under way, or the next one
        self.failure: RingFailure | None = None
        self._received: dict[tuple[int, int, int], np.ndarray] = {}  # (op, step, piece)
        self._upstream = (self.predecessor, -math.inf)  # whom the predecessor waits for, when
        self._left: dict[int, str] = {}  # members that left, and why
        self._x: np.ndarray | None = None  # the vector being reduced
        self._next = 0  # the task due; -1: the start's own pieces are still to send
        self._since = self._told = 0.0  # the last progress; the last notice

    def _plan(self) -> list[_Task]:
        """The pieces this rank receives in one all-reduce, in the order it uses them."""
        n, r = self.size, self.rank
        chunks = [(r - s - 1) % n for s in range(n - 1)] + [(r - s) % n for s in range(n - 1)]
        return [
            _Task(step, p, a, b, c)
            for step, c in enumerate(chunks)
            for p, (a, b) in enumerate(self._pieces_of[c])
        ]

    # ----------------------------------------------------------------- events
    def start(self, now: float, x: np.ndarray) -> None:
        """Begin the next all-reduce: the mean of ``x`` (float32, one dimension) replaces it
        in place. Its frames refer to ``x`` (zero-copy): leave it alone until the result."""
        if self.busy:
            raise RuntimeError(f"peer {self.me}: ring all-reduce {self.op} is still under way")
        if x.dtype != np.float32 or x.shape != (self.numel,):
            raise ValueError(f"this ring reduces {self.numel} float32 values, got {x.shape}")
        self._x, self._next, self.failure = x, -1 if self.size > 1 else 0, None
        self._since = self._told = now

    @property
    def busy(self) -> bool:
        """Whether an all-reduce is under way (started and neither done nor failed)."""
        return self._x is not None and self.failure is None

    @property
    def deadline(self) -> float | None:
        """When a poll is due if nothing arrives (a notice, or the timeout); None if idle."""
        if not self.busy:
            return None
        return min(self._since + self.timeout, self._told + self.notice_every)

    def receive(self, now: float, msg: Message) -> None:
        """A ``chunk`` message came (decoded by the wire format); :class:`WireError` if it
        cannot be used (the engine counts it as dropped, for the reason it names)."""
        self.take(now, self.parse(msg))

    def parse(self, msg: Message) -> _Piece | _Notice:
        """Check a ``chunk`` message against the ring's shape; reads no state that events
        change, so a threaded engine may call it outside its lock."""
        if msg.sender != self.predecessor:
            raise WireError("unexpected", f"chunk from peer {msg.sender}, not my predecessor")
        if WAITING_FOR in msg.meta:
            culprit = msg.meta[WAITING_FOR]
            if culprit not in self.ids or isinstance(culprit, bool):
                raise WireError("bad_meta", f"{WAITING_FOR} {culprit!r} is not a ring member")
            return _Notice(culprit)
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
        return _Piece(msg.round, step, piece, array)

    def take(self, now: float, item: _Piece | _Notice) -> None:
        """Keep what :meth:`parse` made of a message for the all-reduce that needs it."""
        if isinstance(item, _Notice):
            self._upstream = (item.culprit, now)
            return
        if not self.op <= item.op <= self.op + 1:  # a ring is at most one op apart
            raise WireError("unexpected", f"chunk of all-reduce {item.op}, at {self.op}")
        self._received[(item.op, item.step, item.piece)] = item.values

    def left(self, peer: int, why: str = "") -> None:
        """Member ``peer`` left the swarm (``why``, if it said): a wait on it ends at once."""
        self._left[peer] = why

    def _chunk_received_at(self, step: int) -> int:
        """Which chunk this rank receives at ``step`` (reduce-scatter steps first)."""
        n = self.size
        return (self.rank - step - 1) % n if step < n - 1 else (self.rank - (step - n + 1)) % n

    # ----------------------------------------------------------------- time
    def poll(self, now: float) -> RingProgress:
        """Do the next piece of work at ``now``: send this rank's own chunk (the start), or
        use the piece due if it came; else wait: a notice when one is due, a failure when
        the predecessor left or the wait timed out."""
        x = self._x
        if x is None or self.failure is not None:
            return RingProgress(failure=self.failure)
        if self._next < 0:  # reduce-scatter, step 0: my own chunk
            self._next = 0
            exact = self.wire_dtype == np.float32
            own = self._pieces_of[self.rank]
            sends = [
                self._put(0, p, x[a:b] if exact else x[a:b].astype(self.wire_dtype))
                for p, (a, b) in enumerate(own)
            ]
            return RingProgress(sends, moved=True)
        if self._next < len(self._tasks):
            task = self._tasks[self._next]
            got = self._received.pop((self.op, task.step, task.piece), None)
            if got is None:
                return self._wait(now, task.step)
            self._since = self._told = now
            self._next += 1
            progress = self._use(x, task, got)
            if progress.failure is not None or self._next < len(self._tasks):
                return progress
        else:
            progress = RingProgress(moved=True)  # one rank: the mean is the vector
        self.op += 1
        for key in [k for k in self._received if k[0] < self.op]:
            del self._received[key]
        self._x = None
        progress.result = x
        return progress

    def _use(self, x: np.ndarray, task: _Task, got: np.ndarray) -> RingProgress:
        """Add (reduce-scatter) or copy (all-gather) one received piece; pass it on. The
        rank that completes a chunk's sum divides it by N before sharing it, so the division
        touches 1/N of the vector.

        Chunks are sent straight from ``x`` (zero-copy) and later overwritten there; that
        is safe because a chunk comes back to this rank only after its successor received
        everything this rank sent of it."""
        n, step, wire = self.size, task.step, self.wire_dtype
        exact = wire == np.float32
        mine = x[task.start : task.end]
        if step >= n - 1:  # all-gather: copy the finished chunk, pass it on unchanged
            mine[:] = got
            if step == 2 * n - 3:
                return RingProgress(moved=True)
            return RingProgress([self._put(step + 1, task.piece, got)], moved=True)
        np.add(mine, got, out=mine)  # reduce-scatter: add the predecessor's partial sum
        last = step == n - 2  # then this chunk (r + 1) holds the full sum: average, share
        if last:
            mine /= n
        with np.errstate(over="ignore"):  # a mean past float16's range: refused just below
            # the finished chunk goes out as a copy: nothing this rank still waits for needs
            # its successor to have read it, so the all-reduce may return with it queued,
            # and the caller's next writes to its buffer (the next backward's gradients,
            # with overlap) went out in its place: ranks then held different means
            sent = (mine.copy() if last else mine) if exact else mine.astype(wire)
        if last:  # what goes out: a finite mean past float16's range is Inf on the wire
            if not all_finite(sent):  # NaN and Inf survive every addition
                self.failure = RingFailure(
                    None,
                    f"peer {self.me}, ring all-reduce {self.op}: the mean of chunk {task.chunk} "
                    f"is not finite in {np.dtype(wire).name}: some peer sent NaN or Inf, or "
                    "the sum overflowed",
                )
                return RingProgress(failure=self.failure)
            if not exact:
                mine[:] = sent  # keep exactly what every other rank will receive
        return RingProgress([self._put(step + 1, task.piece, sent)], moved=True)

    def _wait(self, now: float, step: int) -> RingProgress:
        """The piece due is not here: fail if the predecessor left or the wait timed out,
        else tell the successor whom the ring is stuck on, every ``notice_every``."""
        op, pred = self.op, self.predecessor
        why = self._left.get(pred)
        if why is not None:
            self.failure = RingFailure(
                pred,
                f"peer {self.me}, ring all-reduce {op}: peer {pred} (its predecessor) left the "
                f"ring{f' — {why}' if why else ''}; a ring cannot finish without every member",
            )
            return RingProgress(failure=self.failure)
        culprit = self._stuck_on(now)
        if now >= self._since + self.timeout:  # as the deadline says, to the last bit
            blame = (
                "it died or stalled"
                if culprit == pred
                else f"it is waiting for peer {culprit}, which died or stalled"
            )
            self.failure = RingFailure(
                culprit,
                f"peer {self.me}, ring all-reduce {op}: nothing from peer {pred} (its "
                f"predecessor) for {self.timeout:g}s at step {step}; {blame}. A ring cannot "
                "finish without every member, so this peer stops.",
            )
            return RingProgress(failure=self.failure)
        if now < self._told + self.notice_every:
            return RingProgress()
        self._told = now
        notice = encode("chunk", self.me, 0, op, (), {WAITING_FOR: culprit})
        return RingProgress([Send(self.successor, "chunk", notice)])

    def _stuck_on(self, now: float) -> int:
        """Whom the ring waits for: the predecessor, or whom it recently said it waits for."""
        culprit, when = self._upstream
        return culprit if now - when < UPSTREAM_FRESH_S else self.predecessor

    def _put(self, step: int, piece: int, values: np.ndarray) -> Send:
        meta = {"step": step, "piece": piece}
        return Send(self.successor, "chunk", encode("chunk", self.me, 0, self.op, [values], meta))
