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

:class:`LowRankMean` is the state and the steps between the two means, with no
I/O; :class:`LowRankRing` runs it over a :class:`~gossipdl.protocol.ring.RingCore`
as one more state machine with the ring's events (the simulator's driver), and
:class:`~gossipdl.coordinator.ring_powersgd.LowRankAllReduce` over the threaded ring.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gossipdl.compression.powersgd import LowRankLayout, reconstruct, split
from gossipdl.protocol.ring import RingCore, RingProgress
from gossipdl.transport.wire import Message


class LowRankMean:
    """Rank-``rank`` PowerSGD mean of a flat vector made of tensors of ``shapes`` (in
    order): :meth:`first` gives what the first all-reduce averages, :meth:`second` turns
    its mean into what the second averages, :meth:`finish` its mean into the estimate."""

    def __init__(
        self,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        rank: int,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        layout = LowRankLayout.of(shapes, rank)
        self.layout = layout
        self.layers, self.vectors, self.numel = layout.layers, layout.vectors, layout.numel
        self.p_length = layout.p_length
        self.dense_length = layout.dense_length
        self.q_length = layout.q_length
        self.length = max(self.p_length + self.dense_length, self.q_length, 1)  # the ring's
        generator = torch.Generator().manual_seed(seed)
        self.qs = [
            torch.randn(cols, r, generator=generator).to(device) for _, _, cols, r in self.layers
        ]
        self.error = torch.zeros(self.numel, device=device)
        self._flat = self.error  # M = g + e of the all-reduce under way, flat
        self._ms: list[torch.Tensor] = []  # its matrices
        self._ps: list[torch.Tensor] = []  # P̂
        self._mine: list[torch.Tensor] = []  # Q_i = Mᵀ P̂, this rank's own
        self._first = self.error  # the first mean: the vectors' exact mean after the P's

    @torch.no_grad()
    def first(self, x: torch.Tensor) -> torch.Tensor:
        """Steps 1–2: what the first all-reduce averages (P = M Q, then the vectors)."""
        if x.numel() != self.numel:
            raise ValueError(f"this ring reduces {self.numel} values, got {x.numel()}")
        flat = x.reshape(-1).to(torch.float32) + self.error
        self._flat = flat
        self._ms = self.layout.matrices(flat)
        # P = M Q as (Qᵀ Mᵀ)ᵀ: the shape MKL streams M through (see power_step)
        products = [(q.T.contiguous() @ m.T).T for m, q in zip(self._ms, self.qs, strict=True)]
        return self._pack(products + self.layout.dense_parts(flat))

    @torch.no_grad()
    def second(self, mean: torch.Tensor) -> torch.Tensor:
        """Steps 2–3: from the first mean, P̂ = ORTHOGONALIZE(P); what the second all-reduce
        averages (Mᵀ P̂)."""
        ps = split(mean, [(rows, r) for _, rows, _, r in self.layers])
        self._ps = [torch.linalg.qr(p, mode="reduced").Q.contiguous() for p in ps]
        self._mine = [  # Mᵀ P̂ as (P̂ᵀ M)ᵀ, as power_step
            (p.T.contiguous() @ m).T.contiguous() for m, p in zip(self._ms, self._ps, strict=True)
        ]
        self._first = mean
        return self._pack(self._mine)

    @torch.no_grad()
    def finish(self, mean: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Step 4: ``x`` becomes the estimate of the mean; the error keeps what this rank's
        own message did not carry (Algorithm 2)."""
        self.qs = [q.contiguous() for q in split(mean, [q.shape for q in self._mine])]
        flat = self._flat
        estimate, sent = flat.clone(), flat.clone()  # vectors: the exact mean; sent as they are
        offset = self.p_length
        for o, n in self.vectors:
            estimate[o : o + n] = self._first[offset : offset + n]
            offset += n
        for (o, rows, cols, _), p, q, q_mine in zip(
            self.layers, self._ps, self.qs, self._mine, strict=True
        ):
            reconstruct(p, q, estimate[o : o + rows * cols])
            reconstruct(p, q_mine, sent[o : o + rows * cols])
        self.error = flat - sent
        x.copy_(estimate.view_as(x))
        return x

    def _pack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``parts`` one after the other in a zero-padded buffer of the ring's length."""
        buffer = torch.zeros(self.length, device=self.error.device)
        offset = 0
        for part in parts:
            buffer[offset : offset + part.numel()] = part.reshape(-1)
            offset += part.numel()
        return buffer


class LowRankRing:
    """:class:`LowRankMean` over ``ring`` (of its ``length``), with the ring's events:
    :meth:`start` an all-reduce of a float32 vector, :meth:`receive` a chunk, :meth:`left`,
    :meth:`poll`; the vector is replaced by the estimate of its mean once done."""

    def __init__(self, mean: LowRankMean, ring: RingCore) -> None:
        if ring.numel != mean.length:
            raise ValueError(f"a ring of {ring.numel} values, the factors need {mean.length}")
        self.mean = mean
        self.ring = ring
        self.predecessor = ring.predecessor
        self._x: np.ndarray | None = None
        self._buffer: np.ndarray | None = None  # the pass under way
        self._pass = 0  # 1: P (and the vectors), 2: Q

    def start(self, now: float, x: np.ndarray) -> None:
        """Begin: the estimate of the mean of ``x`` replaces it once done."""
        self._x, self._pass = x, 1
        self._run(now, self.mean.first(torch.from_numpy(x)))

    def _run(self, now: float, buffer: torch.Tensor) -> None:
        self._buffer = buffer.detach().to("cpu", torch.float32).contiguous().numpy()
        self.ring.start(now, self._buffer)

    @property
    def busy(self) -> bool:
        return self.ring.busy

    @property
    def deadline(self) -> float | None:
        return self.ring.deadline

    def receive(self, now: float, msg: Message) -> None:
        self.ring.receive(now, msg)

    def left(self, peer: int, why: str = "") -> None:
        self.ring.left(peer, why)

    def poll(self, now: float) -> RingProgress:
        """The ring's next piece of work; between the passes, the factors' next step."""
        progress = self.ring.poll(now)
        if progress.result is None:
            return progress
        assert self._x is not None and self._buffer is not None
        done = torch.from_numpy(self._buffer)
        progress.result = None
        if self._pass == 1:
            self._pass = 2
            self._run(now, self.mean.second(done))
        else:
            self.mean.finish(done, torch.from_numpy(self._x))
            progress.result, self._x, self._buffer = self._x, None, None
        return progress
