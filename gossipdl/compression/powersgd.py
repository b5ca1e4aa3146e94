"""``powersgd:RANK``: rank-r approximation by one warm-started power iteration (PowerSGD)."""

from __future__ import annotations

import math

import numpy as np
import torch

from gossipdl.compression._kernels import Rng, from_host, to_host
from gossipdl.compression.base import (
    Codec,
    CodecError,
    Payload,
    check_arrays,
    check_meta,
    check_numel,
    check_vector,
)

__all__ = ["PowerSGD", "as_matrix", "matrix_shape", "reconstruct"]


def matrix_shape(numel: int) -> tuple[int, int]:
    """The near-square ``rows × cols`` layout of a flat vector of ``numel`` (zero-padded)."""
    if numel == 0:
        return 0, 0
    rows = math.isqrt(numel - 1) + 1  # ceil(sqrt(numel))
    return rows, -(-numel // rows)


def reconstruct(p: torch.Tensor, q: torch.Tensor, numel: int) -> torch.Tensor:
    """``Σ_j P̂[:, j] Q[:, j]ᵀ`` (rows × cols) flattened and cropped to ``numel``, in a fixed
    order of elementwise operations, so every machine computes the same bits."""
    rows, cols = p.shape[0], q.shape[0]
    out = torch.empty(rows * cols, dtype=torch.float32, device=p.device)
    if numel == 0:
        return out
    matrix = out.view(rows, cols)
    if p.shape[1] == 0:
        return out.zero_()[:numel]
    torch.mul(p[:, 0:1], q[:, 0].view(1, cols), out=matrix)
    for j in range(1, p.shape[1]):
        matrix.add_(p[:, j : j + 1] * q[:, j].view(1, cols))
    return out[:numel]


def as_matrix(v: torch.Tensor) -> torch.Tensor:
    """``v`` laid out row-major as the near-square ``matrix_shape`` matrix (zero padded)."""
    numel = v.numel()
    rows, cols = matrix_shape(numel)
    if rows * cols == numel:
        return v.view(rows, cols)
    m = torch.zeros(rows * cols, dtype=v.dtype, device=v.device)
    m[:numel] = v
    return m.view(rows, cols)


class PowerSGD(Codec):
    """``powersgd:RANK``: send ``P`` (rows×r) and ``Q`` (cols×r) with ``M ≈ P Qᵀ``.

    Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization", Algorithm 1, for one matrix:
    the flat vector is laid out row-major as a near-square matrix ``M``
    (``rows = ceil(√n)``, zero padding at the end) and

    1. ``P ← M Q``            (Q warm-started from the previous call),
    2. ``P̂ ← ORTHOGONALIZE(P)`` (reduced QR),
    3. ``Q ← Mᵀ P̂``,
    4. the receiver's value ``P̂ Qᵀ``, flattened and cropped to ``n``.

    **The warm start lives on the sender**: this instance keeps ``Q`` between
    calls (one per vector length and device) and reuses it as the starting
    point of the next power iteration, which is what makes one iteration per
    step enough (Section 3 of the paper). Use one codec instance per stream of
    messages (per peer and parameter vector); the receiver needs no state,
    because both ``P̂`` and ``Q`` are sent. ``Q`` starts as a seeded standard
    normal matrix; a column that becomes zero (e.g. after a zero input) is
    redrawn so the iteration cannot get stuck at zero.

    Biased; meant to run under error feedback (``powersgd:2+ef``), as in the
    paper. ``RANK`` is capped at ``min(rows, cols)``. Payload: float32
    ``P̂`` ``[rows·r]`` and ``Q`` ``[cols·r]``, row-major, empty meta;
    ``4r(rows + cols) + 1`` bytes.

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
        self._warm: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _rank_for(self, numel: int) -> int:
        rows, cols = matrix_shape(numel)
        return min(self.rank, rows, cols)

    def _start(self, numel: int, device: torch.device) -> torch.Tensor:
        """The warm-start ``Q`` for this length and device (drawn on first use)."""
        q = self._warm.get((numel, device))
        if q is None:
            cols = matrix_shape(numel)[1]
            q = torch.randn(
                cols, self._rank_for(numel), generator=self._rng.torch(device), device=device
            )
        return q

    def encode(self, x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        v = check_vector(x)
        numel = v.numel()
        if numel == 0:
            empty_arrays = (np.zeros(0, np.float32), np.zeros(0, np.float32))
            return Payload(empty_arrays, {}), torch.zeros(0, device=v.device)
        m = as_matrix(v)
        q = self._start(numel, v.device)
        # 1. P ← M Q
        p = m @ q
        # 2. P̂ ← ORTHOGONALIZE(P)
        p = torch.linalg.qr(p, mode="reduced").Q.contiguous()
        # 3. Q ← Mᵀ P̂
        q = (m.T @ p).contiguous()
        # 4. the receiver's value P̂ Qᵀ.
        estimate = reconstruct(p, q, numel)
        payload = Payload((to_host(p).reshape(-1).copy(), to_host(q).reshape(-1).copy()), {})
        self._keep_warm(numel, v.device, q)
        return payload, estimate

    def _keep_warm(self, numel: int, device: torch.device, q: torch.Tensor) -> None:
        """Store ``Q`` for the next call, redrawing columns that are zero or not finite."""
        q = q.clone()
        dead = ~torch.isfinite(q).all(dim=0) | (q.abs().sum(dim=0) == 0)
        if bool(dead.any()):
            fresh = torch.randn(q.shape, generator=self._rng.torch(device), device=device)
            q[:, dead] = fresh[:, dead]
        self._warm[(numel, device)] = q

    def decode(
        self, payload: Payload, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        numel = check_numel(numel)
        rows, cols = matrix_shape(numel)
        rank = self._rank_for(numel)
        p, q = check_arrays(payload, self.spec, ["float32", "float32"], [rows * rank, cols * rank])
        check_meta(payload.meta, self.spec, {})
        device = torch.device(device)
        p_t = from_host(p, device).view(rows, rank)
        q_t = from_host(q, device).view(cols, rank)
        return reconstruct(p_t, q_t, numel)
