"""A GPU tensor handed to another process on this host as plain bytes (CUDA IPC): the
shared-memory all-reduce's region when the vectors live on a GPU.

torch shares CUDA memory between processes by pickling; this sends the same fields
(torch's IPC handle, its reference counter's name, the allocation's size) as bytes with
lengths, and rebuilds the tensor from them, so nothing is unpickled. The GPU is named by
its UUID rather than its index, which differs between processes that see different
``CUDA_VISIBLE_DEVICES``. Only ranks of one user on one host exchange these (the
all-reduce checks ``SO_PEERCRED``); nothing from the network reaches them.
"""

from __future__ import annotations

import struct

import torch

__all__ = ["CudaIpcError", "open_shared", "share"]

_INTS = struct.Struct("<4q")  # bytes in the allocation, offset into it, counter offset, sync
_LENGTH = struct.Struct("<i")  # before each byte field; -1 for None
MAX_IPC_FIELD = 4096  # bytes in one field (torch's handles are 64 bytes, names ~40)


class CudaIpcError(RuntimeError):
    """A shared GPU region that cannot be opened here; the message says why."""


def share(t: torch.Tensor) -> bytes:
    """What another process of this host needs to open ``t``'s memory (a GPU tensor that
    starts its storage): its GPU's UUID and torch's IPC fields, as bytes. ``t`` must stay
    alive while others use it."""
    if not t.is_cuda or t.storage_offset() != 0:
        raise ValueError("share takes a GPU tensor at the start of its storage")
    (device, handle, size, offset, counter, counter_offset, event, sync) = (
        t.untyped_storage()._share_cuda_()
    )
    uuid = str(torch.cuda.get_device_properties(device).uuid).encode()
    fields = b"".join(_field(f) for f in (uuid, handle, counter, event))
    return _INTS.pack(size, offset, counter_offset, int(bool(sync))) + fields


def open_shared(blob: bytes, numel: int) -> torch.Tensor:
    """The float32 tensor of ``numel`` values that :func:`share` described in ``blob``,
    on the GPU where it lives; CudaIpcError if that GPU is not visible here or the blob
    is malformed or too small."""
    if len(blob) < _INTS.size:
        raise CudaIpcError(f"a shared GPU region's description is {len(blob)} bytes, too short")
    size, offset, counter_offset, sync = _INTS.unpack_from(blob)
    at, fields = _INTS.size, []
    for _ in range(4):
        field, at = _read_field(blob, at)
        fields.append(field)
    uuid, handle, counter, event = fields
    if at != len(blob) or uuid is None or handle is None or counter is None:
        raise CudaIpcError("a shared GPU region's description is malformed")
    if size < 4 * numel:
        raise CudaIpcError(f"the shared GPU region holds {size} bytes, not {4 * numel}")
    index = _device_with(uuid.decode(errors="replace"))
    storage = torch.UntypedStorage._new_shared_cuda(
        index, handle, size, offset, counter, counter_offset, event, bool(sync)
    )
    out = torch.empty(0, dtype=torch.float32, device=f"cuda:{index}")
    return out.set_(storage, 0, (numel,), (1,))


def _device_with(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise CudaIpcError(
        f"the shared region is on GPU {uuid}, which this process does not see "
        "(CUDA_VISIBLE_DEVICES?): give every rank the same GPUs, or pass shared=False"
    )


def _field(value: bytes | None) -> bytes:
    if value is None:
        return _LENGTH.pack(-1)
    return _LENGTH.pack(len(value)) + value


def _read_field(blob: bytes, at: int) -> tuple[bytes | None, int]:
    if at + _LENGTH.size > len(blob):
        raise CudaIpcError("a shared GPU region's description is cut short")
    (length,) = _LENGTH.unpack_from(blob, at)
    at += _LENGTH.size
    if length == -1:
        return None, at
    if not 0 <= length <= MAX_IPC_FIELD or at + length > len(blob):
        raise CudaIpcError(f"a shared GPU region's description has a field of {length} bytes")
    return blob[at : at + length], at + length
