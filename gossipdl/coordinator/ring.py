"""Ring all-reduce over gossipdl's transport: the threaded driver of the ring's state machine.

On one host, :class:`RingGroup` averages through shared memory instead
(:mod:`gossipdl.coordinator.shared_reduce`) unless told not to.

The protocol — which piece goes to whom at each of the 2(N−1) steps, the
reduce and gather arithmetic, the checks on what arrives, the "waiting for"
notices and the timeout that names a dead member — is
:class:`~gossipdl.protocol.ring.RingCore`, which has no I/O; the simulator drives
the same core. Here the transport's receive thread hands it the ``chunk``
messages, and the training thread polls it, sending what it asks and sleeping
on a condition until the next piece arrives or its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gossipdl.compression._kernels import stage_on_host
from gossipdl.coordinator import shared_reduce
from gossipdl.coordinator.shared_reduce import SharedAllReduce, SharedReduceError
from gossipdl.protocol.ring import (
    DEFAULT_PIECE,
    RING_CHECKS_FINITE,
    RING_CODECS,
    WAITING_FOR,
    RingCore,
    check_ring_codec,
    chunk_bounds,
)
from gossipdl.transport.addresses import resolve
from gossipdl.transport.sockets import Transport
from gossipdl.transport.wire import Message, WireError

__all__ = [
    "DEFAULT_PIECE",
    "RING_CHECKS_FINITE",
    "RING_CODECS",
    "RING_SEND_HWM",
    "WAITING_FOR",
    "AnyRing",
    "RingAllReduce",
    "RingError",
    "RingGroup",
    "SharedRing",
    "check_ring_codec",
    "check_shared_memory",
    "chunk_bounds",
]

RING_SEND_HWM = 4096  # a whole all-reduce's pieces may queue for a successor that is starting
_POLL_S = 0.2  # how often a wait looks whether the predecessor left


class RingError(RuntimeError):
    """A ring all-reduce that cannot finish; the message names the rank it waited for."""


def reduce_on_host(x: torch.Tensor, reduce: Callable[[Any], Any]) -> torch.Tensor:
    """Run ``reduce`` (in place, on a float32 numpy vector) on ``x``'s values and return
    ``x``: where they lie for a contiguous float32 CPU tensor (no copy, as gloo does), else
    through one host copy and back: from a GPU through pinned memory, the copy back queued
    on the device without a wait."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        reduce(x.detach().numpy().reshape(-1))
        return x
    values = x.detach().float()
    host = stage_on_host(values) if x.is_cuda else values.contiguous()
    reduce(host.numpy().reshape(-1))
    x.copy_(host.view_as(x), non_blocking=x.is_cuda)
    return x


