"""The data sets the field benchmarks on, read from their published on-disk formats.

- ``cifar10`` and ``cifar100``: the binary versions (``cifar-10-batches-bin/data_batch_1.bin``
  … ``data_batch_5.bin`` and ``test_batch.bin``, each record one label byte and 3072 pixel
  bytes, channel by channel; ``cifar-100-binary/train.bin`` and ``test.bin``, a coarse and
  a fine label byte first: the fine one is the class). No pickle is ever loaded.
- ``femnist`` and ``shakespeare``: LEAF's JSON (``femnist/train/*.json`` and
  ``femnist/test/*.json``, each ``{"users", "num_samples", "user_data": {user: {"x", "y"}}}``,
  as LEAF's own ``preprocess.sh`` writes them). Every sample keeps its owner (writer,
  speaker): ``partition = "natural"`` gives each peer whole owners.
- ``synthetic-fedprox:ALPHA:BETA[:USERS]``: Synthetic(α, β) of the FedProx paper (Li et al.
  2020), generated here: per device k, ``u_k ~ N(0, α)``, ``B_k ~ N(0, β)``, a softmax
  model ``W_k, b_k ~ N(u_k, 1)`` and inputs ``x ~ N(v_k, Σ)`` with ``v_k ~ N(B_k, 1)``,
  ``Σ_jj = j^−1.2``, labels ``argmax(W_k x + b_k)``; sample counts lognormal(4, 2) + 50 per
  device (30 devices unless USERS is given), 90% of each device's samples to train.

Files live under a data directory (``--data-dir``; default :func:`default_data_dir`).
Nothing here downloads: ``gossipdl data fetch NAME`` does, as the user's explicit step
(:mod:`gossipdl.data.fetch`). A missing or corrupt file is a :class:`DataError` that
names the file and that command.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from gossipdl.data.datasets import DataError, Dataset, Pixels, cache_dir

PUBLISHED = ("cifar10", "cifar100", "femnist", "shakespeare")
"""The data sets read from files (``synthetic-fedprox`` is generated)."""

FEDPROX = "synthetic-fedprox"
_CIFAR = {  # name: (folder, train files, test file, label bytes, classes, mean, std)
    "cifar10": (
        "cifar-10-batches-bin",
        tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
        "test_batch.bin",
        1,
        10,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "cifar100": (
        "cifar-100-binary",
        ("train.bin",),
        "test.bin",
        2,
        100,
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
}
_PIXELS = 3 * 32 * 32
CIFAR_RECORDS = {"cifar10": (10_000,) * 6, "cifar100": (50_000, 10_000)}
"""Records in each of a CIFAR data set's files (:func:`cifar_files`' order), as published:
the reader refuses a file of another size, a copy cut short at a record's end among them,
and reads no more than that; ``gossipdl data fetch`` keeps files of these sizes."""

SHAKESPEARE_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
"""LEAF's Shakespeare vocabulary (its ``ALL_LETTERS``): a character's class is its index."""
_LETTER = {c: i for i, c in enumerate(SHAKESPEARE_LETTERS)}
SHAKESPEARE_SEQUENCE = 80  # LEAF's: 80 characters in, the next one out
FEMNIST_CLASSES, FEMNIST_SIDE = 62, 28
_FEMNIST_PIXELS = FEMNIST_SIDE * FEMNIST_SIDE


def default_data_dir() -> Path:
    """Where published data sets are read from by default: ``$GOSSIPDL_DATA``, else
    ``data/`` in :func:`~gossipdl.data.datasets.cache_dir`."""
    explicit = os.environ.get("GOSSIPDL_DATA")
    return data_root(explicit) if explicit else cache_dir() / "data"


def data_root(data_dir: Path | str | None = None) -> Path:
    """The data directory ``data_dir`` names, ``~`` expanded (a config file's ``data_dir =
    "~/data"`` reaches us unexpanded, while the fetch command a hint suggests has it
    expanded by the shell: both must mean one folder), else :func:`default_data_dir`.

    Example:
        >>> data_root("~/data") == Path.home() / "data"
        True
    """
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def fetch_hint(name: str, data_dir: Path) -> str:
    """How to get data set ``name`` into ``data_dir``: the command to run, ready to paste
    into a shell (the directory quoted)."""
    where = "" if data_dir == default_data_dir() else f" --data-dir {shlex.quote(str(data_dir))}"
    return f"run `gossipdl data fetch {name}{where}`"


def load_published(name: str, data_dir: Path | str | None = None) -> Dataset:
    """Data set ``name`` (one of :data:`PUBLISHED`) from ``data_dir`` (:func:`data_root`);
    DataError naming the missing or corrupt file and the command that fetches it."""
    root = data_root(data_dir)
    if name in _CIFAR:
        return _load_cifar(name, root)
    if name in ("femnist", "shakespeare"):
        return _load_leaf(name, root)
    raise DataError(f"unknown published data set {name!r}; known: {', '.join(PUBLISHED)}")


# --------------------------------------------------------------------------- CIFAR


def cifar_files(name: str) -> tuple[list[str], int]:
    """Data set ``name``'s files, relative to the data directory (training files first, the
    test file last), and the bytes of one of its records: what the reader reads and what
    ``gossipdl data fetch`` keeps."""
    folder, train_files, test_file, label_bytes, *_ = _CIFAR[name]
    return [f"{folder}/{f}" for f in (*train_files, test_file)], label_bytes + _PIXELS


def _cifar_records(
    name: str, path: Path, root: Path, records: int
) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 images (``[N, 3, 32, 32]``) and int64 classes of one binary CIFAR file of
    ``records`` records."""
    _, _, _, label_bytes, classes, _, _ = _CIFAR[name]
    if not path.is_file():
        raise DataError(f"{name}: {path} is missing; {fetch_hint(name, root)}")
    record = cifar_files(name)[1]
    size = path.stat().st_size
    if size != records * record:
        raise DataError(
            f"{name}: {path} holds {size:,} bytes, not the published {records:,} records of "
            f"{record} bytes ({records * record:,}): it is truncated or not the binary "
            f"version; delete it and {fetch_hint(name, root)}"
        )
    rows = np.fromfile(path, dtype=np.uint8, count=records * record).reshape(-1, record)
    labels = rows[:, label_bytes - 1].astype(np.int64)  # CIFAR-100: the fine label
    if labels.max() >= classes:
        raise DataError(
            f"{name}: {path} has a label {labels.max()} (classes 0..{classes - 1}): the file "
            f"is corrupt or another data set's; delete it and {fetch_hint(name, root)}"
        )
    return rows[:, label_bytes:].reshape(-1, 3, 32, 32), labels


