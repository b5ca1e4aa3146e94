"""Tests for gossipdl.data: datasets, the MNIST-1D cache, partitioners, the batch sampler."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from gossipdl.data import (
    BatchSampler,
    DataError,
    Dataset,
    Pixels,
    available_datasets,
    cache_dir,
    load_dataset,
    partition,
)
from gossipdl.data import datasets as datasets_module
from gossipdl.data.loader import to_tensors

# --------------------------------------------------------------------------- datasets

EXPECTED = {
    "mnist1d": ((40,), 4000, 1000),
    "digits": ((8, 8), 1438, 359),
    "synthetic": ((32,), 4000, 1000),
}


def test_available_datasets() -> None:
    """The generated ones (EXPECTED) and the published ones (tests/test_workloads.py)."""
    published = ["cifar10", "cifar100", "femnist", "shakespeare"]
    assert available_datasets() == sorted([*EXPECTED, *published])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_dataset_shapes_and_dtypes(name: str) -> None:
    ds = load_dataset(name)
    shape, n_train, n_test = EXPECTED[name]
    assert ds.name == name
    assert ds.input_shape == shape
    assert ds.num_classes == 10
    assert ds.x_train.shape == (n_train, *shape)
    assert ds.x_test.shape == (n_test, *shape)
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int64
    # every class in both splits, roughly balanced
    for y in (ds.y_train, ds.y_test):
        counts = np.bincount(y, minlength=10)
        assert len(counts) == 10
        assert counts.min() > 0.7 * counts.mean()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dataset_is_deterministic(name: str) -> None:
    a, b = load_dataset(name), load_dataset(name)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_digits_scaled_to_unit_interval() -> None:
    ds = load_dataset("digits")
    assert ds.x_train.min() == 0.0
    assert ds.x_train.max() == 1.0


def test_synthetic_is_standardised() -> None:
    ds = load_dataset("synthetic")
    np.testing.assert_allclose(ds.x_train.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(ds.x_train.std(0), 1.0, atol=1e-4)


def test_mnist1d_pinned_args_match_the_package_defaults() -> None:
    from mnist1d.data import get_dataset_args

    defaults = get_dataset_args(as_dict=True)
    defaults.pop("url")
    assert defaults == datasets_module.MNIST1D_ARGS


# --------------------------------------------------------------------------- MNIST-1D cache


class _FakeMakeDataset:
    """Stands in for mnist1d's make_dataset: fast, counts calls, reseeds globals like it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, args: object) -> dict[str, np.ndarray]:
        self.calls += 1
        np.random.seed(0)
        random.seed(0)
        rng = np.random.default_rng(self.calls)
        return {
            "x": rng.standard_normal((4000, 40)),
            "y": rng.integers(0, 10, 4000),
            "x_test": rng.standard_normal((1000, 40)),
            "y_test": rng.integers(0, 10, 1000),
        }


def _raise(*_: object) -> None:
    raise AssertionError("make_dataset called although the cache should be used")


@pytest.fixture
def fake_mnist1d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _FakeMakeDataset:
    import mnist1d.data

    monkeypatch.setenv("GOSSIPDL_CACHE", str(tmp_path))
    fake = _FakeMakeDataset()
    monkeypatch.setattr(mnist1d.data, "make_dataset", fake)
    return fake


