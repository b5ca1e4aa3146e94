"""Which device a peer trains on."""

from __future__ import annotations

import torch


def pick_device(spec: str, local_index: int = 0) -> torch.device:
    """``auto``: ``cuda:(local_index mod GPU count)`` when CUDA is available, else the CPU.
    ``cuda`` without an index is that GPU too (every CUDA device it returns has an index:
    ``torch.cuda.set_device`` needs one)."""
    if spec != "auto":
        device = torch.device(spec)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} requested but CUDA is not available here")
        if device.type != "cuda" or device.index is not None:
            return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device("cpu")
