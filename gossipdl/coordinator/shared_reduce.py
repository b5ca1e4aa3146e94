"""All-reduce through shared memory, for ranks on one host.

On one machine a TCP ring moves every byte through the kernel twice (send, receive) on
top of the additions. Here the ranks share one memory region instead: each copies its
piece of the vector in, reduces its own share of every rank's piece, and copies the
reduced piece out — three passes over the vector per rank and no system call per byte,
as NCCL and MPI do it within a node. Pieces of ``SHARED_PIECE`` values alternate
between two halves of the region, so a rank copies the next piece in while a slower one
still reads the last.

How the region is shared, with nothing taken from the network: rank 0 makes an
anonymous memory file (``memfd_create``, freed by the kernel when the last rank lets go,
also after a crash) and hands its descriptor to each other rank over a Unix socket in
the abstract namespace (no file, named by a hash of the ring's addresses). It answers
only processes of its own user (``SO_PEERCRED``), and each rank checks the region's
size against its own settings before mapping it. Linux only; elsewhere rings use TCP.

The ranks meet at a barrier after copying a piece in and after reducing it, through
rank 0 over the same sockets: a rank that dies closes its socket, so the others stop at
once with an error naming it, and one that stalls is named at the timeout. A share
whose mean is not finite stops every rank, as the TCP ring does.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import mmap
import os
import socket
import struct
import time

import numpy as np

from gossipdl.protocol.ring import chunk_bounds
from gossipdl.transport.wire import all_finite

__all__ = ["SHARED_PIECE", "SharedAllReduce", "SharedReduceError", "available", "on_this_host"]

SHARED_PIECE = 1 << 21  # values per piece (8 MB of float32); the region holds 2 x (N+1) of them
_HEADER = struct.Struct(
    "<4q"
)  # rank 0's settings, sent with the descriptor: N, numel, piece, bytes
_OK, _FAILED, _LEFT = b"\x01", b"\x00", b"\x02"  # a barrier's verdict; _LEFT: then the rank
_CONNECT_EVERY_S = 0.01  # how often a rank tries rank 0's socket until it listens
_LOCAL_PREFIXES = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://")


class SharedReduceError(RuntimeError):
    """A shared-memory all-reduce that cannot finish; the message names the rank to blame."""


def available() -> bool:
    """Whether this system can share a region this way (Linux: memfd and SCM_RIGHTS)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "SCM_RIGHTS")


def on_this_host(addresses: list[str]) -> bool:
    """Whether every address is this host's own (loopback TCP or ``ipc://``)."""
    return all(a.startswith(_LOCAL_PREFIXES) for a in addresses)


