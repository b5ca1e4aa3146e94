"""``powersgd:RANK``: rank-r approximation by one warm-started power iteration (PowerSGD)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossipdl.compression._kernels import (
    Rng,
    empty_on,
    from_host,
    native_kernels,
    to_host,
    use_numpy,
)
from gossipdl.compression.base import (
    MAX_DECODED,
    Codec,
    CodecError,
    Payload,
    check_arrays,
    check_meta,
    check_numel,
    check_vector,
)

__all__ = [
    "LowRankLayout",
    "PowerSGD",
    "matrix_shape",
    "power_step",
    "reconstruct",
    "row_split",
    "split",
]

RECONSTRUCT_BLOCK_BYTES = 256 << 10
"""With numpy (a CPU without the C kernels) :func:`reconstruct` builds this many bytes of
rows at a time, so each rank's products stay in cache until they are summed: for 10M
values at rank 2 on one thread a write of the output plus two passes in cache, 6-11 ms,
where whole-matrix passes took 41 ms (64 KiB to 1 MiB blocks were within 1.3x of 256 KiB)."""


def matrix_shape(numel: int) -> tuple[int, int]:
    """The near-square ``rows × cols`` layout of a flat vector of ``numel`` (zero-padded)."""
    if numel == 0:
        return 0, 0
    rows = math.isqrt(numel - 1) + 1  # ceil(sqrt(numel))
    return rows, -(-numel // rows)


def reconstruct(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``Σ_j P̂[:, j] Q[:, j]ᵀ`` (rows × cols) written row-major into ``out`` (a contiguous
    vector of rows·cols) and returned: each value is ``((p₀q₀ + p₁q₁) + p₂q₂) + …``, every
    product and sum rounded on its own (no fused multiply-add), so every machine and
    kernel computes the same bits. On a CPU the C kernel builds each value in a register
    and writes ``out`` once, past the cache when it is large (10M values at rank 2 on one
    thread: 2.3-3.1 ms, numpy's blocks 10-11 ms); without it numpy runs a block of rows at
    a time."""
    rows, cols, rank = p.shape[0], q.shape[0], p.shape[1]
    qt = q.T.contiguous()  # Qᵀ: the rank rows every row of the output reads in order
    native = native_kernels(out)
    if native is not None:
        native.low_rank_product(p.contiguous().numpy(), qt.numpy(), out.numpy(), rows, cols)
        return out
    if out.numel() == 0 or rank == 0:
        return out.zero_()
    on_host = use_numpy(out)
    step = max(1, RECONSTRUCT_BLOCK_BYTES // (4 * cols)) if on_host else rows
    scratch = out.new_empty(min(step, rows) if rank > 1 else 0, cols)  # one p_j q_j block
    tensors = (p, qt, out.view(rows, cols), scratch)
    operands: Sequence[Any] = [t.numpy() for t in tensors] if on_host else tensors
    ps, qts, matrix, products = operands
    xp: Any = np if on_host else torch
    for start in range(0, rows, step):
        block = matrix[start : start + step]
        xp.multiply(ps[start : start + step, 0:1], qts[0], out=block)
        for j in range(1, rank):
            product = products[: len(block)]
            xp.multiply(ps[start : start + step, j : j + 1], qts[j], out=product)
            xp.add(block, product, out=block)
    return out


def row_split(flat: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``rows × cols`` matrix whose row-major values are ``flat`` then zeros, in two
    parts: the rows ``flat`` fills (a view) and the rest (a zero-padded copy of what is left,
    None when nothing is), so a near-square layout costs no copy of the whole vector."""
    full = flat.numel() // cols
    head = flat[: full * cols].view(full, cols)
    if full == rows:
        return head, None
    tail = flat.new_zeros(rows - full, cols)
    tail.view(-1)[: flat.numel() - full * cols] = flat[full * cols :]
    return head, tail


@dataclass(frozen=True)
class LowRankLayout:
    """Which parts of a flat vector are matrices, compressed to a low rank, and which are
    vectors, sent as they are: the per-layer split of PowerSGD (Vogels et al. 2019).

    Each tensor of two or more dimensions whose first dimension and the rest both exceed
    one is a matrix (first dimension × the rest, ``rank`` capped at the smaller); every
    other tensor (biases, norms, a 1×n weight) is a vector.

    Example:
        >>> layout = LowRankLayout.of([(512, 40), (512,), (10, 512)], rank=2)
        >>> layout.layers, layout.vectors, layout.p_length, layout.q_length
        (((0, 512, 40, 2), (20992, 10, 512, 2)), ((20480, 512),), 1044, 1104)
    """

    layers: tuple[tuple[int, int, int, int], ...]  # offset, rows, cols, rank
    vectors: tuple[tuple[int, int], ...]  # offset, length
    numel: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], rank: int) -> LowRankLayout:
        """The layout of a flat vector made of tensors of ``shapes``, in order."""
        layers, vectors, offset = [], [], 0
        for shape in shapes:
            size = math.prod(shape)
            if size and len(shape) >= 2 and min(shape[0], size // shape[0]) > 1:
                rows, cols = shape[0], size // shape[0]
                layers.append((offset, rows, cols, min(rank, rows, cols)))
            elif size:
                vectors.append((offset, size))
            offset += size
        return cls(tuple(layers), tuple(vectors), offset)

    @property
    def p_length(self) -> int:
        """Values in all the P factors (rows × rank per matrix)."""
        return sum(rows * r for _, rows, _, r in self.layers)

    @property
    def q_length(self) -> int:
        """Values in all the Q factors (cols × rank per matrix)."""
        return sum(cols * r for _, _, cols, r in self.layers)

    @property
    def dense_length(self) -> int:
        """Values sent as they are."""
        return sum(length for _, length in self.vectors)

    def matrices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The matrices, as views into ``flat``."""
        return [flat[o : o + rows * cols].view(rows, cols) for o, rows, cols, _ in self.layers]

    def dense_parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The vectors, as views into ``flat``."""
        return [flat[o : o + n] for o, n in self.vectors]


def split(buffer: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Consecutive views of ``buffer`` with ``shapes`` (the inverse of a concatenation)."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buffer[offset : offset + n].view(*shape))
        offset += n
    return out


def power_step(
    head: torch.Tensor, tail: torch.Tensor | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–3 of PowerSGD on the matrix ``M = [head; tail]`` (as :func:`row_split` gives
    it) from the warm start ``q``: ``P̂`` and the new ``Q``. The products run as
    ``Pᵀ = Qᵀ Mᵀ`` and ``Qᵀ = P̂ᵀ M`` with ``Qᵀ`` and ``P̂ᵀ`` contiguous, the shape MKL
    streams ``M`` through at memory speed: 2-4 ms each for 10M values at rank 2 on one
    thread, against 4-16 ms for ``M Q``, ``Mᵀ P̂`` or a strided ``Qᵀ``."""
    qt = q.T.contiguous()
    pt = qt @ head.T  # 1. P ← M Q
    if tail is not None:
        pt = torch.cat([pt, qt @ tail.T], dim=1)
    p = torch.linalg.qr(pt.T, mode="reduced").Q  # 2. P̂ ← ORTHOGONALIZE(P), column-major
    qt = p[: len(head)].T @ head  # 3. Q ← Mᵀ P̂
    if tail is not None:
        qt += p[len(head) :].T @ tail
    return p.contiguous(), qt.T.contiguous()


def _concat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros(0)


class PowerSGD(Codec):
    """``powersgd:RANK``: per layer, send ``P̂`` (rows×r) and ``Q`` (cols×r) with ``M ≈ P̂ Qᵀ``.

    Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization", Algorithm 1, layer by layer: once
    :meth:`bind_layout` has named the tensors the flat vector is made of (the
    peers do, with their model's parameter shapes), each matrix ``M`` of
    :class:`LowRankLayout` is compressed on its own and the vectors (biases)
    are sent as they are, as in the paper. A vector of another length (or with
    no layout bound) is one near-square matrix (``rows = ceil(√n)``, zero
    padding at the end). For each matrix:

    1. ``P ← M Q``            (Q warm-started from the previous call),
    2. ``P̂ ← ORTHOGONALIZE(P)`` (reduced QR),
    3. ``Q ← Mᵀ P̂``,
    4. the receiver's value ``P̂ Qᵀ``.

    **The warm start lives on the sender**: this instance keeps each ``Q``
    between calls (per vector length and device) and reuses it as the starting
    point of the next power iteration, which is what makes one iteration per
    step enough (Section 3 of the paper). Use one codec instance per stream of
    messages (per peer and parameter vector); the receiver needs no state
    beyond the layout, because both ``P̂`` and ``Q`` are sent. ``Q`` starts as
    a seeded standard normal matrix; a column that becomes zero (e.g. after a
    zero input) is redrawn so the iteration cannot get stuck at zero.

    Biased. Payload: float32 ``P̂`` of every matrix then the vectors, and float32
    ``Q`` of every matrix, row-major, empty meta; ``4(r·Σ(rows + cols) + vectors) + 1``
    bytes.

    The reconstruction ``Σ_j P̂[:, j] Q[:, j]ᵀ`` is computed with elementwise
    multiplies and adds in a fixed order rather than a matrix product, so it
    does not depend on the BLAS kernel or thread count: sender and receiver
    agree bit for bit (on CPU and GPU alike).
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise CodecError(f"powersgd:RANK needs an integer RANK >= 1, got {rank!r}")
        self.rank = rank
        self.spec = f"powersgd:{rank}"
        self._rng = Rng(seed, salt=6)
        self._bound: LowRankLayout | None = None
        self._warm: dict[tuple[int, torch.device], list[torch.Tensor]] = {}

    def bind_layout(self, shapes: Sequence[Sequence[int]]) -> None:
        self._bound = LowRankLayout.of(shapes, self.rank)

    def contraction(self, numel: int) -> float:
        """Half the smallest ``r / min(rows, cols)`` over the matrices: the best rank-r
        approximation keeps at least that share of a matrix's energy, and the weakest layer
        sets what the whole model can bear, but one warm-started power step a round keeps
        less of a residual that changes every round. CHOCO's consensus alone
        (``benchmarks/stability.py``) puts the step ``auto_gamma`` gives the whole share at
        0.88–0.99 γ*, half of it at about 0.5 γ* (top-k's is about 0.6); a quarter gave
        0.18–0.20 γ*, and CHOCO PowerSGD mixed too little to train (README *Accuracy
        against bytes*)."""
        layout = self._layout(numel)
        shares = [r / min(rows, cols) for _, rows, cols, r in layout.layers]
        return min(1.0, min(shares, default=1.0) / 2)

    def _layout(self, numel: int) -> LowRankLayout:
        """The bound layout, or one near-square matrix for a vector of another length."""
        if self._bound is not None and self._bound.numel == numel:
            return self._bound
        return (
            LowRankLayout.of([matrix_shape(numel)], self.rank)
            if numel
            else LowRankLayout((), (), 0)
        )

    def _start(self, layout: LowRankLayout, device: torch.device) -> list[torch.Tensor]:
        """The warm-start ``Q`` of every matrix for this layout and device (drawn on first use)."""
        qs = self._warm.get((layout.numel, device))
        if qs is None:
            generator = self._rng.torch(device)
            qs = [
                torch.randn(cols, r, generator=generator, device=device)
                for _, _, cols, r in layout.layers
            ]
        return qs

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        numel = v.numel()
        layout = self._layout(numel)
        ps, qs = [], []
        for (o, rows, cols, _), q in zip(layout.layers, self._start(layout, v.device), strict=True):
            p, q = power_step(*row_split(v[o : o + rows * cols], rows, cols), q)
            ps.append(p)
            qs.append(q)
        vectors = layout.dense_parts(v)
        estimate = self._estimate(layout, ps, qs, vectors, v.device, numel)
        first = _concat([p.reshape(-1) for p in ps] + vectors, v)
        second = _concat([q.reshape(-1) for q in qs], v)
        payload = Payload((to_host(first).copy(), to_host(second).copy()), {})
        self._keep_warm(layout, v.device, qs)
        return payload, estimate

    @staticmethod
    def _estimate(
        layout: LowRankLayout,
        ps: list[torch.Tensor],
        qs: list[torch.Tensor],
        vectors: list[torch.Tensor],
        device: torch.device,
        numel: int,
    ) -> torch.Tensor:
        """4. the receiver's value: ``P̂ Qᵀ`` per matrix, the vectors as sent."""
        out = empty_on(device, layout.numel)
        for (o, rows, cols, _), p, q in zip(layout.layers, ps, qs, strict=True):
            reconstruct(p, q, out[o : o + rows * cols])
        for (o, n), part in zip(layout.vectors, vectors, strict=True):
            out[o : o + n] = part
        return out[:numel]

    def _keep_warm(
        self, layout: LowRankLayout, device: torch.device, qs: list[torch.Tensor]
    ) -> None:
        """Store each ``Q`` for the next call, redrawing columns that are zero or not finite."""
        kept = []
        for q in qs:
            q = q.clone()
            dead = ~torch.isfinite(q).all(dim=0) | (q.abs().sum(dim=0) == 0)
            if bool(dead.any()):
                fresh = torch.randn(q.shape, generator=self._rng.torch(device), device=device)
                q[:, dead] = fresh[:, dead]
            kept.append(q)
        self._warm[(layout.numel, device)] = kept

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        layout = self._layout(numel)
        first, second = check_arrays(
            payload,
            self.spec,
            ["float32", "float32"],
            [layout.p_length + layout.dense_length, layout.q_length],
        )
        check_meta(payload.meta, self.spec, {})
        largest = float(np.abs(first[: layout.p_length]).max(initial=0.0)) * float(
            np.abs(second).max(initial=0.0)
        )
        if largest * max((r for *_, r in layout.layers), default=1) > MAX_DECODED:
            raise CodecError(f"{self.spec}: factors so large that P Qᵀ overflows float32")
        device = torch.device(device)
        head = from_host(first, device)
        ps = split(head, [(rows, r) for _, rows, _, r in layout.layers])
        qs = split(from_host(second, device), [(cols, r) for _, _, cols, r in layout.layers])
        vectors = split(head[layout.p_length :], [(n,) for _, n in layout.vectors])
        return self._estimate(layout, ps, qs, vectors, device, numel)
