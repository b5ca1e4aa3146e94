"""Small reference classifiers (logistic, MLP, 1-D and 2-D CNN) built by name.

None uses BatchNorm: peers average parameters only, so all model state is in
parameters.

Example:
    >>> import torch
    >>> from gossipdl.models import build_model
    >>> model = build_model("cnn1d", input_shape=(40,), num_classes=10)
    >>> model(torch.zeros(4, 40)).shape
    torch.Size([4, 10])
"""

from gossipdl.models.cnn import CNN1d, CNN2d
from gossipdl.models.mlp import MLP
from gossipdl.models.registry import ModelError, available_models, build_model

__all__ = ["MLP", "CNN1d", "CNN2d", "ModelError", "available_models", "build_model"]
