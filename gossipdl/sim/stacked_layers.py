"""The built-in models' forward pass over stacked parameters, as batched matrix products.

``vmap`` runs any model over ``[peers, ...]`` parameters, but on a CPU its convolutions
become one grouped convolution whose backward is slow (the 1-D CNN at 1,000 peers: 0.67
ms per peer-step, against 0.52 here). Here a linear layer is one ``baddbmm`` and a 1-D
convolution is an im2col ``baddbmm`` with a hand-written backward that folds the column
gradients back with one strided add per kernel tap. :func:`stacked_forward` gives this
path for :class:`~gossipdl.models.mlp.MLP` (logistic regression included) and
:class:`~gossipdl.models.cnn.CNN1d`, None for any other model (which keeps ``vmap``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gossipdl.models.cnn import CNN1d
from gossipdl.models.mlp import MLP

Forward = Callable[[dict[str, Tensor], Tensor], Tensor]
"""``(params, x) → logits``: each ``[peers, *shape]`` parameter and ``x`` ``[peers, B, ...]``
give ``[peers, B, classes]``."""


def _taps(length: int, out_len: int, k: int, stride: int, pad: int) -> list[tuple[int, int, int]]:
    """For each kernel tap ``j``: the outputs ``[lo, hi)`` whose input ``stride·t + j − pad``
    is inside the signal, and the first such input (the rest read the zero padding)."""
    taps = []
    for j in range(k):
        lo = max(0, -((j - pad) // stride))  # ceil((pad − j) / stride), at least 0
        hi = min(out_len, (length - 1 + pad - j) // stride + 1)
        taps.append((lo, max(lo, hi), stride * lo + j - pad))
    return taps


def _inputs(signal: Tensor, lo: int, hi: int, first: int, stride: int) -> Tensor:
    """The view of ``signal`` (``[peers, B, L, C]``) that outputs ``[lo, hi)`` of one tap
    read: every ``stride``-th position from ``first``."""
    return signal.narrow(2, first, stride * (hi - lo - 1) + 1)[:, :, ::stride]


class _ConvReLU(torch.autograd.Function):
    """``relu(conv1d(x, w, b))`` of every peer at once, channels last: ``x`` is
    ``[peers, B, L, C]``, ``w`` ``[peers, C_out, C, k]`` (torch's layout), the result
    ``[peers, B, L_out, C_out]``. The columns are filled tap by tap from ``x`` itself and
    the input's gradient is folded back the same way, so neither pads a copy of the signal
    (on a CPU the copies cost nearly as much as the products: 4–6% off a 256-peer step)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor, stride: int, pad: int) -> Tensor:
        n, batch, length, c = x.shape
        c_out, k = w.shape[1], w.shape[3]
        out_len = (length + 2 * pad - k) // stride + 1
        taps = _taps(length, out_len, k, stride, pad)
        cols = x.new_empty(n, batch, out_len, k, c)  # [peers, B, L_out, k, C]: each output's taps
        for j, (lo, hi, first) in enumerate(taps):
            tap = cols.select(3, j)
            if lo:
                tap.narrow(2, 0, lo).zero_()
            if hi < out_len:
                tap.narrow(2, hi, out_len - hi).zero_()
            if hi > lo:
                tap.narrow(2, lo, hi - lo).copy_(_inputs(x, lo, hi, first, stride))
        cols = cols.view(n, batch * out_len, k * c)
        weights = w.permute(0, 3, 2, 1).reshape(n, k * c, c_out)
        out = torch.baddbmm(b.unsqueeze(1), cols, weights).clamp_min_(0)
        ctx.save_for_backward(cols, weights, out)
        ctx.shape = (length, c, k, out_len, stride, taps)
        return out.view(n, batch, out_len, c_out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor, Tensor, None, None]:
        cols, weights, out = ctx.saved_tensors
        length, c, k, out_len, stride, taps = ctx.shape
        n, batch = grad.shape[:2]
        # through the ReLU (aten's own kernel: masked_fill or where run 10x slower here)
        g = torch.ops.aten.threshold_backward(grad.reshape(out.shape), out, 0.0)
        grad_w = torch.bmm(cols.transpose(1, 2), g).view(n, k, c, -1).permute(0, 3, 2, 1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            columns = torch.bmm(g, weights.transpose(1, 2)).view(n, batch, out_len, k, c)
            grad_x = grad.new_zeros(n, batch, length, c)
            for j, (lo, hi, first) in enumerate(taps):  # col2im: output t's tap j came from
                if hi > lo:  # input stride·t + j − pad
                    _inputs(grad_x, lo, hi, first, stride).add_(
                        columns.select(3, j).narrow(2, lo, hi - lo)
                    )
        return grad_x, grad_w, g.sum(1), None, None


def _linear(params: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _mlp(model: MLP) -> Forward:
    layers = [(f"net.{i}", type(m)) for i, m in enumerate(model.net)]

    def forward(params: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x.flatten(2)
        for name, kind in layers:
            if kind is nn.Linear:
                h = _linear(params, name, h)
            elif kind is nn.ReLU:
                h = torch.relu(h)
        return h

    return forward


def _cnn1d(model: CNN1d) -> Forward | None:
    convs = [(f"features.{i}", m) for i, m in enumerate(model.features) if isinstance(m, nn.Conv1d)]
    layout = [type(m) for m in model.features] == [nn.Conv1d, nn.ReLU] * len(convs)
    plain = all(
        m.dilation == (1,) and m.groups == 1 and m.padding_mode == "zeros" and m.bias is not None
        and isinstance(m.padding, tuple)
        for _, m in convs
    )  # fmt: skip
    if not (layout and plain):
        return None
    shapes = [(name, m.stride[0], int(m.padding[0])) for name, m in convs]
    channels, length = model.sample_shape

    def forward(params: dict[str, Tensor], x: Tensor) -> Tensor:
        n, batch = x.shape[:2]
        h = x.reshape(n, batch, channels, length).transpose(2, 3)
        for name, stride, pad in shapes:
            weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
            h = _ConvReLU.apply(h, weight, bias, stride, pad)
        return _linear(params, "head", h.transpose(2, 3).reshape(n, batch, -1))

    return forward


def stacked_forward(model: nn.Module) -> Forward | None:
    """``model``'s forward over stacked parameters, or None where only ``vmap`` runs it
    (any model but the built-in MLP and 1-D CNN, exactly those types)."""
    if type(model) is MLP:
        return _mlp(model)
    if type(model) is CNN1d:
        return _cnn1d(model)
    return None
