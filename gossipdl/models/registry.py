"""Build a model from its name: the built-ins or a user's ``module.path:function``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from gossipdl.models.benchmark_models import VGG11, LeafCNN, LeafLSTM, LeNet5, ResNet20
from gossipdl.models.cnn import CNN1d, CNN2d
from gossipdl.models.mlp import MLP
from gossipdl.models.parameters import averaged_parameters
from gossipdl.plugins import call_plugin, load_callable

logger = logging.getLogger(__name__)


class ModelError(ValueError):
    """A model name, shape or width list is invalid, or a custom model misbehaves."""


Builder = Callable[[tuple[int, ...], int, list[int] | None], nn.Module]


def _logistic(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None) -> MLP:
    if hidden:
        raise ModelError(
            f"model 'logistic' has no hidden layers, got hidden={hidden}; "
            f"use 'mlp' for hidden layers"
        )
    return MLP(input_shape, num_classes, hidden=[])


def _mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None) -> MLP:
    return MLP(input_shape, num_classes, [256, 256] if hidden is None else hidden)


def _cnn1d(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None) -> CNN1d:
    if len(input_shape) not in (1, 2):
        raise ModelError(f"model 'cnn1d' needs input_shape (L,) or (C, L), got {input_shape}")
    if hidden == []:
        raise ModelError("model 'cnn1d' needs at least one conv layer; hidden=[] given")
    return CNN1d(input_shape, num_classes, [32, 32, 32] if hidden is None else hidden)


def _cnn2d(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None) -> CNN2d:
    if len(input_shape) not in (2, 3):
        raise ModelError(f"model 'cnn2d' needs input_shape (H, W) or (C, H, W), got {input_shape}")
    if hidden == []:
        raise ModelError("model 'cnn2d' needs at least one conv layer; hidden=[] given")
    return CNN2d(input_shape, num_classes, [32, 64] if hidden is None else hidden)


def _fixed(
    name: str,
    model: Callable[[tuple[int, ...], int], nn.Module],
    fits: Callable[[tuple[int, ...]], bool],
    needs: str,
) -> Builder:
    """A builder for one of the papers' models: their widths, for inputs that ``fit``."""

    def build(
        input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None
    ) -> nn.Module:
        if hidden:
            raise ModelError(f"model {name!r} has its paper's widths; leave hidden empty")
        if not fits(input_shape):
            raise ModelError(f"model {name!r} needs input_shape {needs}, got {input_shape}")
        return model(input_shape, num_classes)

    return build