def _load_cifar(name: str, root: Path) -> Dataset:
    """CIFAR-10/100 from its binary files: the images kept as uint8 pixels, scaled to [0, 1]
    and standardised per channel with the published training-set statistics when used."""
    *_, classes, mean, std = _CIFAR[name]
    *parts, (x_test, y_test) = [
        _cifar_records(name, root / f, root, records)
        for f, records in zip(cifar_files(name)[0], CIFAR_RECORDS[name], strict=True)
    ]
    return Dataset(
        name,
        np.concatenate([x for x, _ in parts]),
        np.concatenate([y for _, y in parts]),
        np.ascontiguousarray(x_test),
        y_test,
        num_classes=classes,
        input_shape=(3, 32, 32),
        augment="crop-flip",
        pixels=Pixels(tuple(mean), tuple(std)),
    )


# --------------------------------------------------------------------------- LEAF


LEAF_FILE_LIMIT = 2 << 30
"""The largest LEAF JSON file read, in bytes (2 GiB), checked before reading it: ``json.load``
holds several times a file's size in memory (5-10x for FEMNIST's numbers), with nothing in
the file bounding it. LEAF's ``preprocess.sh`` writes files of a few hundred MB at most (our
estimate from the data sets' sample counts), even for a whole data set (``--sf 1.0``:
FEMNIST's writers spread over 36 files, Shakespeare's 4.2 million 80-character samples in
one), and the usual sampled versions far smaller ones; a bigger file can be split, as every
``*.json`` in the folder is read."""


def _leaf_files(name: str, root: Path, split: str) -> list[Path]:
    folder = root / name / split
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise DataError(
            f"{name}: no {split} files ({folder}/*.json); {fetch_hint(name, root)} "
            "(it says how LEAF's scripts make them)"
        )
    return files


def _corrupt(name: str, path: Path, root: Path, what: str) -> DataError:
    """A LEAF file that cannot be used: the file, ``what`` is wrong with it, the way out."""
    return DataError(f"{name}: {path}: {what}; delete it and {fetch_hint(name, root)}")


def _leaf_document(name: str, path: Path, root: Path) -> tuple[list[Any], dict[str, Any]]:
    """The ``users`` and ``user_data`` of one LEAF JSON file, read only if it is no larger
    than :data:`LEAF_FILE_LIMIT`; DataError naming the file if it cannot be read as LEAF's."""
    try:
        size = path.stat().st_size
        if size > LEAF_FILE_LIMIT:
            raise DataError(
                f"{name}: {path} holds {size:,} bytes, more than a LEAF file may "
                f"(gossipdl.data.published.LEAF_FILE_LIMIT, {LEAF_FILE_LIMIT:,}; LEAF writes "
                "files of a few hundred MB at most): split its users over several *.json "
                f"files in that folder, or delete it and {fetch_hint(name, root)}"
            )
        with path.open(encoding="utf-8") as f:
            doc = json.load(f)
        users, data = doc["users"], doc["user_data"]
        if not isinstance(users, list) or not isinstance(data, dict):
            raise TypeError("'users' is not a list or 'user_data' not an object")
    except DataError:  # the size's, a ValueError too
        raise
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # RecursionError: arrays nested deeper than json's parser recurses
        raise _corrupt(name, path, root, f"not LEAF's JSON ({type(exc).__name__}: {exc})") from None
    return users, data


