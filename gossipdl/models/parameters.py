"""A model's parameters as one flat vector, and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def set_params(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``params``, in order (they never become views of it, unlike with
    ``vector_to_parameters``: ``flat`` may be published, and training must not write it)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
