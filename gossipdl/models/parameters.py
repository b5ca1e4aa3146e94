"""A model's parameters as one flat vector, and back."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from gossipdl.compression._kernels import empty_on


@torch.no_grad()
def set_params(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``params``, in order (they never become views of it, unlike with
    ``vector_to_parameters``: ``flat`` may be published, and training must not write it)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def parameter_bytes(params: Iterable[torch.Tensor]) -> int:
    """The bytes ``params`` hold: one model's worth on the wire, dense."""
    return sum(p.numel() * p.element_size() for p in params)


def averaged_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` that peers average, in order; a ValueError naming the
    first one they cannot. Peers average a model as one float32 vector, which every real
    dtype goes into and comes back from (float16, bfloat16, float64, and the integer or
    bool parameters that are never trained but still averaged); a complex one cannot, and
    would otherwise fail deep inside the first copy with a TypeError naming nothing.

    >>> len(averaged_parameters(torch.nn.Linear(2, 1)))
    2
    """
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters to average")
    for name, p in named:
        if p.is_complex():
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')}: peers average "
                "a model as one real vector, which cannot hold complex values; keep its real "
                "and imaginary parts as a real parameter (torch.view_as_real) and rebuild it "
                "in forward (torch.view_as_complex)"
            )
    return [p for _, p in named]


class FlatParameters:
    """A model's parameters as views into one persistent float32 vector, as DDP's buckets
    hold gradients: a round reads the model as a vector without gathering it and writes
    the result back in one contiguous copy.

    Built once, before training (it rebinds each parameter's ``.data``; the optimizer
    holds the same ``Parameter`` objects, so its state is untouched). Parameters that
    cannot share one vector (several devices, another dtype, memory shared between two
    of them) keep their own, and so do parameters something later moved (``model.to``):
    the vector is then gathered each time, as before.

    >>> model = torch.nn.Linear(2, 1)
    >>> flat = FlatParameters(list(model.parameters()))
    >>> live = flat.live()
    >>> live.numel(), model.weight.data_ptr() == live.data_ptr()
    (3, True)
    >>> flat.load_(torch.zeros(3)); model.bias.tolist()
    [0.0]
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.device = self.params[0].device
        self._vector: torch.Tensor | None = None
        self._pointers: list[int] = []
        if any(p.device != self.device or p.dtype != torch.float32 for p in self.params):
            return
        vector = _consecutive(self.params)  # flattened before (a second Peer on one model)
        if vector is None:
            if len({p.untyped_storage().data_ptr() for p in self.params}) < len(self.params):
                return  # parameters sharing memory: one vector would part them
            vector = torch.empty(self.numel, device=self.device)
            offset = 0
            with torch.no_grad():
                for p in self.params:
                    view = vector[offset : offset + p.numel()].view(p.shape)
                    view.copy_(p)
                    p.data = view
                    offset += p.numel()
        self._vector = vector
        self._pointers = [p.data_ptr() for p in self.params]

    def live(self) -> torch.Tensor | None:
        """The vector the parameters are views of (writing it writes the model), or None
        when they are not (any more)."""
        vector = self._vector
        if vector is None or any(
            p.data_ptr() != at for p, at in zip(self.params, self._pointers, strict=True)
        ):
            return None
        return vector

    def round_input(self, sends_memory_of: Callable[[torch.Tensor], bool]) -> torch.Tensor:
        """The model a synchronous round starts from: the live vector itself, which nothing
        writes while the round runs, unless the round sends its memory as it is
        (``sends_memory_of(live)``: dense gossip's payload), which the next step would
        write before it left; then a copy. Both engines ask this, so the simulator runs
        the rounds on the vectors the real peers do."""
        live = self.live()
        if live is None or sends_memory_of(live):
            return self.copy()
        return live

    @torch.no_grad()
    def copy(self) -> torch.Tensor:
        """A copy of the parameters as one vector, in recycled memory on a CPU (a fresh
        43 MB vector every step pays its page faults)."""
        out = empty_on(self.device, self.numel)
        vector = self.live()
        if vector is not None:
            return out.copy_(vector)
        return torch.cat([p.reshape(-1) for p in self.params], out=out)

    @torch.no_grad()
    def load_(self, new: torch.Tensor) -> None:
        """Write vector ``new`` into the parameters (one copy into the live vector)."""
        vector = self.live()
        if vector is None:
            set_params(self.params, new)
        elif new.data_ptr() != vector.data_ptr():
            vector.copy_(new)


def _consecutive(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The vector ``params`` already are, in order, contiguous views of one after another
    in one storage (a model some :class:`FlatParameters` flattened before), or None."""
    first = params[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    end = start
    for p in params:
        same = p.untyped_storage().data_ptr() == storage.data_ptr()
        if not same or p.storage_offset() != end or not p.is_contiguous():
            return None
        end += p.numel()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, start, (end - start,), (1,)
    )