def _leaf_samples(name: str, path: Path, root: Path) -> list[tuple[str, list[Any], list[Any]]]:
    """``(user, xs, ys)`` of every user in one LEAF JSON file, checked; a user listed twice is
    refused when it is met, before the rest of a long list costs memory."""
    users, data = _leaf_document(name, path, root)
    out, seen = [], set()
    for user in users:
        entry = data.get(user) if isinstance(user, str) else None
        xs, ys = (entry.get("x"), entry.get("y")) if isinstance(entry, dict) else (None, None)
        if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys):
            raise _corrupt(name, path, root, f"user {user!r} has no x and y lists of one length")
        if user in seen:
            raise _corrupt(name, path, root, f"it lists a user twice ({user!r})")
        seen.add(user)
        out.append((user, xs, ys))
    return out


def _femnist_pixels(xs: list[Any]) -> np.ndarray | None:
    """FEMNIST samples as float32 rows of 784 finite numbers; None if they are not (ragged,
    not numbers, an integer too large for a float)."""
    try:
        x = np.asarray(xs, dtype=np.float32).reshape(len(xs), _FEMNIST_PIXELS)
    except (ValueError, TypeError, OverflowError):
        return None
    return x if np.isfinite(x).all() else None


def _femnist_arrays(
    path: Path, root: Path, samples: list[tuple[str, list[Any], list[Any]]]
) -> tuple[np.ndarray, np.ndarray]:
    """The images (``[N, 1, 28, 28]``) and int64 classes of one FEMNIST file's samples."""
    x = _femnist_pixels([x for _, user_x, _ in samples for x in user_x])
    if x is None:
        raise _corrupt("femnist", path, root, f"a sample is not {_FEMNIST_PIXELS} finite numbers")
    ys = [y for _, _, user_y in samples for y in user_y]
    if not all(type(y) is int and 0 <= y < FEMNIST_CLASSES for y in ys):
        raise _corrupt("femnist", path, root, f"a label is not one of 0..{FEMNIST_CLASSES - 1}")
    return x.reshape(-1, 1, FEMNIST_SIDE, FEMNIST_SIDE), np.array(ys, dtype=np.int64)


def _shakespeare_arrays(
    path: Path, root: Path, samples: list[tuple[str, list[Any], list[Any]]]
) -> tuple[np.ndarray, np.ndarray]:
    """The character classes (``[N, 80]``) and next-character classes of one Shakespeare
    file's samples."""
    texts = [text for _, user_x, _ in samples for text in user_x]
    labels = [label for _, _, user_y in samples for label in user_y]
    try:
        if any(len(text) != SHAKESPEARE_SEQUENCE for text in texts):
            raise ValueError
        x = np.array([[_LETTER[c] for c in text] for text in texts], dtype=np.float32)
        y = np.array([_LETTER[label] for label in labels], dtype=np.int64)
    except (KeyError, ValueError, TypeError):
        raise _corrupt(
            "shakespeare",
            path,
            root,
            f"a sample is not {SHAKESPEARE_SEQUENCE} characters of LEAF's vocabulary, or a "
            "label not one of them",
        ) from None
    return x.reshape(-1, SHAKESPEARE_SEQUENCE), y


