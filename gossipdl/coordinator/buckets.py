"""Gradients averaged over the ring in buckets while backward still runs (DDP's scheme).

Backward produces the last layers' gradients first. The gradients, laid out in that
order, are cut into buckets of equal size; a hook on each parameter copies its gradient
in as soon as it is accumulated, and a bucket whose every gradient is in goes to the
all-reduce thread while backward computes the rest. Buckets are reduced in one fixed
order on every rank (the ring's operations must match), each as one all-reduce of the
ring's length (the last one padded with zeros). ``wait`` fills in what no hook delivered
(a parameter without a gradient counts as zero, as the one-shot average does), waits for
every bucket and writes the means back into the gradients. On a GPU the buckets are
reduced on a CUDA stream of their own, each after an event that marks its gradients
copied: on backward's stream, the copy to the host would wait for all of backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gossipdl.coordinator.ring import AnyRing

BUCKET_NUMEL = 25 * 2**20 // 4  # 25 MiB of float32 a bucket, DDP's default


def bucket_bounds(numel: int, most: int) -> list[tuple[int, int]]:
    """``numel`` values cut into the fewest buckets of at most ``most`` values, all of one
    size but a shorter last one (the ring's length is the first's).

    >>> bucket_bounds(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    >>> bucket_bounds(10_700_000, 6_553_600)
    [(0, 5350000), (5350000, 10700000)]
    >>> bucket_bounds(0, 4)  # a model of empty parameters (it divided by zero)
    []
    """
    if numel == 0:  # a model of empty parameters: nothing to all-reduce
        return []
    count = -(-numel // most)
    size = -(-numel // count)
    return [(a, min(a + size, numel)) for a in range(0, numel, size)]


class OverlappedGradients:
    """Averages the gradients of ``params`` over a ring during backward: ``ring()`` returns
    the all-reduce of :attr:`size` values the buckets go through (asked for at the first
    bucket). One backward pass per :meth:`wait` (a second one before it would send
    half-accumulated gradients)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        ring: Callable[[], AnyRing],
        bucket_numel: int = BUCKET_NUMEL,
    ) -> None:
        self.params = list(params)
        order = list(reversed(range(len(self.params))))  # backward's order
        self._offset: dict[int, int] = {}
        self._numel = [p.numel() for p in self.params]  # the sizes the offsets were laid out for
        at = 0
        for i in order:
            self._offset[i] = at
            at += self._numel[i]
        self.flat = torch.zeros(at, device=self.params[0].device)
        self.bounds = bucket_bounds(at, bucket_numel)
        self.size = self.bounds[0][1] if self.bounds else 0
        self._ring = ring
        self._padded = torch.zeros(self.size, device=self.flat.device)  # a short last bucket
        self._buckets_of = {
            i: [
                b
                for b, (lo, hi) in enumerate(self.bounds)
                if lo < self._offset[i] + p.numel() and self._offset[i] < hi
            ]
            for i, p in enumerate(self.params)
        }
        self._lock = threading.Lock()  # hooks run on autograd's threads
        self._reduces = ThreadPoolExecutor(1, "allreduce")
        on_gpu = self.flat.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.flat.device) if on_gpu else None
        self._reset()
        self._hooks = [  # a frozen parameter's zeros are filled in by wait()
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]

    def _reset(self) -> None:
        self._missing = [0] * len(self.bounds)  # gradients each bucket still waits for
        for buckets in self._buckets_of.values():
            for b in buckets:
                self._missing[b] += 1
        self._in: set[int] = set()  # parameters whose gradient was copied in
        self._sent = 0  # buckets handed to the all-reduce thread, in order
        self._futures: list[Future[torch.cuda.Event | None]] = []

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def accumulated(p: torch.Tensor) -> None:
            with self._lock:
                if i in self._in:
                    raise RuntimeError(
                        "the gradient all-reduce overlapped with backward takes one backward "
                        "pass per step; accumulate over several without overlap"
                    )
                self._take(i, p.grad)
                self._send_ready()

        return accumulated

    def _take(self, i: int, grad: torch.Tensor | None) -> None:
        """Copy parameter ``i``'s gradient (None: zeros) into its place (holding the lock)."""
        at, n = self._offset[i], self._numel[i]
        if self.params[i].numel() != n:  # its values would overlap its neighbour's
            raise RuntimeError(
                f"parameter {i} changed size ({n} values, now {self.params[i].numel()}): the "
                "gradient all-reduce overlapped with backward lays out the sizes it started with"
            )
        place = self.flat[at : at + n]
        if grad is None:
            place.zero_()
        else:
            place.copy_(grad.detach().reshape(-1))
        self._in.add(i)
        for b in self._buckets_of[i]:
            self._missing[b] -= 1

    def _send_ready(self) -> None:
        """Hand the buckets that are complete, in order, to the all-reduce thread."""
        while self._sent < len(self.bounds) and self._missing[self._sent] == 0:
            copied = None
            if self._stream is not None:  # the copies queued so far, on this thread's stream
                copied = torch.cuda.Event()  # (of the buckets' device: not the current one)
                copied.record(torch.cuda.current_stream(self.flat.device))
            self._futures.append(self._reduces.submit(self._reduce, self._sent, copied))
            self._sent += 1

    def _reduce(self, b: int, copied: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """All-reduce bucket ``b`` (on a GPU: on the buckets' stream, once ``copied``); on
        a GPU, the event that marks it done."""
        lo, hi = self.bounds[b]
        values, ring = self.flat[lo:hi], self._ring()
        with torch.cuda.stream(self._stream):
            if copied is not None and self._stream is not None:
                self._stream.wait_event(copied)
            if hi - lo == self.size:
                ring.allreduce_mean_(values)
            else:
                self._padded[: hi - lo].copy_(values)
                ring.allreduce_mean_(self._padded)
                values.copy_(self._padded[: hi - lo])
            if copied is None:
                return None
            done = torch.cuda.Event()
            done.record(self._stream)
            return done

    @torch.no_grad()
    def wait(self) -> None:
        """Send what backward did not deliver, wait for every bucket's mean and write the
        means into the gradients (creating zero ones where there were none)."""
        with self._lock:
            for i, p in enumerate(self.params):
                if i not in self._in:
                    self._take(i, p.grad)
            self._send_ready()
            futures = self._futures
            self._reset()
        try:
            for future in futures:
                done = future.result()
                if done is not None:  # the gradients are written on this thread's stream
                    torch.cuda.current_stream(self.flat.device).wait_event(done)
        except BaseException:  # the ring failed: the buckets queued behind would each wait
            for future in futures:  # out its timeout again, in close() too
                future.cancel()
            raise
        for i, p in enumerate(self.params):
            if not p.requires_grad:  # frozen: no gradient (weight decay would move it)
                continue
            at, n = self._offset[i], p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(self.flat[at : at + n].view_as(p))

    def close(self) -> None:
        """Remove the hooks and stop the all-reduce thread."""
        for hook in self._hooks:
            hook.remove()
        self._reduces.shutdown(wait=True, cancel_futures=True)
