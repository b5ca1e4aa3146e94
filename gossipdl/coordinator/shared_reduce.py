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

Vectors on a GPU are averaged on the GPU: the region is then GPU memory that rank 0
allocates and hands over the same socket as CUDA IPC fields (:mod:`~gossipdl.coordinator.
cuda_ipc`; one share per rank, as torch counts a region's users; ranks in rank 0's own
process, which CUDA cannot hand its own memory, take the tensor itself). The copies in
and out and the reduction run on the device, each rank waits for its own stream before a
barrier, and nothing crosses to the host. Pieces are then ``SHARED_GPU_PIECE`` values:
each barrier waits for the device, so fewer and larger pieces are faster there.

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
from typing import Any

import numpy as np
import torch

from gossipdl.protocol.ring import chunk_bounds
from gossipdl.transport.wire import all_finite

__all__ = [
    "SHARED_PIECE",
    "SharedAllReduce",
    "SharedReduceError",
    "available",
    "on_this_host",
    "require_available",
]

VERDICT_MARGIN_S = 1.0  # beyond twice the timeout, a rank's wait for rank 0's verdict
SHARED_PIECE = 1 << 21  # values per piece in host memory (8 MB of float32)
SHARED_GPU_PIECE = 1 << 25  # on a GPU (128 MB); the region holds (N + 1) pieces, 2 x when split
_HEADER = struct.Struct(
    "<5q"
)  # rank 0's settings, sent with the region: N, numel, piece, bytes, on a GPU (1) or not (0)
_BLOB = struct.Struct("<i")  # the length of a GPU region's description, before it
MAX_GPU_REGION_BLOB = 1 << 16  # bytes a GPU region's description may take
GPU_REGION_RELEASE_S = 5.0  # how long rank 0's close waits for the others to let go of it
_IN_PROCESS: dict[bytes, torch.Tensor] = {}  # GPU regions served by this process, by name
_OK, _FAILED, _LEFT = b"\x01", b"\x00", b"\x02"  # a barrier's verdict; _LEFT: then the rank
_CONNECT_EVERY_S = 0.01  # how often a rank tries rank 0's socket until it listens
_LOCAL_PREFIXES = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://")


Vector = np.ndarray | torch.Tensor  # what an all-reduce averages: host values or a GPU tensor


class SharedReduceError(RuntimeError):
    """A shared-memory all-reduce that cannot finish; the message names the rank to blame."""


def _finite(share: Vector) -> bool:
    """Whether every value of ``share`` is finite (on a GPU: after its stream is done)."""
    if isinstance(share, torch.Tensor):
        return bool(torch.isfinite(share).all())
    return all_finite(share)


def _receive_some(link: socket.socket, n: int) -> bytes | None:
    """Up to ``n`` bytes from ``link``: empty if the other end left, None if it stalled."""
    try:
        return link.recv(n)
    except TimeoutError:
        return None
    except OSError:
        return b""


def _peer_pid(link: socket.socket) -> int:
    """The process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def available() -> bool:
    """Whether this system can share a region this way (Linux: memfd and SCM_RIGHTS)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "SCM_RIGHTS")


def require_available() -> None:
    """ValueError, saying why, where this system cannot share a region (:func:`available`)."""
    if not available():
        raise ValueError("shared memory needs Linux (memfd and SCM_RIGHTS); use the TCP ring")


def on_this_host(addresses: list[str]) -> bool:
    """Whether every address is this host's own (loopback TCP or ``ipc://``)."""
    return all(a.startswith(_LOCAL_PREFIXES) for a in addresses)


