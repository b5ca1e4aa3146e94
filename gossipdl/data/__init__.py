"""Datasets that need no download, partitioners among peers, and a batch sampler.

Example:
    >>> from gossipdl.data import load_dataset, partition, BatchSampler
    >>> ds = load_dataset("digits")
    >>> parts = partition(ds.y_train, n=4, spec="dirichlet:0.5", seed=0)
    >>> sampler = BatchSampler(ds.x_train[parts[0]], ds.y_train[parts[0]], 32, seed=0)
    >>> xb, yb = sampler.next()
    >>> tuple(xb.shape)
    (32, 8, 8)
"""

from gossipdl.data.datasets import (
    DataError,
    Dataset,
    Pixels,
    available_datasets,
    builtin_dataset,
    cache_dir,
    load_dataset,
    sized_dataset,
)
from gossipdl.data.loader import (
    BatchSampler,
    IndexStream,
    augment_draws,
    crop_flip,
    evaluation_inputs,
    standardise,
    to_tensors,
)
from gossipdl.data.partition import partition

__all__ = [
    "BatchSampler",
    "DataError",
    "Dataset",
    "IndexStream",
    "Pixels",
    "augment_draws",
    "available_datasets",
    "builtin_dataset",
    "cache_dir",
    "crop_flip",
    "evaluation_inputs",
    "load_dataset",
    "partition",
    "sized_dataset",
    "standardise",
    "to_tensors",
]
