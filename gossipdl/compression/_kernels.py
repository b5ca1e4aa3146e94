"""Shared kernels: dense bit packing, sparse scatter, host transfers, random generators.

Every kernel has a torch version (any device) and, where it measured faster on
CPU, a numpy version used for CPU tensors. Both produce the same bytes and the
same float32 values bit for bit (elementwise IEEE operations only), which the
tests check by forcing the torch versions on CPU with :func:`torch_kernels`.

Measured on the 2-core CPU these were chosen on (10M float32, one thread):
``np.packbits(np.signbit(x))`` 2.6 ms vs ``x < 0`` in torch 7-10 ms;
``(x > t) | (x < -t)`` + ``np.flatnonzero`` 8 ms vs torch ``nonzero`` 60 ms;
``np.zeros`` + fancy assignment of 100k values 3.6 ms vs ``torch.zeros`` +
``index_put_`` 24 ms (torch page-faults every fresh 40 MB buffer);
a 256-row lookup table ``np.take`` for 1-bit decode 3.6 ms vs ``index_select`` 24 ms.

Fresh 40 MB outputs are written by whichever library allocated them: torch
writing with two threads into a numpy (huge-page) buffer page-faulted at
~48 ms per 40 MB, against ~9 ms for ``h.float()`` or ``np.copy``.

Where a numpy version still needs several passes, a C version
(``_native.c``, built by ``setup.py`` when a compiler is there) fuses them:
the sign codec's bits and L1 norm in one read, its ±scale values in one
write (3.5x faster than numpy for 10M values here). Without it the numpy versions
run; :func:`numpy_kernels` switches it off for tests. Large outputs of these
kernels come from :func:`host_empty`, which recycles their memory.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType

import numpy as np
import torch

_native: ModuleType | None
try:
    import gossipdl.compression._native as _native
except ImportError:  # built without a C compiler: the numpy kernels run
    _native = None

__all__ = [
    "Rng",
    "empty_on",
    "from_host",
    "host_empty",
    "host_tensor",
    "native_kernels",
    "numpy_kernels",
    "pack_bits",
    "scatter",
    "to_host",
    "torch_kernels",
    "unpack_bits",
    "use_numpy",
]

_BACKEND = "auto"  # on CPU: "auto" C where built, else numpy; "numpy"; "torch"


def use_numpy(t: torch.Tensor | torch.device) -> bool:
    """True when a host kernel (numpy, or C) should run: a CPU tensor, torch kernels not forced."""
    device = t.device if isinstance(t, torch.Tensor) else t
    return device.type == "cpu" and _BACKEND != "torch"


def native_kernels(t: torch.Tensor | torch.device) -> ModuleType | None:
    """The C kernels for a CPU tensor when they were built and are not switched off, else None."""
    return _native if _BACKEND == "auto" and use_numpy(t) else None


@contextmanager
def _backend(name: str) -> Iterator[None]:
    global _BACKEND
    saved, _BACKEND = _BACKEND, name
    try:
        yield
    finally:
        _BACKEND = saved


def torch_kernels() -> AbstractContextManager[None]:
    """Run the torch kernels on CPU too (tests compare them with the host ones)."""
    return _backend("torch")


def numpy_kernels() -> AbstractContextManager[None]:
    """Run the numpy kernels where C ones exist (what a build without a compiler runs)."""
    return _backend("numpy")


# --- recycled host buffers -----------------------------------------------------------------------


RECYCLED_MAX_BYTES = 1 << 30
"""The most memory the recycler keeps idle for later outputs (1 GiB: eight blocks of a
33M-parameter model, two of a 130M one)."""


class _Recycler:
    """Large uninitialised byte arrays whose memory comes back when the last view is gone.

    glibc maps every block over 32 MB fresh and the kernel zeroes each page on
    first touch: ~2 ms per 40 MB here, more than the sign kernels' whole pass.
    Smaller blocks are recycled by malloc already. The memory is an anonymous
    ``mmap``; the array handed out is its only numpy view (every view of that
    array keeps it alive, as does a tensor made from it), so when the array
    dies nothing else can see the memory and it is kept for the next call of
    the same size. At most ``keep`` blocks (a round has about that many alive) and
    ``max_bytes`` wait, the oldest dropped first: the memory held idle between rounds is
    bounded whatever the model's size.
    """

    def __init__(
        self, min_bytes: int = 16 << 20, keep: int = 8, max_bytes: int = RECYCLED_MAX_BYTES
    ) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._free: deque[mmap.mmap] = deque(maxlen=keep)
        self._lock = threading.RLock()  # a finalizer may run on any thread, even inside empty()

    def empty(self, nbytes: int) -> np.ndarray:
        if nbytes < self.min_bytes:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            block = next((b for b in reversed(self._free) if len(b) == nbytes), None)  # warmest
            if block is not None:
                self._free.remove(block)
        if block is None:
            block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # a fork gets its own copy
            if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MB pages: 512x fewer faults the first time
                block.madvise(mmap.MADV_HUGEPAGE)
        array = np.frombuffer(block, np.uint8)
        weakref.finalize(array, self._give_back, block).atexit = False
        return array

    def _give_back(self, block: mmap.mmap) -> None:
        with self._lock:
            self._free.append(block)
            while sum(map(len, self._free)) > self.max_bytes:
                self._free.popleft()


_recycler = _Recycler()


def host_empty(count: int, dtype: type[np.generic] = np.float32) -> np.ndarray:
    """An uninitialised host array of ``count`` ``dtype`` values for a kernel's output; large
    ones reuse the memory of earlier outputs that are gone. Hand it on whole (e.g. through
    ``torch.from_numpy``): views of it keep it alive."""
    return _recycler.empty(count * np.dtype(dtype).itemsize).view(dtype)


def host_tensor(count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``count`` ``dtype`` values in recycled memory, as
    :func:`host_empty` (a fresh 40 MB tensor costs its page faults: a copy into one took
    10.7 ms here, into recycled memory 1.6 ms)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if count == 0:  # an empty byte tensor has no stride to view as another type
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(_recycler.empty(count * itemsize)).view(dtype)


def empty_on(device: torch.device, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D tensor on ``device``: :func:`host_tensor` on a CPU."""
    if device.type == "cpu":
        return host_tensor(count, dtype)
    return torch.empty(count, dtype=dtype, device=device)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array of ``t`` (zero-copy for a contiguous CPU tensor); from a
    GPU, the pinned copy :func:`stage_on_host` makes."""
    if t.device.type != "cuda":
        return np.ascontiguousarray(t.detach().cpu().numpy())
    return stage_on_host(t).numpy()


def stage_on_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of GPU tensor ``t`` in pinned memory (torch's caching host allocator:
    recycled, and the copy runs at full bus speed), waited for by an event: the payload's
    copy to the host is the one sync a send needs, and no debug-mode warning hides
    another. Copying it back with ``non_blocking=True`` is safe: the allocator keeps the
    block until that copy is done."""
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t.detach(), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))
    copied.synchronize()
    return staged