class SharedAllReduce:
    """Rank ``rank`` of ``size`` ranks on this host averaging ``numel`` float32 values;
    ``key`` names the group (every rank gives the same, e.g. the ring's addresses).

    The region is set up on the first :meth:`allreduce_mean_`, which every rank calls;
    ``timeout`` bounds each wait (for the others to connect, or at a barrier). ``piece``:
    values a piece; None takes ``SHARED_PIECE`` for host vectors, ``SHARED_GPU_PIECE`` for
    GPU ones. ``names``: how errors name each rank (default "rank N")."""

    def __init__(
        self, rank: int, size: int, numel: int, key: str, *, timeout: float = 30.0,
        piece: int | None = None, names: list[str] | None = None,
    ) -> None:  # fmt: skip
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        if piece is not None and piece < 1:
            raise ValueError(f"piece = {piece}; give at least one value")
        if names is not None and len(names) != size:
            raise ValueError(f"{len(names)} names for {size} ranks")
        self.rank, self.size, self.numel, self.timeout = rank, size, numel, timeout
        self._piece = piece
        self._names = names or [f"rank {j}" for j in range(size)]
        digest = hashlib.sha256(f"gossipdl-allreduce|{key}".encode()).hexdigest()[:40]
        self.name = b"\0gossipdl-allreduce-" + digest.encode()
        self.piece, self._bytes = 0, 0  # set with the region (the piece depends on where)
        self._pieces: list[tuple[int, int]] = []
        self._shares: list[tuple[int, int]] = []  # (start, end) of each rank's share
        self._links: list[socket.socket] = []  # rank 0: one per other rank, by rank; else: 0's
        self._map: mmap.mmap | None = None
        # [halves, N + 1, piece]: the inputs, then the mean; in host memory or on a GPU
        self._view: np.ndarray | torch.Tensor | None = None

    def _error(self, text: str) -> SharedReduceError:
        """An error of this rank's all-reduce, saying which rank it is."""
        return SharedReduceError(f"{self._who(self.rank)}, shared-memory all-reduce: {text}")

    def _who(self, rank: int) -> str:
        """How errors name ``rank`` (``names``, e.g. peer ids; else "rank N")."""
        return self._names[rank]

    def _lay_out(self, on_gpu: bool) -> tuple[int, int, int]:
        """Cut the vector into pieces for a region on a GPU or not; its shape."""
        default = SHARED_GPU_PIECE if on_gpu else SHARED_PIECE
        self.piece = min(self._piece or default, max(1, self.numel))
        n, piece = self.numel, self.piece
        self._pieces = [(a, min(a + piece, n)) for a in range(0, n, piece)]
        self._shares = chunk_bounds(piece, self.size)
        halves = min(2, len(self._pieces))  # one piece needs no second half
        self._bytes = halves * (self.size + 1) * piece * 4
        return halves, self.size + 1, piece

    # ----------------------------------------------------------------- the reduction
    def allreduce_mean_(self, x: Vector) -> Vector:
        """Replace ``x`` (float32, one dimension, ``numel`` values: a numpy vector, or a
        tensor on a GPU, averaged there) by the mean over every rank, in place, and return
        it. Every rank passes the same kind, every call."""
        on_gpu = isinstance(x, torch.Tensor)
        if isinstance(x, torch.Tensor) and not x.is_cuda:
            raise ValueError("this all-reduce takes a numpy vector or a GPU tensor")
        if x.dtype not in (np.float32, torch.float32) or tuple(x.shape) != (self.numel,):
            raise ValueError(f"this all-reduce takes {self.numel} float32 values, got {x.shape}")
        if self.size == 1 or self.numel == 0:
            return x
        view = self._view if self._view is not None else self._open(x)
        if isinstance(view, torch.Tensor) != on_gpu:
            raise ValueError(
                f"this all-reduce's region is {'in host memory' if on_gpu else 'on a GPU'}; "
                "give it the same kind of vector every call"
            )
        add: Any = torch.add if on_gpu else np.add
        lo, hi = self._shares[self.rank]
        for k, (a, b) in enumerate(self._pieces):
            half: Any = view[k % 2]
            half[self.rank, : b - a] = x[a:b]
            self._settle(x)
            self._barrier(True, f"copying piece {k} in")
            share = half[self.size, lo : min(hi, b - a)]
            add(half[0, lo : lo + len(share)], half[1, lo : lo + len(share)], out=share)
            for j in range(2, self.size):
                share += half[j, lo : lo + len(share)]
            share /= self.size
            self._barrier(_finite(share), f"reducing piece {k}")
            x[a:b] = half[self.size, : b - a]
        self._settle(x)  # the last copy out is done before a caller may close the region
        return x

    def _settle(self, x: Vector) -> None:
        """Wait for this rank's queued GPU work on ``x`` and the region (nothing on the host)."""
        if isinstance(x, torch.Tensor):
            assert isinstance(self._view, torch.Tensor)
            torch.cuda.current_stream(x.device).synchronize()
            if self._view.device != x.device:
                torch.cuda.current_stream(self._view.device).synchronize()

    def close(self) -> None:
        """Let go of the region and the sockets (the kernel frees a host region with the
        last rank; rank 0 keeps a GPU region until the others let go of it, or
        ``GPU_REGION_RELEASE_S``, since CUDA memory is its allocator's)."""
        on_gpu = isinstance(self._view, torch.Tensor)
        self._view = None
        if on_gpu and self.rank == 0:
            deadline = time.monotonic() + GPU_REGION_RELEASE_S
            for link in self._links:  # each closes its link after letting go of the region
                if _peer_pid(link) == os.getpid():
                    continue  # a thread of this process, which uses the tensor itself
                link.settimeout(max(1e-3, deadline - time.monotonic()))
                while _receive_some(link, 4096):
                    pass
            _IN_PROCESS.pop(self.name, None)
        for link in self._links:
            link.close()
        self._links = []
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
            deadline = time.monotonic() + self.timeout  # one wait for all: its verdict is due
            for j, link in enumerate(self._links, start=1):
                link.settimeout(max(1e-3, deadline - time.monotonic()))
                try:
                    verdict &= self._receive(link, j, doing) == _OK
                except SharedReduceError:
                    self._tell_left(j)
                    raise
            for link in self._links:
                with contextlib.suppress(OSError):  # one that left is named at the next wait
                    link.sendall(_OK if verdict else _FAILED)
        else:
            link = self._links[0]
            with contextlib.suppress(OSError):  # rank 0 stopped: what it said is still there
                link.sendall(_OK if ok else _FAILED)
            # rank 0 answers within ``timeout`` of its own arrival, naming a rank that stalled;
            # this rank may have come up to ``timeout`` before it: rank 0 is silent past both
            link.settimeout(2 * self.timeout + VERDICT_MARGIN_S)
            got = self._receive(link, 0, doing)
            if got == _LEFT:
                said = _receive_some(link, 4) or b""
                culprit = int.from_bytes(said, "little") if len(said) == 4 else -1
                who = self._who(culprit) if 0 < culprit < self.size else "a rank"
                raise self._error(
                    f"{who} left or stalled while {doing} ({self._who(0)} waited for it); an "
                    "all-reduce cannot finish without every rank, so this rank stops."
                )
            verdict = got == _OK
        if not verdict:
            raise self._error(
                f"the mean is not finite while {doing}: some rank sent NaN or Inf, or the sum "
                "overflowed"
            )

    def _tell_left(self, culprit: int) -> None:
        """Rank 0: tell every other rank whom the all-reduce lost, so none waits for it."""
        for j, link in enumerate(self._links, start=1):
            if j != culprit:
                with contextlib.suppress(OSError):  # it left too
                    link.sendall(_LEFT + culprit.to_bytes(4, "little"))

    def _receive(self, link: socket.socket, rank: int, doing: str) -> bytes:
        """One byte from ``rank``; SharedReduceError naming it if it left or stalled."""
        waited = link.gettimeout() or self.timeout
        got = _receive_some(link, 1)
        if got:
            return got
        raise self._lost(rank, doing, got, waited)

    def _lost(
        self, rank: int, doing: str, got: bytes | None, waited: float | None = None
    ) -> SharedReduceError:
        """The error for nothing from ``rank``: it closed (``got`` empty) or stalled (None)
        in the ``waited`` seconds (default: the timeout)."""
        who = self._who(rank)
        what = (
            f"{who} left (its process died or closed)"
            if got == b""
            else f"nothing from {who} within {waited or self.timeout:.3g}s: it stalled"
        )
        return self._error(
            f"{what} while {doing}. An all-reduce cannot finish without every rank, so this "
            "rank stops."
        )

    # ----------------------------------------------------------------- setting up
    def _open(self, x: Vector) -> np.ndarray | torch.Tensor:
        """Make (rank 0) or receive the region, in host memory or on ``x``'s GPU, and map it."""
        shape = self._lay_out(isinstance(x, torch.Tensor))
        if isinstance(x, torch.Tensor):
            region = self._serve_gpu(x.device) if self.rank == 0 else self._attend_gpu()
            self._view = region.view(shape)
            return self._view
        fd = self._serve_host() if self.rank == 0 else self._attend_host()
        try:
            self._map = mmap.mmap(fd, self._bytes)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, np.float32).reshape(shape)
        return self._view

    def _serve_host(self) -> int:
        """Rank 0: make the region in host memory and hand its descriptor to every rank."""
        fd = os.memfd_create("gossipdl-allreduce", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._bytes)
            header = _HEADER.pack(self.size, self.numel, self.piece, self._bytes, 0)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            for link in self._accept():
                link.sendmsg([header], rights)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _serve_gpu(self, device: torch.device) -> torch.Tensor:
        """Rank 0: make the region on ``device`` and hand its CUDA IPC fields to every rank."""
        from gossipdl.coordinator.cuda_ipc import share

        region = torch.empty(self._bytes // 4, dtype=torch.float32, device=device)
        _IN_PROCESS[self.name] = region  # for ranks on threads of this process
        try:
            header = _HEADER.pack(self.size, self.numel, self.piece, self._bytes, 1)
            for link in self._accept():  # one share per process: each counts one user
                blob = b"" if _peer_pid(link) == os.getpid() else share(region)
                link.sendall(header + _BLOB.pack(len(blob)) + blob)
        except BaseException:
            del _IN_PROCESS[self.name]
            raise
        return region

    def _accept(self) -> list[socket.socket]:
        """Rank 0: a link to every other rank, by rank, as each connects (kept for barriers)."""
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
                    missing = [self._who(j) for j in range(1, self.size) if j not in links]
                    raise self._error(
                        f"{', '.join(missing)} did not come within {self.timeout:g}s"
                    ) from None
                rank = self._admit(link, links)
                if rank is not None:
                    links[rank] = link
        except BaseException:
            for link in links.values():
                link.close()
            raise
        finally:
            listener.close()
        self._links = [links[j] for j in range(1, self.size)]
        return self._links

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

    def _attend_host(self) -> int:
        """A rank but 0: the host region's descriptor from rank 0, checked against ours."""
        fds = self._attend(0)
        if len(fds) != 1 or os.fstat(fds[0]).st_size != self._bytes:
            for fd in fds:
                os.close(fd)
            raise self._error(f"{self._who(0)} sent no region of {self._bytes} bytes")
        return fds[0]

    def _attend_gpu(self) -> torch.Tensor:
        """A rank but 0: the GPU region from rank 0 (its tensor when rank 0 is a thread of
        this process, which CUDA cannot hand its own memory; else by CUDA IPC)."""
        from gossipdl.coordinator.cuda_ipc import CudaIpcError, open_shared

        for fd in self._attend(1):
            os.close(fd)
        link = self._links[0]
        length = _BLOB.unpack(self._receive_exactly(link, _BLOB.size))[0]
        in_process = _peer_pid(link) == os.getpid() and self.name in _IN_PROCESS
        if length == 0 and in_process:
            return _IN_PROCESS[self.name]
        if not 0 < length <= MAX_GPU_REGION_BLOB:
            raise self._error(
                f"{self._who(0)} described its GPU region in {length} bytes (1 to "
                f"{MAX_GPU_REGION_BLOB} from another process)"
            )
        blob = self._receive_exactly(link, length)
        try:
            return open_shared(blob, self._bytes // 4)
        except (CudaIpcError, RuntimeError) as exc:
            raise self._error(f"cannot open {self._who(0)}'s GPU region: {exc}") from None

    def _receive_exactly(self, link: socket.socket, n: int) -> bytes:
        """``n`` bytes from rank 0 while setting up; SharedReduceError if it left or stalled."""
        got = b""
        while len(got) < n:
            more = _receive_some(link, n - len(got))
            if not more:
                raise self._lost(0, "setting up", more)
            got += more
        return got

    def _attend(self, kind: int) -> list[int]:
        """A rank but 0: connect to rank 0 (again until it listens), say who we are, and
        receive rank 0's settings (with a host region's descriptor), which must be ours;
        ``kind`` is 1 for a GPU region, 0 for host memory."""
        deadline = time.monotonic() + self.timeout
        while True:
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                link.connect(self.name)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                link.close()
                if time.monotonic() >= deadline:
                    raise self._error(
                        f"{self._who(0)} did not listen within {self.timeout:g}s"
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
        mine = (self.size, self.numel, self.piece, self._bytes, kind)
        theirs = _HEADER.unpack(header) if len(header) == _HEADER.size else None
        if theirs != mine:
            for fd in fds:
                os.close(fd)
            raise self._error(
                f"{self._who(0)} sent settings {theirs} (ranks, values, piece, bytes, on a GPU), "
                f"not this rank's {mine}"
            )
        return fds