def reduce_on_gpu(x: torch.Tensor, reduce: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """Run ``reduce`` (in place, on a float32 vector on ``x``'s GPU) on ``x``'s values and
    return ``x``: where they lie for a contiguous float32 tensor, else through one copy on
    the device and back."""
    flat = x.detach().float().contiguous().view(-1)
    reduce(flat)
    if flat.data_ptr() != x.data_ptr():
        x.copy_(flat.view_as(x))
    return x


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
        self.core = RingCore(me, ids, numel, codec=codec, timeout=timeout, piece=piece)
        self.numel = numel
        self.size = self.core.size
        self._send = send
        self._gone = gone
        self._arrived = threading.Condition()  # guards the core; notified on each arrival

    # ----------------------------------------------------------------- receive thread
    def deliver(self, msg: Message) -> None:
        """Keep one received piece for the all-reduce that needs it; WireError drops it."""
        item = self.core.parse(msg)  # outside the lock: it reads the piece for NaN and Inf
        with self._arrived:
            self.core.take(time.monotonic(), item)
            self._arrived.notify_all()

    # ----------------------------------------------------------------- training thread
    def allreduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise mean of ``x`` over the ring, as a new tensor (``x`` is kept)."""
        return self.allreduce_mean_(x.detach().clone())

    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by its element-wise mean over the ring, in place, and return it
        (:func:`reduce_on_host`: a contiguous float32 CPU tensor where it lies)."""
        if x.numel() != self.numel:
            raise ValueError(f"this ring reduces {self.numel} values, got {x.numel()}")
        if self.size == 1:
            return x
        return reduce_on_host(x, self._run)

    def _run(self, x: Any) -> None:
        """Drive the core through one all-reduce of ``x``: poll, send what it asks, and wait
        for the next arrival (or its deadline, or a look at whether the predecessor left)."""
        core = self.core
        with self._arrived:
            core.start(time.monotonic(), x)
        while True:
            with self._arrived:
                why = self._gone(core.predecessor)
                if why is not None:
                    core.left(core.predecessor, why)
                progress = core.poll(time.monotonic())
                if not (progress.moved or progress.sends or progress.failure):
                    wait = min(_POLL_S, (core.deadline or 0.0) - time.monotonic())
                    self._arrived.wait(max(0.0, wait))
                    continue
            for send in progress.sends:
                self._send(send.to, send.frames)
            if progress.failure is not None:
                raise RingError(progress.failure.message)
            if progress.result is not None:
                return


def check_shared_memory(shared_memory: bool, ring: bool, codec: str) -> None:
    """Reject shared memory where it cannot stand in for the TCP ring, or where this system
    has none, explaining why."""
    if not shared_memory:
        return
    if not ring:
        raise ValueError(
            "shared_memory averages a ring all-reduce (--mode ring, algorithm allreduce); "
            "gossip sends its neighbours models over the network: turn it off"
        )
    if codec == "fp16":
        raise ValueError(
            "shared_memory moves float32 values through memory, where fp16 saves nothing: "
            "use codec none (or powersgd:RANK), or the TCP ring for fp16"
        )
    shared_reduce.require_available()


class SharedRing:
    """The all-reduce of ranks on this host through shared memory (:class:`~gossipdl.
    coordinator.shared_reduce.SharedAllReduce`), with a ring's interface: GPU tensors
    averaged on the GPU, others in host memory, and failures raised as RingError naming
    the rank by ``names`` (e.g. peer ids). Nothing goes over the network, so no chunk
    message is ever due."""

    def __init__(
        self, rank: int, addresses: list[str], numel: int, *, timeout: float,
        names: list[str] | None = None,
    ) -> None:  # fmt: skip
        shared_reduce.require_available()
        self.shared = SharedAllReduce(
            rank, len(addresses), numel, "|".join(addresses), timeout=timeout, names=names
        )

    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by its element-wise mean over every rank, in place."""
        try:  # the shared all-reduce checks the length, as the ring does
            if x.is_cuda:
                return reduce_on_gpu(x, self.shared.allreduce_mean_)
            return reduce_on_host(x, self.shared.allreduce_mean_)
        except SharedReduceError as exc:
            raise RingError(str(exc)) from None

    def deliver(self, msg: Message) -> None:
        """No chunk is due: the means go through shared memory."""
        raise WireError("unexpected", "a chunk, but this ring averages through shared memory")

    def close(self) -> None:
        """Let go of the region and the sockets."""
        self.shared.close()


AnyRing = RingAllReduce | SharedRing  # what a peer's all-reduce of one vector runs on


class RingGroup:
    """A standalone ring over fixed addresses (rank i listens on ``addresses[i]``), for
    benchmarks and custom loops; a swarm's peers use ``RingAllReduce`` through their own
    endpoint (``gossipdl run --mode ring``; ``SharedRing`` with ``--shared-memory``).

    ``shared``: average through shared memory (:class:`~gossipdl.coordinator.shared_reduce.
    SharedAllReduce`) instead of the TCP ring; None (the default) does where it can: every
    address on this host (loopback or ``ipc://``), codec none, Linux. GPU tensors are then
    averaged on the GPU (every rank's on a GPU of this host), others in host memory.

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
        shared: bool | None = None,
    ) -> None:
        # the user's names, once, here: the transport dials IPs only (ipc:// stays as it is)
        addresses = [resolve(a, "address") if a.startswith("tcp://") else a for a in addresses]
        can_share = shared_reduce.available() and codec == "none"
        if shared and not can_share:
            raise ValueError(
                f"shared memory takes codec none on Linux (codec {codec!r} here); "
                "use shared=False for the TCP ring"
            )
        if shared is None:
            shared = can_share and len(addresses) > 1 and shared_reduce.on_this_host(addresses)
        # through shared memory, or the TCP ring's endpoint and driver (built only for it)
        self.shared = SharedRing(rank, addresses, numel, timeout=timeout) if shared else None
        self.ring: RingAllReduce | None = None
        self.transport: Transport | None = None
        if self.shared is None:  # the ring first: the endpoint hands it what arrives
            self.ring = RingAllReduce(
                rank,
                list(range(len(addresses))),
                numel,
                lambda j, frames: self._send(addresses[j], frames),
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

    def _send(self, address: str, frames: list[Any]) -> None:
        assert self.transport is not None
        self.transport.send(address, frames)

    def _on_message(self, msg: Message) -> None:
        if msg.kind != "chunk" or self.ring is None:
            raise WireError("unexpected", f"a ring takes chunk messages, got {msg.kind}")
        self.ring.deliver(msg)

    def allreduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise mean of ``x`` over every rank, as a new tensor (``x`` is kept)."""
        return self.allreduce_mean_(x.detach().clone())

    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by its element-wise mean over every rank, in place."""
        reducer = self.shared or self.ring
        assert reducer is not None
        return reducer.allreduce_mean_(x)

    def close(self) -> None:
        """Flush what is queued and close the endpoint (or let go of shared memory)."""
        if self.shared is not None:
            self.shared.close()
        if self.transport is not None:
            self.transport.close()

    def __enter__(self) -> RingGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