def from_host(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor of ``a`` on ``device``; read-only arrays (wire buffers) are copied first. To
    a GPU it goes through pinned memory, queued without waiting (the allocator keeps the
    staging block until the copy is done)."""
    if device.type == "cuda" and a.dtype.type in _TORCH_DTYPES:
        staged = torch.empty(a.shape, dtype=_TORCH_DTYPES[a.dtype.type], pin_memory=True)
        staged.numpy()[...] = a
        return staged.to(device, non_blocking=True)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(device)


def beside(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` (a few numbers, often on the host) on ``x``'s device in ``x``'s dtype; up to a
    GPU through pinned memory without a wait (:func:`from_host`), where ``.to(x)`` from
    pageable memory makes the host wait for the GPU's queue."""
    if t.device.type == "cpu" and x.device.type == "cuda":
        return from_host(t.detach().to(x.dtype).numpy(), x.device)
    return t.to(x)


_TORCH_DTYPES: dict[type, torch.dtype] = {
    np.float32: torch.float32, np.float16: torch.float16, np.float64: torch.float64,
    np.int8: torch.int8, np.uint8: torch.uint8, np.int16: torch.int16, np.uint16: torch.uint16,
    np.int32: torch.int32, np.int64: torch.int64,
}  # fmt: skip


# --- bit packing: values of BITS bits, LSB first, one continuous little-endian bit stream -----


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take when packed densely."""
    return (count * bits + 7) // 8


def pack_bits(q: torch.Tensor, bits: int) -> np.ndarray:
    """Pack unsigned values ``q`` (uint8, each < 2**bits, 1 <= bits <= 8) densely; to host.

    Value ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the stream, least
    significant first (``np.packbits(bitorder="little")`` for ``bits == 1``).
    """
    count = q.numel()
    nbytes = packed_size(count, bits)
    if bits == 8:
        return to_host(q).copy()
    groups = -(-count // 8)
    if use_numpy(q):
        values = q.numpy()
        if bits == 1:
            return np.packbits(values, bitorder="little")
        padded = np.zeros(groups * 8, np.uint8)
        padded[:count] = values
        cols = padded.reshape(groups, 8)
        acc = cols[:, 0].astype("<u8")
        for j in range(1, 8):
            acc |= cols[:, j].astype("<u8") << np.uint64(bits * j)
        return acc.view(np.uint8).reshape(groups, 8)[:, :bits].reshape(-1)[:nbytes].copy()
    padded_t = torch.zeros(groups * 8, dtype=torch.uint8, device=q.device)
    padded_t[:count] = q
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * bits
    acc_t = (padded_t.view(groups, 8).to(torch.int64) << shifts).sum(dim=1)
    packed = acc_t.view(torch.uint8).view(groups, 8)[:, :bits].reshape(-1)[:nbytes]
    return to_host(packed).copy()


def unpack_bits(buf: np.ndarray, bits: int, count: int, device: torch.device) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` uint8 values on ``device``.

    ``buf`` must already be checked to hold ``packed_size(count, bits)`` bytes.
    """
    groups = -(-count // 8)
    if bits == 8:
        return from_host(buf, device)
    if use_numpy(device):
        if bits == 1:
            return torch.from_numpy(np.unpackbits(buf, count=count, bitorder="little"))
        stream = np.zeros(groups * bits, np.uint8)
        stream[: buf.size] = buf
        cols = np.zeros((groups, 8), np.uint8)
        cols[:, :bits] = stream.reshape(groups, bits)
        acc = cols.view("<u8").reshape(groups)
        out = np.empty((groups, 8), np.uint8)
        mask = np.uint64((1 << bits) - 1)
        for j in range(8):
            out[:, j] = (acc >> np.uint64(bits * j)) & mask
        return torch.from_numpy(out.reshape(-1)[:count])
    stream_t = torch.zeros(groups * bits, dtype=torch.uint8, device=device)
    stream_t[: buf.size] = from_host(buf, device)
    cols_t = torch.zeros(groups, 8, dtype=torch.uint8, device=device)
    cols_t[:, :bits] = stream_t.view(groups, bits)
    acc_t = cols_t.view(torch.int64).view(groups, 1)
    shifts = torch.arange(8, device=device, dtype=torch.int64) * bits
    values = (acc_t >> shifts) & ((1 << bits) - 1)
    return values.to(torch.uint8).reshape(-1)[:count]


# --- sparse scatter ------------------------------------------------------------------------------


def scatter(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """A zero tensor of ``numel`` on ``values``' device with ``values`` at ``indices``.

    ``indices`` (int64, on ``values``' device) must already be checked:
    strictly increasing and inside ``[0, numel)``. The C kernel writes each 64-byte piece
    of the output once (2.4 ms for 10M floats here, against 6-8 ms to zero it and then
    index into it), and checks the indices again.
    """
    native = native_kernels(values)
    if native is not None and values.dtype == torch.float32:
        out = host_tensor(numel)
        native.densify(indices.contiguous().numpy(), values.contiguous().numpy(), out.numpy())
        return out
    dense = empty_on(values.device, numel).zero_()
    dense[indices] = values
    return dense


# --- randomness ----------------------------------------------------------------------------------


class Rng:
    """A codec's random source: one numpy generator plus torch generators per device.

    Seeded from the codec's seed and a per-stage ``salt`` so two stages built
    from one seed draw independent streams.
    """

    def __init__(self, seed: int, salt: int) -> None:
        self._sequence = np.random.SeedSequence([seed & (2**64 - 1), salt])
        self.numpy = np.random.default_rng(self._sequence)
        self._torch: dict[torch.device, torch.Generator] = {}

    def torch(self, device: torch.device) -> torch.Generator:
        """The generator for ``device``, created on first use."""
        gen = self._torch.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(self._sequence.generate_state(1, np.uint64)[0] >> np.uint64(1)))
            self._torch[device] = gen
        return gen

    def message_seed(self) -> int:
        """A fresh 63-bit seed to put in a message."""
        return int(self.numpy.integers(0, 2**63 - 1))