class SharedAllReduce:
    """Rank ``rank`` of ``size`` ranks on this host averaging ``numel`` float32 values;
    ``key`` names the group (every rank gives the same, e.g. the ring's addresses).

    The region is set up on the first :meth:`allreduce_mean_`, which every rank calls;
    ``timeout`` bounds each wait (for the others to connect, or at a barrier)."""

    def __init__(
        self, rank: int, size: int, numel: int, key: str, *, timeout: float = 30.0,
        piece: int = SHARED_PIECE,
    ) -> None:  # fmt: skip
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        if piece < 1:
            raise ValueError(f"piece = {piece}; give at least one value")
        self.rank, self.size, self.numel, self.timeout = rank, size, numel, timeout
        self.piece = min(piece, max(1, numel))
        digest = hashlib.sha256(f"gossipdl-allreduce|{key}".encode()).hexdigest()[:40]
        self.name = b"\0gossipdl-allreduce-" + digest.encode()
        self._pieces = [(a, min(a + self.piece, numel)) for a in range(0, numel, self.piece)]
        self._shares = chunk_bounds(self.piece, size)  # (start, end) of each rank's share
        self._bytes = 2 * (size + 1) * self.piece * 4
        self._links: list[socket.socket] = []  # rank 0: one per other rank, by rank; else: 0's
        self._map: mmap.mmap | None = None
        self._view: np.ndarray | None = None  # [2, N + 1, piece]: the inputs, then the mean

    # ----------------------------------------------------------------- the reduction
    def allreduce_mean_(self, x: np.ndarray) -> np.ndarray:
        """Replace ``x`` (float32, one dimension, ``numel`` values) by the mean over every
        rank, in place, and return it."""
        if x.dtype != np.float32 or x.shape != (self.numel,):
            raise ValueError(f"this all-reduce takes {self.numel} float32 values, got {x.shape}")
        if self.size == 1 or self.numel == 0:
            return x
        view = self._view if self._view is not None else self._open()
        lo, hi = self._shares[self.rank]
        for k, (a, b) in enumerate(self._pieces):
            half = view[k % 2]
            half[self.rank, : b - a] = x[a:b]
            self._barrier(True, f"copying piece {k} in")
            share = half[self.size, lo : min(hi, b - a)]
            np.add(half[0, lo : lo + len(share)], half[1, lo : lo + len(share)], out=share)
            for j in range(2, self.size):
                share += half[j, lo : lo + len(share)]
            share /= self.size
            self._barrier(all_finite(share), f"reducing piece {k}")
            x[a:b] = half[self.size, : b - a]
        return x

    def close(self) -> None:
        """Let go of the region and the sockets (the kernel frees the region with the last)."""
        for link in self._links:
            link.close()
        self._links = []
        self._view = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held (a traceback's): freed
                self._map.close()  # with the last of them
            self._map = None

    # ----------------------------------------------------------------- meeting
    def _barrier(self, ok: bool, doing: str) -> None:
        """Wait until every rank is done ``doing``; SharedReduceError if one left, stalled
        or (``ok`` False somewhere) made a share whose mean is not finite."""
        if self.rank == 0:
            verdict = ok
            for j, link in enumerate(self._links, start=1):
                try:
                    verdict &= self._receive(link, j, doing) == _OK
                except SharedReduceError:
                    self._tell_left(j)
                    raise
            for link in self._links:
                link.sendall(_OK if verdict else _FAILED)
        else:
            link = self._links[0]
            link.sendall(_OK if ok else _FAILED)
            got = self._receive(link, 0, doing)
            if got == _LEFT:
                culprit = int.from_bytes(link.recv(4), "little")
                raise SharedReduceError(
                    f"rank {self.rank}, shared-memory all-reduce: rank {culprit} left or stalled "
                    f"while {doing} (rank 0 waited for it); an all-reduce cannot finish "
                    "without every rank, so this rank stops."
                )
            verdict = got == _OK
        if not verdict:
            raise SharedReduceError(
                f"rank {self.rank}, shared-memory all-reduce: the mean is not finite while "
                f"{doing}: some rank sent NaN or Inf, or the sum overflowed"
            )

    def _tell_left(self, culprit: int) -> None:
        """Rank 0: tell every other rank whom the all-reduce lost, so none waits for it."""
        for j, link in enumerate(self._links, start=1):
            if j != culprit:
                with contextlib.suppress(OSError):  # it left too
                    link.sendall(_LEFT + culprit.to_bytes(4, "little"))

    def _receive(self, link: socket.socket, rank: int, doing: str) -> bytes:
        """One byte from ``rank``; SharedReduceError naming it if it left or stalled."""
        try:
            got = link.recv(1)
        except TimeoutError:
            got = None
        except OSError:
            got = b""
        if got:
            return got
        raise self._lost(rank, doing, got)

    def _lost(self, rank: int, doing: str, got: bytes | None) -> SharedReduceError:
        """The error for nothing from ``rank``: it closed (``got`` empty) or stalled (None)."""
        blame = "it left (its process died or closed)" if got == b"" else "it stalled"
        return SharedReduceError(
            f"rank {self.rank}, shared-memory all-reduce: nothing from rank {rank} within "
            f"{self.timeout:g}s while {doing}; {blame}. An all-reduce cannot finish without "
            "every rank, so this rank stops."
        )

    # ----------------------------------------------------------------- setting up
    def _open(self) -> np.ndarray:
        """Make (rank 0) or receive the region and map it."""
        fd = self._serve() if self.rank == 0 else self._attend()
        try:
            self._map = mmap.mmap(fd, self._bytes)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, np.float32).reshape(2, self.size + 1, self.piece)
        return self._view

    def _serve(self) -> int:
        """Rank 0: make the region, and hand it to every other rank as it connects."""
        fd = os.memfd_create("gossipdl-allreduce", os.MFD_CLOEXEC)
        os.ftruncate(fd, self._bytes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        links: dict[int, socket.socket] = {}
        try:
            listener.bind(self.name)
            listener.listen(self.size)
            deadline = time.monotonic() + self.timeout
            while len(links) < self.size - 1:
                listener.settimeout(max(1e-3, deadline - time.monotonic()))
                try:
                    link, _ = listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self.size)) - set(links))
                    raise SharedReduceError(
                        f"rank 0, shared-memory all-reduce: rank(s) {missing} did not come "
                        f"within {self.timeout:g}s"
                    ) from None
                rank = self._admit(link, links)
                if rank is not None:
                    links[rank] = link
        except BaseException:
            os.close(fd)
            for link in links.values():
                link.close()
            raise
        finally:
            listener.close()
        header = _HEADER.pack(self.size, self.numel, self.piece, self._bytes)
        for link in links.values():
            link.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        self._links = [links[j] for j in range(1, self.size)]
        return fd

    def _admit(self, link: socket.socket, links: dict[int, socket.socket]) -> int | None:
        """The rank a connecting process says it is, if it is one of ours; else None (closed)."""
        creds = link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        link.settimeout(self.timeout)
        try:
            said = link.recv(8) if uid == os.getuid() else b""
        except OSError:
            said = b""
        rank = int.from_bytes(said, "little") if len(said) == 8 else -1
        if not 0 < rank < self.size or rank in links:
            link.close()
            return None
        return rank

    def _attend(self) -> int:
        """A rank but 0: connect to rank 0 (again until it listens), say who we are, and
        receive the region's descriptor with rank 0's settings, which must be ours."""
        deadline = time.monotonic() + self.timeout
        while True:
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                link.connect(self.name)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                link.close()
                if time.monotonic() >= deadline:
                    raise SharedReduceError(
                        f"rank {self.rank}, shared-memory all-reduce: rank 0 did not listen "
                        f"within {self.timeout:g}s"
                    ) from None
                time.sleep(_CONNECT_EVERY_S)
        link.settimeout(self.timeout)
        self._links = [link]
        link.sendall(self.rank.to_bytes(8, "little"))
        try:
            header, fds, _, _ = socket.recv_fds(link, _HEADER.size, 1)
        except TimeoutError:
            raise self._lost(0, "setting up", None) from None
        if not header:
            raise self._lost(0, "setting up", b"")
        mine = (self.size, self.numel, self.piece, self._bytes)
        theirs = _HEADER.unpack(header) if len(header) == _HEADER.size else None
        if theirs != mine or len(fds) != 1 or os.fstat(fds[0]).st_size != self._bytes:
            for fd in fds:
                os.close(fd)
            raise SharedReduceError(
                f"rank {self.rank}, shared-memory all-reduce: rank 0 sent settings "
                f"{theirs} (ranks, values, piece, bytes), not this rank's {mine}"
            )
        return fds[0]
