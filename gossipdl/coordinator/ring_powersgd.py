"""PowerSGD over a ring all-reduce: two small all-reduces instead of one of the whole vector.

Vogels, Karimireddy, Jaggi 2019, Algorithm 1, as every rank runs it, layer by
layer: each parameter of two or more dimensions is a matrix M (its first
dimension by the rest), compressed to rank r; vectors (biases, norms) are
averaged exactly. With error feedback e (what earlier rounds did not carry):

1. M = g + e,  P = M Q                 (Q warm-started: the previous round's)
2. P ← mean over ranks of P (the vectors ride along);  P̂ = ORTHOGONALIZE(P)
3. Q ← mean over ranks of Mᵀ P̂
4. g ← P̂ Qᵀ,  e ← M − P̂ Q_iᵀ        (Q_i = Mᵀ P̂ before the mean: this rank's own part)

P̂ and Q are the same on every rank (their means are, and so is the QR of
the same matrix), so every rank ends with the same estimate; Q starts from
the same seed everywhere. Both all-reduces go through one ring whose length
is the longer of the two messages (the other is padded with zeros).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from gossipdl.compression.powersgd import reconstruct
from gossipdl.coordinator.ring import RingAllReduce


class LowRankAllReduce:
    """Rank-``rank`` PowerSGD mean, over the ring ``make_ring`` builds, of a flat vector made
    of tensors of ``shapes`` (in order). ``make_ring(length)`` returns the ring for P and Q."""

    def __init__(
        self,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        rank: int,
        make_ring: Callable[[int], RingAllReduce],
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layers: list[tuple[int, int, int, int]] = []  # offset, rows, cols, rank
        self.vectors: list[tuple[int, int]] = []  # offset, length
        offset = 0
        for shape in shapes:
            size = math.prod(shape)
            if len(shape) >= 2 and min(shape[0], size // shape[0]) > 1:
                rows, cols = shape[0], size // shape[0]
                self.layers.append((offset, rows, cols, min(rank, rows, cols)))
            else:
                self.vectors.append((offset, size))
            offset += size
        self.numel = offset
        self.p_length = sum(rows * r for _, rows, _, r in self.layers)
        self.dense_length = sum(length for _, length in self.vectors)
        self.q_length = sum(cols * r for _, _, cols, r in self.layers)
        self.ring = make_ring(max(self.p_length + self.dense_length, self.q_length, 1))
        generator = torch.Generator().manual_seed(seed)
        self.qs = [
            torch.randn(cols, r, generator=generator).to(device) for _, _, cols, r in self.layers
        ]
        self.error = torch.zeros(self.numel, device=device)

    @torch.no_grad()
    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by the PowerSGD estimate of its mean over the ring."""
        if x.numel() != self.numel:
            raise ValueError(f"this ring reduces {self.numel} values, got {x.numel()}")
        flat = x.reshape(-1).to(torch.float32) + self.error
        ms = [flat[o : o + rows * cols].view(rows, cols) for o, rows, cols, _ in self.layers]
        first = self._mean(
            [m @ q for m, q in zip(ms, self.qs, strict=True)]
            + [flat[o : o + n] for o, n in self.vectors]
        )
        ps = [torch.linalg.qr(p, mode="reduced").Q.contiguous() for p in first[: len(ms)]]
        mine = [(m.T @ p).contiguous() for m, p in zip(ms, ps, strict=True)]
        self.qs = [q.contiguous() for q in self._mean(mine)]
        estimate, sent = flat.clone(), flat.clone()  # vectors: the exact mean; sent as they are
        for (o, n), mean in zip(self.vectors, first[len(ms) :], strict=True):
            estimate[o : o + n] = mean.reshape(-1)
        for (o, rows, cols, _), p, q, q_mine in zip(self.layers, ps, self.qs, mine, strict=True):
            estimate[o : o + rows * cols] = reconstruct(p, q, rows * cols)
            sent[o : o + rows * cols] = reconstruct(p, q_mine, rows * cols)
        self.error = flat - sent  # what this rank's own message did not carry (Algorithm 2)
        x.copy_(estimate.view_as(x))
        return x

    def _mean(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean over the ring of each tensor in ``parts``, packed into one padded buffer."""
        buffer = torch.zeros(self.ring.numel, device=self.error.device)
        offset = 0
        for part in parts:
            buffer[offset : offset + part.numel()] = part.reshape(-1)
            offset += part.numel()
        self.ring.allreduce_mean_(buffer)
        out, offset = [], 0
        for part in parts:
            out.append(buffer[offset : offset + part.numel()].view_as(part))
            offset += part.numel()
        return out