def test_mnist1d_cache_written_then_used(
    fake_mnist1d: _FakeMakeDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mnist1d.data

    first = load_dataset("mnist1d")
    assert fake_mnist1d.calls == 1
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and re.fullmatch(r"mnist1d-[0-9a-f]{16}\.npz", files[0]), files

    monkeypatch.setattr(mnist1d.data, "make_dataset", _raise)
    second = load_dataset("mnist1d")
    np.testing.assert_array_equal(first.x_train, second.x_train)
    np.testing.assert_array_equal(first.y_test, second.y_test)


@pytest.mark.parametrize("content", [b"", b"not a zip file", b"PK\x03\x04truncated"])
def test_mnist1d_corrupt_cache_is_regenerated(
    fake_mnist1d: _FakeMakeDataset, tmp_path: Path, content: bytes
) -> None:
    load_dataset("mnist1d")
    (path,) = tmp_path.iterdir()
    path.write_bytes(content)
    ds = load_dataset("mnist1d")
    assert fake_mnist1d.calls == 2
    assert ds.x_train.shape == (4000, 40)
    load_dataset("mnist1d")  # and the rewritten file is good again
    assert fake_mnist1d.calls == 2


def test_mnist1d_cache_with_wrong_shapes_is_regenerated(
    fake_mnist1d: _FakeMakeDataset, tmp_path: Path
) -> None:
    load_dataset("mnist1d")
    (path,) = tmp_path.iterdir()
    with path.open("wb") as f:
        np.savez(
            f,
            x_train=np.zeros((3, 40), np.float32),
            y_train=np.zeros(3, np.int64),
            x_test=np.zeros((1, 40), np.float32),
            y_test=np.zeros(1, np.int64),
        )
    assert load_dataset("mnist1d").x_train.shape == (4000, 40)
    assert fake_mnist1d.calls == 2


def test_mnist1d_generation_leaves_global_rngs_alone(fake_mnist1d: _FakeMakeDataset) -> None:
    np.random.seed(123)
    random.seed(123)
    expected = (np.random.random(), random.random())
    np.random.seed(123)
    random.seed(123)
    load_dataset("mnist1d")
    assert fake_mnist1d.calls == 1
    assert (np.random.random(), random.random()) == expected


def test_mnist1d_unwritable_cache_still_loads(
    fake_mnist1d: _FakeMakeDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("GOSSIPDL_CACHE", str(blocker / "cache"))
    assert load_dataset("mnist1d").x_train.shape == (4000, 40)


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GOSSIPDL_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("GOSSIPDL_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "gossipdl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "gossipdl"


# --------------------------------------------------------------------------- custom datasets


def tiny_dataset() -> Dataset:
    x = np.zeros((6, 2), np.float32)
    y = np.array([0, 1, 2, 0, 1, 2], np.int64)
    return Dataset("tiny", x, y, x[:3], y[:3], num_classes=3, input_shape=(2,))


def not_a_dataset() -> dict[str, int]:
    return {"x": 1}


NOT_CALLABLE = 3


def test_custom_dataset_loads() -> None:
    ds = load_dataset(f"{__name__}:tiny_dataset")
    assert ds.name == "tiny" and ds.num_train == 6 and ds.input_shape == (2,)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"{__name__}:not_a_dataset", "returned dict"),
        (f"{__name__}:missing_function", "has no attribute 'missing_function'"),
        (f"{__name__}:NOT_CALLABLE", "not callable"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (":fn", "module.path:function"),
        (f"{__name__}:", "module.path:function"),
        (".mymod:load", "module.path:function"),  # relative: importlib raised a TypeError
        ("..:f", "module.path:function"),
    ],
)
def test_custom_dataset_errors(spec: str, message: str) -> None:
    with pytest.raises(DataError, match=re.escape(message)):
        load_dataset(spec)


def test_pixels_need_uint8_images_and_a_positive_std_per_channel() -> None:
    y = np.array([0, 1], np.int64)
    images = np.zeros((2, 3, 4, 4), np.uint8)
    good = Pixels((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    assert Dataset("img", images, y, images, y, 2, (3, 4, 4), pixels=good).pixels == good
    cases = [
        (images.astype(np.float32), good, "x_train must be a uint8 numpy array (pixels)"),
        (images, Pixels((0.5,), (0.2,)), "one mean and one positive std per channel"),
        (images, Pixels((0.5,) * 3, (0.2, 0.0, 0.2)), "one mean and one positive std"),
        (images[:, 0, 0], good, "needs images [C, H, W]"),
    ]
    for x, pixels, message in cases:
        with pytest.raises(DataError, match=re.escape(message)):
            Dataset("img", x, y, x, y, 2, x.shape[1:], pixels=pixels)


def test_unknown_dataset_names_value_and_choices() -> None:
    with pytest.raises(DataError) as info:
        load_dataset("cifar11")
    assert "'cifar11'" in str(info.value)
    for name in available_datasets():
        assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def _arrays(n: int = 4) -> dict[str, np.ndarray]:
    x = np.zeros((n, 3), np.float32)
    y = np.arange(n, dtype=np.int64) % 2
    return {"x_train": x, "y_train": y, "x_test": x, "y_test": y}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x_train": np.zeros((4, 3), np.float64)}, "float32"),
        ({"y_train": np.zeros(4, np.int32)}, "int64"),
        ({"x_test": np.zeros((4, 5), np.float32)}, "per-sample shape"),
        ({"y_test": np.zeros(3, np.int64)}, "has 4 samples"),
        ({"y_train": np.array([0, 1, 2, 1])}, "labels in"),
        ({"x_train": np.full((4, 3), np.nan, np.float32)}, "NaN"),
        ({"x_test": np.zeros((0, 3), np.float32), "y_test": np.zeros(0, np.int64)}, "empty"),
    ],
)
def test_dataset_sanity_checks(change: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(DataError, match=message):
        Dataset("bad", **{**_arrays(), **change}, num_classes=2, input_shape=(3,))


def test_dataset_repr_is_short() -> None:
    assert repr(load_dataset("digits")).startswith("Dataset(name='digits', train=1438")


# --------------------------------------------------------------------------- partition

LABELS = np.random.default_rng(7).permutation(np.repeat(np.arange(10), 400))
SPECS = ["iid", "dirichlet:0.1", "dirichlet:1", "dirichlet:100", "shards:1", "shards:2"]


def _check_disjoint_complete(parts: list[np.ndarray], n: int, total: int) -> None:
    assert len(parts) == n
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)  # sorted, no duplicates within a part
    merged = np.concatenate(parts)
    assert len(merged) == total  # no index in two parts...
    np.testing.assert_array_equal(np.sort(merged), np.arange(total))  # ...and none missing


@pytest.mark.parametrize("spec", SPECS)
def test_partition_disjoint_complete_and_seeded(spec: str) -> None:
    parts = partition(LABELS, 8, spec, seed=3)
    _check_disjoint_complete(parts, 8, len(LABELS))
    again = partition(LABELS, 8, spec, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition(LABELS, 8, spec, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_sizes_within_one() -> None:
    sizes = [len(p) for p in partition(LABELS[:3999], 7, "iid", seed=0)]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == 3999


def _mean_label_entropy(parts: list[np.ndarray]) -> float:
    entropies = []
    for p in parts:
        freq = np.bincount(LABELS[p], minlength=10) / len(p)
        freq = freq[freq > 0]
        entropies.append(float(-(freq * np.log(freq)).sum()))
    return float(np.mean(entropies))


def test_dirichlet_min_size_and_skew() -> None:
    iid = _mean_label_entropy(partition(LABELS, 16, "iid", seed=0))
    assert iid > 0.95 * np.log(10)
    skewed_parts = partition(LABELS, 16, "dirichlet:0.1", seed=0)
    assert min(len(p) for p in skewed_parts) >= 10
    skewed = _mean_label_entropy(skewed_parts)
    mild = _mean_label_entropy(partition(LABELS, 16, "dirichlet:100", seed=0))
    assert skewed < 0.6 * iid
    assert skewed < mild
    assert mild > 0.95 * iid


def test_dirichlet_min_size_is_configurable() -> None:
    parts = partition(LABELS, 8, "dirichlet:0.3", seed=1, min_size=200)
    assert min(len(p) for p in parts) >= 200


def test_dirichlet_over_thousands_of_peers_tops_up_the_short_parts() -> None:
    """3,000 peers, ALPHA 0.3, 30,000 samples: no draw gives every peer 5 samples, so the
    short parts are topped up from the largest; the parts still cover every sample once
    and stay skewed."""
    labels = np.repeat(np.arange(10), 3000)
    parts = partition(labels, 3000, "dirichlet:0.3", seed=0, min_size=5)
    assert min(len(p) for p in parts) >= 5
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    entropy = np.mean([
        -(f[f > 0] * np.log(f[f > 0])).sum()
        for f in (np.bincount(labels[p], minlength=10) / len(p) for p in parts)
    ])  # fmt: skip
    assert entropy < 0.6 * np.log(10)


def test_powerlaw_sizes_are_skewed_above_the_minimum() -> None:
    parts = partition(LABELS, 200, "powerlaw:1.5", seed=0, min_size=5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.sum() == len(LABELS)
    assert sizes.max() > 8 * np.median(sizes)  # a few peers hold much of the data
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    with pytest.raises(DataError, match="need 4000 samples"):
        partition(LABELS[:3999], 400, "powerlaw:1.5", seed=0)


@pytest.mark.parametrize(("peers", "spec"), [(4, "powerlaw:0.001"), (400, "powerlaw:0.01")])
def test_powerlaw_with_a_tiny_shape_still_splits_every_sample_once(peers: int, spec: str) -> None:
    """A small A overflows the Pareto weights to inf: the shares are taken in log space then
    (they were NaN, and the cut points garbage: samples handed out twice, peers left empty)."""
    parts = partition(LABELS, peers, spec, seed=0, min_size=5)
    assert min(len(p) for p in parts) >= 5
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_shards_few_labels_per_peer(k: int) -> None:
    parts = partition(LABELS, 10, f"shards:{k}", seed=0)
    assert [len(p) for p in parts] == [400] * 10  # 4000 / (10 k) per shard, k shards each
    for p in parts:
        assert len(np.unique(LABELS[p])) <= 2 * k
    if k == 1:  # shard = 400 = one class exactly
        assert all(len(np.unique(LABELS[p])) == 1 for p in parts)


def test_single_part_is_everything() -> None:
    for spec in SPECS:
        (only,) = partition(LABELS, 1, spec, seed=0)
        np.testing.assert_array_equal(only, np.arange(len(LABELS)))


@pytest.mark.parametrize(
    "spec",
    [
        "foo",
        "",
        "iid:3",
        "IID",
        "dirichlet",
        "dirichlet:",
        "dirichlet:0",
        "dirichlet:-1",
        "dirichlet:abc",
        "dirichlet:nan",
        "dirichlet:inf",
        "shards",
        "shards:0",
        "shards:-2",
        "shards:x",
        "shards:1.5",
        "powerlaw:0",
        "powerlaw:x",
    ],
)
def test_bad_specs(spec: str) -> None:
    with pytest.raises(DataError, match=re.escape(repr(spec))) as info:
        partition(LABELS, 4, spec, seed=0)
    assert all(form in str(info.value) for form in ("dirichlet:ALPHA", "shards:K", "powerlaw:A"))


@pytest.mark.parametrize(
    ("n", "spec", "message"),
    [
        (0, "iid", "n=0"),
        (-1, "iid", "n=-1"),
        (4001, "iid", "n=4001"),
        (2.5, "iid", "n=2.5"),
        (2001, "shards:2", "n*K=4002"),
        (401, "dirichlet:1", "need 4010 samples"),
    ],
)
def test_infeasible_partitions(n: int, spec: str, message: str) -> None:
    with pytest.raises(DataError, match=re.escape(message)):
        partition(LABELS, n, spec, seed=0)


def test_dirichlet_with_extreme_alpha_tops_up_instead_of_giving_up() -> None:
    """ALPHA 0.001 gives each class to one peer: 54 of 64 peers would hold nothing."""
    parts = partition(LABELS, 64, "dirichlet:0.001", seed=0)
    assert min(len(p) for p in parts) >= 10
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


def test_bad_labels_and_seed() -> None:
    with pytest.raises(DataError, match="1-D integer"):
        partition(np.zeros(10), 2, "iid", seed=0)
    with pytest.raises(DataError, match="seed"):
        partition(LABELS, 2, "iid", seed=-1)


@settings(max_examples=60, deadline=None)
@given(
    num=st.integers(20, 600),
    num_classes=st.integers(1, 12),
    n=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
    spec=st.one_of(
        st.just("iid"),
        st.floats(0.05, 1000).map(lambda a: f"dirichlet:{a}"),
        st.integers(1, 4).map(lambda k: f"shards:{k}"),
    ),
)
def test_partition_property_disjoint_complete(
    num: int, num_classes: int, n: int, seed: int, spec: str
) -> None:
    labels = np.random.default_rng(seed).integers(0, num_classes, num)
    try:
        parts = partition(labels, n, spec, seed=seed, min_size=1)
    except DataError:
        reject()  # infeasible n / K / ALPHA for this draw; covered by the error tests
    _check_disjoint_complete(parts, n, num)
    again = partition(labels, n, spec, seed=seed, min_size=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


# --------------------------------------------------------------------------- sampler


def test_sampler_shapes_and_dtypes() -> None:
    ds = load_dataset("digits")
    sampler = BatchSampler(ds.x_train, ds.y_train, 32, seed=0, device="cpu")
    x, y = sampler.next()
    assert x.shape == (32, 8, 8) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert y.shape == (32,) and y.dtype == torch.int64


def _labels_seen(sampler: BatchSampler, batches: int) -> np.ndarray:
    return torch.cat([sampler.next()[1] for _ in range(batches)]).numpy()


@pytest.mark.parametrize(("num", "batch"), [(10, 5), (10, 4), (10, 1), (3, 8), (7, 7)])
def test_sampler_covers_each_epoch_once(num: int, batch: int) -> None:
    x = np.arange(num, dtype=np.float32)[:, None]
    sampler = BatchSampler(x, np.arange(num), batch, seed=1)
    epochs = batch  # batch epochs of num samples = num whole batches
    seen = _labels_seen(sampler, num)
    assert len(seen) == epochs * num
    for e in range(epochs):
        np.testing.assert_array_equal(np.sort(seen[e * num : (e + 1) * num]), np.arange(num))
    assert sampler.epoch == epochs
    assert sampler.step == len(seen) // batch


def test_sampler_x_matches_y() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    xb, yb = BatchSampler(x, np.arange(10), 6, seed=0).next()
    np.testing.assert_array_equal(xb.numpy(), x[yb.numpy()])


def test_sampler_is_seeded_and_reshuffles() -> None:
    x, y = np.zeros((50, 1), np.float32), np.arange(50)
    a = _labels_seen(BatchSampler(x, y, 10, seed=5), 10)
    b = _labels_seen(BatchSampler(x, y, 10, seed=5), 10)
    c = _labels_seen(BatchSampler(x, y, 10, seed=6), 10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a[:50], a[50:])  # a new order every epoch


def test_sampler_iterates() -> None:
    sampler = BatchSampler(np.zeros((4, 1), np.float32), np.arange(4), 2, seed=0)
    batches = [b for _, b in zip(range(3), sampler, strict=False)]
    assert len(batches) == 3 and sampler.step == 3


def test_sampler_errors() -> None:
    x, y = np.zeros((4, 1), np.float32), np.arange(4)
    with pytest.raises(DataError, match="batch_size"):
        BatchSampler(x, y, 0, seed=0)
    with pytest.raises(DataError, match="empty"):
        BatchSampler(x[:0], y[:0], 2, seed=0)
    with pytest.raises(DataError, match="samples"):
        BatchSampler(x, y[:3], 2, seed=0)


def test_to_tensors_casts() -> None:
    xt, yt = to_tensors(np.zeros((2, 3), np.float64), np.array([1, 0], np.int32))
    assert xt.dtype == torch.float32 and yt.dtype == torch.int64


def test_samples_per_peer_generates_the_data_the_peers_need() -> None:
    from gossipdl.config import ConfigError, load_config
    from gossipdl.training import dataset_of

    config = load_config(None, peers=40, dataset="synthetic", samples_per_peer=50)
    data = dataset_of(config)
    assert (len(data.y_train), len(data.y_test), data.name) == (2000, 1000, "synthetic:2000")
    assert len(dataset_of(load_config(None, dataset="synthetic")).y_train) == 4000
    with pytest.raises(ConfigError, match="has a size of its own"):
        load_config(None, dataset="digits", samples_per_peer=10)
    with pytest.raises(ConfigError, match="samples_per_peer = 20000; synthetic generates at"):
        load_config(None, peers=400, dataset="synthetic", samples_per_peer=20000)  # named
    with pytest.raises(DataError, match="1 <= N <= 4,000,000"):
        dataset_of(load_config(None, dataset="synthetic:4000001"))