def _rgb32(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and shape[1] >= 32 and shape[2] >= 32


def _image(shape: tuple[int, ...]) -> bool:
    return len(shape) in (2, 3) and min(shape[-2:]) >= 12


_BUILTIN: dict[str, Builder] = {
    "logistic": _logistic,
    "mlp": _mlp,
    "cnn1d": _cnn1d,
    "cnn2d": _cnn2d,
    "resnet20": _fixed("resnet20", ResNet20, _rgb32, "(C, H, W), H and W >= 32 (CIFAR)"),
    "vgg11": _fixed("vgg11", VGG11, _rgb32, "(C, H, W), H and W >= 32 (CIFAR)"),
    "lenet5": _fixed("lenet5", LeNet5, _image, "(H, W) or (C, H, W), at least 12x12"),
    "leaf-cnn": _fixed("leaf-cnn", LeafCNN, _image, "(H, W) or (C, H, W), at least 12x12"),
    "leaf-lstm": _fixed(
        "leaf-lstm", LeafLSTM, lambda shape: len(shape) == 1, "(L,): character indices"
    ),
}


def available_models() -> list[str]:
    """Names of the built-in models; ``"module.path:function"`` builds any other.

    Example:
        >>> " ".join(available_models())
        'cnn1d cnn2d leaf-cnn leaf-lstm lenet5 logistic mlp resnet20 vgg11'
    """
    return sorted(_BUILTIN)


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] | None = None,
) -> nn.Module:
    """A new classifier mapping ``(B, *input_shape)`` float32 to ``(B, num_classes)`` logits.

    Built-ins (``hidden`` overrides the default widths):

    - ``logistic``: flatten + linear; ``hidden`` must be empty or None.
    - ``mlp``: flatten + ``Linear → ReLU`` per width in ``hidden`` (default ``[256, 256]``).
    - ``cnn1d``: for ``(L,)`` or ``(C, L)`` inputs; ``hidden`` are conv channel counts
      (default ``[32, 32, 32]``, ~8k parameters on MNIST-1D).
    - ``cnn2d``: for ``(H, W)`` or ``(C, H, W)`` inputs; ``hidden`` are conv channel
      counts (default ``[32, 64]``).
    - ``resnet20``, ``vgg11`` (CIFAR, GroupNorm), ``lenet5``, ``leaf-cnn`` (FEMNIST) and
      ``leaf-lstm`` (Shakespeare): the papers' models with their widths
      (:mod:`gossipdl.models.benchmark_models`).

    ``"module.path:function"`` calls ``function(input_shape=..., num_classes=...,
    hidden=...)``, which must return an ``nn.Module``; its output shape is checked
    on a dummy batch.

    The models have no BatchNorm or other running-statistics buffers: peers
    average parameters only, so every piece of model state must be a
    parameter. Custom models with such buffers get a warning.

    Initialisation draws from torch's global RNG: call ``torch.manual_seed``
    with the same seed on every peer to start them from the same model.

    Raises:
        ModelError: unknown name, unusable shape or widths, or a custom builder
            that cannot be imported or returns something that is not a classifier.

    Example:
        >>> import torch
        >>> model = build_model("mlp", (40,), 10, hidden=[64])
        >>> model(torch.zeros(3, 40)).shape
        torch.Size([3, 10])
    """
    shape = _check_shape(name, input_shape)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"model {name!r}: num_classes must be an int >= 1, got {num_classes!r}")
    widths = None if hidden is None else _check_hidden(name, hidden)
    if name in _BUILTIN:
        return _BUILTIN[name](shape, num_classes, widths)
    if ":" in name:
        return _build_custom(name, shape, num_classes, widths)
    raise ModelError(
        f"unknown model {name!r}; expected one of {available_models()} or 'module.path:function'"
    )


def _check_shape(name: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        shape = ()
    if not shape or min(shape) < 1:
        raise ModelError(
            f"model {name!r}: input_shape must be a non-empty tuple of positive "
            f"ints, got {input_shape!r}"
        )
    return shape


def _check_hidden(name: str, hidden: Sequence[int]) -> list[int]:
    widths = list(hidden)
    if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
        raise ModelError(f"model {name!r}: hidden must be a list of positive ints, got {hidden!r}")
    return widths


def _build_custom(
    spec: str, input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None
) -> nn.Module:
    fn = load_callable(spec, "custom model", ModelError)
    attr = spec.partition(":")[2]
    model = call_plugin(
        fn,
        spec,
        "custom model",
        ModelError,
        input_shape=input_shape,
        num_classes=num_classes,
        hidden=hidden,
    )
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"custom model {spec!r}: {attr}() returned {type(model).__name__}, "
            f"expected torch.nn.Module"
        )
    _check_output(spec, model, input_shape, num_classes)
    try:
        averaged_parameters(model)
    except ValueError as exc:
        raise ModelError(f"custom model {spec!r}: {exc}") from None
    if any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules()):
        logger.warning(
            "custom model %r has BatchNorm/InstanceNorm running statistics; "
            "peers average parameters only, so those buffers stay local",
            spec,
        )
    return model


def _check_output(
    spec: str, model: nn.Module, input_shape: tuple[int, ...], num_classes: int
) -> None:
    was_training = model.training
    model.eval()  # eval mode: a dry run must not update running statistics
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as exc:
        raise ModelError(
            f"custom model {spec!r} fails on a batch of shape (2, *{input_shape}): {exc}"
        ) from exc
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(
            f"custom model {spec!r} maps a batch of shape (2, *{input_shape}) "
            f"to {got}, expected (2, {num_classes}) logits"
        )
