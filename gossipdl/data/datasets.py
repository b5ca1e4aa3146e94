"""Datasets that need no download: MNIST-1D, scikit-learn's digits, Gaussian blobs.

Every loader returns a :class:`Dataset` of numpy arrays (``float32`` features,
``int64`` labels) with a fixed train/test split, identical in every process that
loads it: peers that each call ``load_dataset("mnist1d")`` see the same data and
only then take their own shard of it (see :mod:`gossipdl.data.partition`).

MNIST-1D (Greydanus 2020) is generated, never downloaded. Generation takes about
two seconds and a swarm starts many peers at once, so the arrays are cached as
one ``.npz`` file per generator configuration in :func:`cache_dir`; the file is
written atomically, so a concurrent reader sees either no file or a whole one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gossipdl.numerals import is_decimal
from gossipdl.plugins import call_plugin, load_callable

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset name, dataset content or partition spec is invalid."""


@dataclass(frozen=True)
class Pixels:
    """Images kept as their uint8 pixels and standardised per channel where a batch or an
    evaluation uses them: ``(x / 255 − mean) / std``. A quarter of float32's memory: in
    every peer, CIFAR-10's training set takes 154 MB instead of 614 MB."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled classification dataset with a fixed train/test split.

    ``x_*`` are ``float32`` arrays of shape ``(N, *input_shape)``; ``y_*`` are
    ``int64`` class indices in ``[0, num_classes)``. ``input_shape`` is the shape
    of one sample, e.g. ``(40,)`` for MNIST-1D or ``(8, 8)`` for digits.

    Example:
        >>> import numpy as np
        >>> ds = Dataset("toy", np.zeros((4, 3), np.float32), np.array([0, 1, 0, 1]),
        ...              np.zeros((2, 3), np.float32), np.array([1, 0]), 2, (3,))
        >>> ds.num_train, ds.num_test
        (4, 2)
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    augment: str = ""  # "crop-flip": CIFAR's random 4-pixel-padded crops and mirror images
    owners_train: np.ndarray | None = None  # each sample's natural owner (a LEAF user), 0..U-1
    owners_test: np.ndarray | None = None
    pixels: Pixels | None = None  # x holds uint8 images, standardised when used

    def __post_init__(self) -> None:
        # Normalise the shape to a tuple of ints so equality checks work for lists.
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if not isinstance(self.num_classes, (int, np.integer)) or self.num_classes < 2:
            raise DataError(
                f"dataset {self.name!r}: num_classes must be an int >= 2, got {self.num_classes!r}"
            )
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            dtype = np.float32 if self.pixels is None else np.uint8
            if not isinstance(x, np.ndarray) or x.dtype != dtype:
                raise DataError(
                    f"dataset {self.name!r}: x_{split} must be a {dtype.__name__} numpy "
                    f"array{'' if self.pixels is None else ' (pixels)'}, got {_describe(x)} "
                    f"(use .astype(np.{dtype.__name__}))"
                )
            if not isinstance(y, np.ndarray) or y.dtype != np.int64 or y.ndim != 1:
                raise DataError(
                    f"dataset {self.name!r}: y_{split} must be a 1-D int64 numpy "
                    f"array, got {_describe(y)} (use .astype(np.int64))"
                )
            if x.shape[1:] != self.input_shape:
                raise DataError(
                    f"dataset {self.name!r}: x_{split} has per-sample shape "
                    f"{x.shape[1:]}, expected input_shape {self.input_shape}"
                )
            if len(x) != len(y):
                raise DataError(
                    f"dataset {self.name!r}: x_{split} has {len(x)} samples "
                    f"but y_{split} has {len(y)}"
                )
            if len(y) == 0:
                raise DataError(f"dataset {self.name!r}: the {split} split is empty")
            if y.min() < 0 or y.max() >= self.num_classes:
                raise DataError(
                    f"dataset {self.name!r}: y_{split} has labels in "
                    f"[{y.min()}, {y.max()}], expected [0, {self.num_classes})"
                )
            if self.pixels is None and not np.isfinite(x).all():
                raise DataError(f"dataset {self.name!r}: x_{split} contains NaN or inf")
            owners = getattr(self, f"owners_{split}")
            if owners is not None and (
                not isinstance(owners, np.ndarray) or owners.dtype != np.int64
                or owners.shape != y.shape or owners.min() < 0
            ):  # fmt: skip
                raise DataError(
                    f"dataset {self.name!r}: owners_{split} must be a non-negative int64 array "
                    f"with one owner per sample ({len(y)}), got {_describe(owners)}"
                )
        if self.pixels is not None:
            channels = self.input_shape[0] if len(self.input_shape) == 3 else 0
            pixels = self.pixels
            if not (len(pixels.mean) == len(pixels.std) == channels) or min(pixels.std) <= 0:
                raise DataError(
                    f"dataset {self.name!r}: pixels needs images [C, H, W] and one mean and "
                    f"one positive std per channel; got input_shape {self.input_shape}, {pixels}"
                )
        if self.augment not in ("", "crop-flip"):
            raise DataError(
                f"dataset {self.name!r}: augment = {self.augment!r}; use '' or 'crop-flip'"
            )

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        return len(self.y_test)

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train={self.num_train}, test={self.num_test}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes})"
        )


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"ndarray(dtype={a.dtype}, shape={a.shape})"
    return type(a).__name__


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where generated datasets are cached.

    ``$GOSSIPDL_CACHE`` if set, else ``$XDG_CACHE_HOME/gossipdl``, else
    ``~/.cache/gossipdl``. The directory is not created here.
    """
    explicit = os.environ.get("GOSSIPDL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gossipdl"


_ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _read_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays in ``path``, or None when it is missing or unreadable."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: np.array(npz[k]) for k in _ARRAY_KEYS}
    except Exception as exc:  # corrupt zip, truncated file, missing key, ...
        logger.warning("ignoring unreadable dataset cache %s (%s); regenerating", path, exc)
        return None
    return arrays


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` atomically; a failure is logged, not raised."""
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                x_train=arrays["x_train"],
                y_train=arrays["y_train"],
                x_test=arrays["x_test"],
                y_test=arrays["y_test"],
            )
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache is shareable
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError as exc:
        logger.warning("could not write dataset cache %s (%s); continuing uncached", path, exc)
    finally:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)


# --------------------------------------------------------------------------- MNIST-1D

# The standard MNIST-1D configuration (mnist1d's get_dataset_args(), minus the
# download URL): 5000 samples, 80/20 split, sequences of length 40, seed 42.
# Pinned here so that the cache key is known without importing mnist1d (which
# pulls in scipy and matplotlib, ~0.9 s per process).
MNIST1D_ARGS: dict[str, Any] = {
    "num_samples": 5000,
    "train_split": 0.8,
    "template_len": 12,
    "padding": [36, 60],
    "scale_coeff": 0.4,
    "max_translation": 48,
    "corr_noise_scale": 0.25,
    "iid_noise_scale": 2e-2,
    "shear_scale": 0.75,
    "shuffle_seq": False,
    "final_seq_length": 40,
    "seed": 42,
}
_CACHE_FORMAT = 1
# ``mnist1d:N``: N training samples, generated by the same recipe together with this many
# test samples (the standard set's 1,000, so evaluating costs what it costs there).
MNIST1D_SIZED_TEST = 1000
MNIST1D_MAX_TRAIN = 1_000_000  # ~0.4 ms a sample to generate here: minutes, 160 MB


def _mnist1d_args(train: int | None) -> dict[str, Any]:
    """The generator's arguments: the standard set's, or for ``train`` samples enough whole
    samples per class for them and the test samples, none split off (we split)."""
    if train is None:
        return MNIST1D_ARGS
    per_class = -(-(train + MNIST1D_SIZED_TEST) // 10)  # make_dataset: num_samples // 10 each
    return {**MNIST1D_ARGS, "num_samples": per_class * 10, "train_split": 1.0}


def _mnist1d_cache_path(train: int | None = None) -> Path:
    try:
        version = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    spec: dict[str, Any] = {"args": _mnist1d_args(train), "mnist1d": version}
    if train is not None:
        spec["train"] = train
    key = json.dumps({**spec, "format": _CACHE_FORMAT}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"mnist1d-{digest}.npz"


def _generate_mnist1d(train: int | None = None) -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    for k, v in _mnist1d_args(train).items():
        setattr(args, k, v)
    # make_dataset reseeds the global `random` and `np.random` generators;
    # put them back so loading data never changes a caller's random stream.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        raw = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    if train is not None:  # one shuffled set: the first samples train, the next test
        x, y = raw["x"], raw["y"]
        test = slice(train, train + MNIST1D_SIZED_TEST)
        raw = {"x": x[:train], "y": y[:train], "x_test": x[test], "y_test": y[test]}
    return {
        "x_train": np.asarray(raw["x"], dtype=np.float32),
        "y_train": np.asarray(raw["y"], dtype=np.int64),
        "x_test": np.asarray(raw["x_test"], dtype=np.float32),
        "y_test": np.asarray(raw["y_test"], dtype=np.int64),
    }


def _mnist1d_valid(arrays: dict[str, np.ndarray], train: int | None = None) -> bool:
    n = MNIST1D_ARGS["num_samples"]
    n_train = int(n * MNIST1D_ARGS["train_split"]) if train is None else train
    n_test = n - n_train if train is None else MNIST1D_SIZED_TEST
    length = MNIST1D_ARGS["final_seq_length"]
    return (
        arrays["x_train"].shape == (n_train, length)
        and arrays["x_test"].shape == (n_test, length)
        and arrays["y_train"].shape == (n_train,)
        and arrays["y_test"].shape == (n_test,)
        and arrays["x_train"].dtype == np.float32
        and arrays["y_train"].dtype == np.int64
    )


def _load_mnist1d(train: int | None = None) -> Dataset:
    """The standard MNIST-1D (4,000 training samples), or with ``train`` of them."""
    path = _mnist1d_cache_path(train)
    arrays = _read_cache(path)
    if arrays is not None and not _mnist1d_valid(arrays, train):
        logger.warning("dataset cache %s has unexpected shapes or dtypes; regenerating", path)
        arrays = None
    if arrays is None:
        logger.info("generating MNIST-1D (cache: %s)", path)
        arrays = _generate_mnist1d(train)
        _write_cache(path, arrays)
    name = "mnist1d" if train is None else f"mnist1d:{train}"
    return Dataset(
        name, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], 10, (40,)
    )


# --------------------------------------------------------------------------- digits


def _stratified_split(
    y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices with each class split ``1 - f : f``."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = round(len(idx) * test_fraction)
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = (np.asarray(raw.images, dtype=np.float32) / 16.0).astype(np.float32)
    y = np.asarray(raw.target, dtype=np.int64)
    train, test = _stratified_split(y, test_fraction=0.2, seed=0)
    return Dataset(
        "digits", x[train], y[train], x[test], y[test], num_classes=10, input_shape=(8, 8)
    )


# --------------------------------------------------------------------------- synthetic


SYNTHETIC_MAX_TRAIN = 4_000_000  # 32 float32 features: 512 MB


def _load_synthetic(train: int | None = None) -> Dataset:
    """Ten isotropic Gaussian blobs in 32 dimensions (500 per class), centres
    uniform in [-1, 1]^32, noise std 1.1, standardised with train statistics; with
    ``train``, that many training samples (and 1,000 test samples) from the same blobs.

    The blobs overlap: multinomial logistic regression reaches ~0.89 test
    accuracy, which is also about the Bayes rate (equal isotropic covariances
    make the optimal classifier linear), so deeper models gain nothing here.
    """
    num_classes, dim, n_per_class, noise_std, seed = 10, 32, 500, 1.1, 0
    test_fraction = 0.2
    if train is not None:  # whole samples per class for train + 1,000 test, cut exactly
        n_per_class = -(-(train + 1000) // num_classes)
        test_fraction = 1000 / (n_per_class * num_classes)
    rng = np.random.default_rng(seed)
    centers = rng.uniform(-1.0, 1.0, size=(num_classes, dim))  # the same blobs at any size
    y = np.repeat(np.arange(num_classes, dtype=np.int64), n_per_class)
    x = centers[y] + noise_std * rng.standard_normal((len(y), dim))
    train_idx, test = _stratified_split(y, test_fraction=test_fraction, seed=seed)
    train_idx, test = rng.permutation(train_idx), rng.permutation(test)
    if train is not None:
        train_idx = train_idx[:train]
    mean, std = x[train_idx].mean(0), x[train_idx].std(0)
    x = ((x - mean) / std).astype(np.float32)
    return Dataset(
        "synthetic" if train is None else f"synthetic:{train}",
        x[train_idx],
        y[train_idx],
        x[test],
        y[test],
        num_classes=num_classes,
        input_shape=(dim,),
    )


# --------------------------------------------------------------------------- registry

_BUILTIN: dict[str, Callable[[], Dataset]] = {
    "mnist1d": _load_mnist1d,
    "digits": _load_digits,
    "synthetic": _load_synthetic,
}
# Built-in datasets generated at any size: ``NAME:N`` has N training samples.
_SIZED: dict[str, tuple[Callable[[int], Dataset], int]] = {
    "mnist1d": (_load_mnist1d, MNIST1D_MAX_TRAIN),
    "synthetic": (_load_synthetic, SYNTHETIC_MAX_TRAIN),
}


def sized_limit(base: str) -> int:
    """The most training samples generated dataset ``base`` (mnist1d, synthetic) makes."""
    return _SIZED[base][1]


def sized_dataset(name: str) -> tuple[str, int] | None:
    """``(NAME, N)`` for a spec ``NAME:N`` that asks a generated built-in dataset for ``N``
    training samples (``mnist1d:64000``); None for any other name. DataError if ``N`` is
    out of range.

    Example:
        >>> sized_dataset("mnist1d:64000"), sized_dataset("mnist1d"), sized_dataset("a.b:f")
        (('mnist1d', 64000), None, None)
    """
    base, colon, size = name.partition(":")
    if not colon or base not in _SIZED or not is_decimal(size):
        return None
    limit = sized_limit(base)
    if not 1 <= int(size) <= limit:
        raise DataError(f"dataset {name!r}: {base}:N takes 1 <= N <= {limit:,} training samples")
    return base, int(size)


def builtin_dataset(name: str) -> bool:
    """Whether ``name`` is built into gossipdl (``mnist1d:N``, the published data sets and
    ``synthetic-fedprox:A:B`` too), not a plug-in to import.

    Example:
        >>> builtin_dataset("mnist1d:64000"), builtin_dataset("mymod:load")
        (True, False)
    """
    from gossipdl.data.published import FEDPROX, PUBLISHED

    if name in _BUILTIN or name in PUBLISHED or name.partition(":")[0] == FEDPROX:
        return True
    try:
        return sized_dataset(name) is not None
    except DataError:
        return True  # built in, with a size out of range: loading it says so


def available_datasets() -> list[str]:
    """Names of the built-in datasets, generated or read from files (``--data-dir``);
    ``synthetic-fedprox:ALPHA:BETA`` is generated too, ``"module.path:function"`` loads
    any other.

    Example:
        >>> available_datasets()
        ['cifar10', 'cifar100', 'digits', 'femnist', 'mnist1d', 'shakespeare', 'synthetic']
    """
    from gossipdl.data.published import PUBLISHED

    return sorted([*_BUILTIN, *PUBLISHED])


def load_dataset(name: str, data_dir: Path | str | None = None) -> Dataset:
    """Load a dataset by name.

    ``name`` is a built-in name (see :func:`available_datasets`); ``mnist1d:N``,
    MNIST-1D generated by the same recipe with ``N`` training samples and 1,000
    test samples (``mnist1d`` itself is the standard set: 4,000 and 1,000);
    ``synthetic:N``, ``N`` training samples of the same blobs; or
    ``"module.path:function"``, in which case ``function()`` is imported and
    called with no arguments and must return a :class:`Dataset`.

    The published data sets (``cifar10``, ``cifar100``, ``femnist``, ``shakespeare``) are
    read from ``data_dir`` (default :func:`~gossipdl.data.published.default_data_dir`),
    ``synthetic-fedprox:ALPHA:BETA[:USERS]`` is generated
    (:mod:`gossipdl.data.published`).

    Raises:
        DataError: unknown name, unimportable module or missing function, or a
            function that does not return a Dataset; a published data set's missing
            or corrupt file (named, with the command that fetches it).

    Example:
        >>> ds = load_dataset("digits")
        >>> ds.input_shape, ds.num_classes
        ((8, 8), 10)
    """
    from gossipdl.data import published

    if name in _BUILTIN:
        return _BUILTIN[name]()
    if name in published.PUBLISHED:
        return published.load_published(name, data_dir)
    fedprox = published.parse_fedprox(name)
    if fedprox is not None:
        return published.load_fedprox(*fedprox)
    sized = sized_dataset(name)
    if sized is not None:
        base, train = sized
        return _SIZED[base][0](train)
    if ":" in name:
        return _load_custom(name)
    raise DataError(
        f"unknown dataset {name!r}; expected one of {available_datasets()}, "
        f"{' or '.join(f'{k}:N' for k in _SIZED)} (N training samples) or 'module.path:function'"
    )


def _load_custom(spec: str) -> Dataset:
    fn = load_callable(spec, "custom dataset", DataError)
    attr = spec.partition(":")[2]
    result = call_plugin(fn, spec, "custom dataset", DataError)
    if not isinstance(result, Dataset):
        raise DataError(
            f"custom dataset {spec!r}: {attr}() returned {type(result).__name__}, "
            f"expected gossipdl.data.Dataset"
        )
    return result