def _load_leaf(name: str, root: Path) -> Dataset:
    """A LEAF data set: every user's train and test samples, each kept with its owner's
    number (users numbered in sorted order). A file with no samples adds none; a split
    with none at all is refused."""
    arrays = _femnist_arrays if name == "femnist" else _shakespeare_arrays
    splits: dict[str, tuple[np.ndarray, np.ndarray, list[str]]] = {}
    for split in ("train", "test"):
        xs, ys, owners = [], [], []
        listed: dict[str, Path] = {}  # user -> the file that holds its samples of this split
        for path in _leaf_files(name, root, split):
            samples = _leaf_samples(name, path, root)
            for user, _, _ in samples:
                if user in listed:
                    raise DataError(
                        f"{name}: user {user!r} is in both {listed[user]} and {path} "
                        f"({split}); delete them and {fetch_hint(name, root)}"
                    )
                listed[user] = path
            x, y = arrays(path, root, samples)
            xs.append(x)
            ys.append(y)
            owners += [user for user, _, user_y in samples for _ in user_y]
        if not owners:
            raise DataError(
                f"{name}: the {split} files in {root / name / split} hold no samples; "
                f"{fetch_hint(name, root)} (it says how LEAF's scripts make them)"
            )
        splits[split] = (np.concatenate(xs), np.concatenate(ys), owners)
    users = sorted(set(splits["train"][2]))
    number = {u: i for i, u in enumerate(users)}
    unknown = set(splits["test"][2]) - set(number)
    if unknown:
        raise DataError(f"{name}: test users without training samples: {sorted(unknown)[:5]}")
    (x_train, y_train, own_train), (x_test, y_test, own_test) = splits["train"], splits["test"]
    femnist = name == "femnist"
    return Dataset(
        name,
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=FEMNIST_CLASSES if femnist else len(SHAKESPEARE_LETTERS),
        input_shape=(1, FEMNIST_SIDE, FEMNIST_SIDE) if femnist else (SHAKESPEARE_SEQUENCE,),
        owners_train=np.array([number[u] for u in own_train], dtype=np.int64),
        owners_test=np.array([number[u] for u in own_test], dtype=np.int64),
    )


# --------------------------------------------------------------------------- Synthetic(α, β)

FEDPROX_DIM, FEDPROX_CLASSES, FEDPROX_USERS = 60, 10, 30


def parse_fedprox(name: str) -> tuple[float, float, int] | None:
    """``(α, β, users)`` of ``synthetic-fedprox:ALPHA:BETA[:USERS]``, None for another name;
    DataError for a malformed one.

    Example:
        >>> parse_fedprox("synthetic-fedprox:1:1"), parse_fedprox("mnist1d")
        ((1.0, 1.0, 30), None)
    """
    base, _, rest = name.partition(":")
    if base != FEDPROX:
        return None
    parts = rest.split(":")
    usage = f"dataset {name!r}: use {FEDPROX}:ALPHA:BETA[:USERS], e.g. {FEDPROX}:1:1"
    if len(parts) not in (2, 3):
        raise DataError(usage)
    try:
        alpha, beta = float(parts[0]), float(parts[1])
        users = int(parts[2]) if len(parts) == 3 else FEDPROX_USERS
    except ValueError:
        raise DataError(usage) from None
    if not (0 <= alpha < 1e3 and 0 <= beta < 1e3 and 1 <= users <= 10_000):
        raise DataError(f"{usage} (α, β in [0, 1000), 1 <= USERS <= 10,000)")
    return alpha, beta, users


def load_fedprox(alpha: float, beta: float, users: int, seed: int = 0) -> Dataset:
    """Synthetic(α, β) as the FedProx paper generates it (module docstring), standardised
    with the training samples' statistics; each sample's device is its owner."""
    rng = np.random.default_rng(seed)
    counts = (rng.lognormal(4, 2, users).astype(np.int64) + 50).clip(max=20_000)
    sigma = np.arange(1, FEDPROX_DIM + 1, dtype=np.float64) ** -1.2
    x_parts, y_parts, train_mask = [], [], []
    for k in range(users):
        # one shift per device for the model (u_k) and for every feature's mean (B_k)
        u, b = rng.normal(0, np.sqrt(alpha)), rng.normal(0, np.sqrt(beta))
        w = rng.normal(u, 1, (FEDPROX_CLASSES, FEDPROX_DIM))
        bias = rng.normal(u, 1, FEDPROX_CLASSES)
        v = rng.normal(b, 1, FEDPROX_DIM)
        x = v + rng.standard_normal((counts[k], FEDPROX_DIM)) * np.sqrt(sigma)
        x_parts.append(x)
        y_parts.append(np.argmax(x @ w.T + bias, axis=1))
        train = int(0.9 * counts[k])
        train_mask.append(np.arange(counts[k]) < train)
    x, y = np.concatenate(x_parts), np.concatenate(y_parts).astype(np.int64)
    owners = np.repeat(np.arange(users, dtype=np.int64), counts)
    kept = np.concatenate(train_mask)
    mean, std = x[kept].mean(0), x[kept].std(0) + 1e-8
    x = ((x - mean) / std).astype(np.float32)
    return Dataset(
        f"{FEDPROX}:{alpha:g}:{beta:g}" + (f":{users}" if users != FEDPROX_USERS else ""),
        x[kept],
        y[kept],
        x[~kept],
        y[~kept],
        num_classes=FEDPROX_CLASSES,
        input_shape=(FEDPROX_DIM,),
        owners_train=owners[kept],
        owners_test=owners[~kept],
    )
