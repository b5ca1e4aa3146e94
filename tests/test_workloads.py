"""Published data sets and the papers' models: tiny files written here in each published
format (CIFAR's binary records, LEAF's JSON) are read, split by owner and trained on; a
missing or corrupt file fails naming the file and the fetch command; ``gossipdl data
fetch`` checks what it downloads (from an HTTP server on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import io
import json
import re
import shlex
import signal
import socketserver
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from typer.testing import CliRunner

from gossipdl import cli
from gossipdl.config import load_config
from gossipdl.data import DataError, load_dataset, partition, published
from gossipdl.data.fetch import FetchError, Source, fetch
from gossipdl.data.loader import BatchSampler, crop_flip, evaluation_inputs, standardise
from gossipdl.data.published import SHAKESPEARE_LETTERS
from gossipdl.experiments.display import summary_table
from gossipdl.experiments.simulated import simulate
from gossipdl.models import ModelError, build_model
from gossipdl.rundir import RunDir
from gossipdl.sim.batched import BatchedSimulation
from gossipdl.training import (
    dataset_of,
    evaluate,
    initial_model,
    own_test,
    peer_sampler,
    shard_for,
)

RNG = np.random.default_rng(0)
CIFAR10_PER_FILE, CIFAR100_TRAIN, CIFAR100_TEST = 12, 20, 5


@pytest.fixture(autouse=True)
def tiny_cifar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny CIFAR files written here stand for the published ones: the reader expects
    their record counts."""
    counts = {"cifar10": (CIFAR10_PER_FILE,) * 6, "cifar100": (CIFAR100_TRAIN, CIFAR100_TEST)}
    monkeypatch.setattr(published, "CIFAR_RECORDS", counts)


def cifar_file(path: Path, count: int, label_bytes: int = 1, classes: int = 10) -> np.ndarray:
    """``count`` records of random pixels in CIFAR's binary format; their class labels."""
    labels = RNG.integers(0, classes, count)
    rows = np.empty((count, label_bytes + 3072), np.uint8)
    rows[:, :label_bytes] = labels[:, None] // 5 if label_bytes == 2 else labels[:, None]
    rows[:, label_bytes - 1] = labels
    rows[:, label_bytes:] = RNG.integers(0, 256, (count, 3072))
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.tofile(path)
    return labels


def cifar10(root: Path) -> list[np.ndarray]:
    folder = root / "cifar-10-batches-bin"
    files = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    return [cifar_file(folder / f, CIFAR10_PER_FILE) for f in files]


def leaf(root: Path, name: str, users: int = 4, per_user: int = 10) -> None:
    """LEAF JSON for ``users`` writers/speakers, split over two files per split."""
    for split, count in (("train", per_user), ("test", 3)):
        folder = root / name / split
        folder.mkdir(parents=True, exist_ok=True)
        for part in range(2):
            names = [f"u{part}{i}" for i in range(users // 2)]
            data = {}
            for u in names:
                if name == "femnist":
                    x = RNG.random((count, 784)).round(3).tolist()
                    y = RNG.integers(0, 62, count).tolist()
                else:
                    chars = RNG.choice(list(SHAKESPEARE_LETTERS), (count, 81))
                    x, y = ["".join(c[:80]) for c in chars], [str(c[80]) for c in chars]
                data[u] = {"x": x, "y": y}
            doc = {"users": names, "num_samples": [count] * len(names), "user_data": data}
            (folder / f"all_data_{part}.json").write_text(json.dumps(doc))


def one_step(model_name: str, dataset_name: str, data_dir: Path) -> float:
    """One SGD step of ``model_name`` on a batch of the data set; the loss, which fell."""
    data = load_dataset(dataset_name, data_dir)
    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_classes)
    sampler = BatchSampler(
        data.x_train, data.y_train, 8, seed=0, augment=data.augment, pixels=data.pixels
    )
    x, y = sampler.next()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    losses = []
    for _ in range(3):  # the same batch: its loss must fall
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], (model_name, losses)
    return losses[0]


def test_cifar10_binary_files_load_standardised_and_train_resnet20_and_vgg11(
    tmp_path: Path,
) -> None:
    labels = cifar10(tmp_path)
    data = load_dataset("cifar10", tmp_path)
    assert data.x_train.shape == (60, 3, 32, 32) and data.x_test.shape == (12, 3, 32, 32)
    assert np.array_equal(data.y_train, np.concatenate(labels[:5]))
    assert np.array_equal(data.y_test, labels[5])
    assert data.augment == "crop-flip"
    # Kept as the file's bytes (a quarter of float32's memory), standardised where used.
    raw = np.fromfile(tmp_path / "cifar-10-batches-bin" / "data_batch_1.bin", np.uint8)
    red = raw[1 : 1 + 1024]  # the first image's red channel
    assert data.x_train.dtype == np.uint8 and np.array_equal(data.x_train[0, 0].ravel(), red)
    first = standardise(torch.from_numpy(data.x_train[:1]), data.pixels)[0, 0].reshape(-1)
    np.testing.assert_allclose(first.numpy(), (red / 255 - 0.4914) / 0.2470, rtol=1e-5)
    inputs = evaluation_inputs(data)
    assert inputs.dtype == torch.float32 and abs(float(inputs.mean())) < 1.0
    # The sampler crops, then standardises: the padding is black pixels, as the papers'
    # RandomCrop + Normalize have it (white images: any other value is padding).
    white = np.full((64, 3, 32, 32), 255, np.uint8)
    x, _ = BatchSampler(white, np.zeros(64, np.int64), 64, 0, augment="crop-flip",
                        pixels=data.pixels).next()  # fmt: skip
    values = set(x[:, 0].unique().double().numpy().round(4).tolist())
    assert values == {round((1 - 0.4914) / 0.2470, 4), round((0 - 0.4914) / 0.2470, 4)}
    for model in ("resnet20", "vgg11"):
        one_step(model, "cifar10", tmp_path)


def test_cifar100_takes_the_fine_label(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-binary"
    train = cifar_file(folder / "train.bin", CIFAR100_TRAIN, label_bytes=2, classes=100)
    cifar_file(folder / "test.bin", CIFAR100_TEST, label_bytes=2, classes=100)
    data = load_dataset("cifar100", tmp_path)
    assert data.num_classes == 100 and np.array_equal(data.y_train, train)


@pytest.mark.parametrize("damage", ["missing", "truncated", "a record short", "label"])
def test_a_missing_or_corrupt_cifar_file_names_itself_and_the_fetch_command(
    tmp_path: Path, damage: str
) -> None:
    cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "a record short":  # whole records, but not the published number
        path.write_bytes(path.read_bytes()[:-3073])
    else:
        raw = bytearray(path.read_bytes())
        raw[0] = 200  # a class CIFAR-10 does not have
        path.write_bytes(bytes(raw))
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path)
    text = str(info.value)
    assert str(path) in text and f"gossipdl data fetch cifar10 --data-dir {tmp_path}" in text


def test_a_run_without_the_data_fails_before_any_peer_starts(tmp_path: Path) -> None:
    done = CliRunner().invoke(
        cli.app,
        ["run", "--dataset", "cifar10", "--model", "resnet20", "--data-dir",
         str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--no-progress"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert done.exit_code == 2
    text = " ".join(done.stderr.split())
    assert "data_batch_1.bin is missing" in text and "gossipdl data fetch cifar10" in text
    assert not (tmp_path / "run").exists()  # checked before anything was made
    simulated = CliRunner().invoke(
        cli.app,
        ["simulate", "--dataset", "femnist", "--model", "leaf-cnn", "--data-dir",
         str(tmp_path / "none"), "--out", str(tmp_path / "sim")],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert simulated.exit_code == 2, simulated.output
    assert "gossipdl data fetch femnist" in " ".join(simulated.stderr.split())
    assert not (tmp_path / "sim").exists()


def test_leaf_json_splits_naturally_by_writer_and_trains_the_leaf_models(tmp_path: Path) -> None:
    leaf(tmp_path, "femnist")
    data = load_dataset("femnist", tmp_path)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 62
    assert data.owners_train is not None and len(np.unique(data.owners_train)) == 4
    parts = partition(data.y_train, 4, "natural", seed=1, owners=data.owners_train)
    assert sorted(len(np.unique(data.owners_train[p])) for p in parts) == [1, 1, 1, 1]
    assert sorted(len(p) for p in parts) == [10] * 4
    two = partition(data.y_train, 2, "natural", seed=1, owners=data.owners_train)
    assert [len(np.unique(data.owners_train[p])) for p in two] == [2, 2]
    with pytest.raises(DataError, match="4 owners cannot fill 5 parts"):
        partition(data.y_train, 5, "natural", seed=1, owners=data.owners_train)
    for model in ("leaf-cnn", "lenet5"):
        one_step(model, "femnist", tmp_path)
    leaf(tmp_path, "shakespeare")
    text = load_dataset("shakespeare", tmp_path)
    assert text.input_shape == (80,) and text.num_classes == len(SHAKESPEARE_LETTERS)
    one_step("leaf-lstm", "shakespeare", tmp_path)


def assert_own_accuracy_is_on_own_owners(config: Any, summary: dict[str, Any]) -> None:
    """Each peer's final ``accuracy`` is its saved model's on the whole test set, and its
    ``own_accuracy`` that model's on the test samples of the owners (writers, devices) of
    its training shard alone."""
    data = dataset_of(config)
    x, y = evaluation_inputs(data), torch.from_numpy(data.y_test)
    run = RunDir(config.out)
    assert data.owners_train is not None and data.owners_test is not None
    for peer in summary["peers"]:
        own = own_test(config, data, peer["id"])
        assert own is not None and len(own) > 0
        shard = shard_for(config, data, peer["id"])
        assert set(data.owners_test[own]) == set(data.owners_train[shard])
        assert set(np.flatnonzero(np.isin(data.owners_test, data.owners_train[shard]))) == set(own)
        model = initial_model(config, data)  # the peer's final model, evaluated here again
        model.load_state_dict(torch.load(run.model(peer["id"]), weights_only=True))
        assert peer["accuracy"] == pytest.approx(evaluate(model, x, y)[0], abs=1e-6)
        assert peer["own_accuracy"] == pytest.approx(evaluate(model, x[own], y[own])[0], abs=1e-6)


def test_a_natural_swarm_reports_each_devices_accuracy_on_its_own_data(tmp_path: Path) -> None:
    """Four simulated peers, a writer each: every peer's metrics carry ``own_accuracy``, on
    its writer's test samples alone (each writer writes a letter of its own here, so that
    differs from the accuracy on every writer's)."""
    leaf(tmp_path / "data", "femnist")
    for path in (tmp_path / "data" / "femnist").glob("*/all_data_*.json"):
        edit_leaf(path, one_letter_per_writer)
    config = load_config(
        None, peers=4, steps=6, dataset="femnist", data_dir=str(tmp_path / "data"),
        model="lenet5", partition="natural", eval_every=0, threads=1, out=str(tmp_path / "run"),
    )  # fmt: skip
    summary = simulate(config, step_time=0.01)
    data = dataset_of(config)
    for peer in summary["peers"]:
        own = own_test(config, data, peer["id"])
        assert own is not None and len(own) == 3  # one writer's 3 test samples
    assert_own_accuracy_is_on_own_owners(config, summary)
    assert any(p["own_accuracy"] != p["accuracy"] for p in summary["peers"])
    own = sorted(p["own_accuracy"] for p in summary["peers"])
    assert (summary["min_own_accuracy"], summary["max_own_accuracy"]) == (own[0], own[-1])
    assert summary["mean_own_accuracy"] == pytest.approx(sum(own) / len(own))
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    shown = console.export_text()
    assert "own-data acc" in shown and f"own-data accuracy {sum(own) / len(own):.4f}" in shown
    with pytest.raises(DataError, match=r"natural.*owners"):
        partition(np.zeros(10, np.int64), 2, "natural", seed=0)


def test_batched_and_per_peer_engines_agree_on_each_devices_own_accuracy(tmp_path: Path) -> None:
    """Synthetic(α, β) by device on both simulators: the same own_accuracy per peer."""
    finals = {}
    for batched in (False, True):
        config = load_config(
            None, peers=6, steps=20, dataset="synthetic-fedprox:1:1:6", model="logistic",
            partition="natural", eval_every=0, threads=1, batched=batched,
            out=str(tmp_path / str(batched)),
        )  # fmt: skip
        summary = simulate(config, step_time=0.01)
        assert_own_accuracy_is_on_own_owners(config, summary)
        finals[batched] = {p["id"]: p["own_accuracy"] for p in summary["peers"]}
        assert any(p["own_accuracy"] != p["accuracy"] for p in summary["peers"])
    assert finals[True] == pytest.approx(finals[False], abs=1e-6)
    assert len(set(finals[True].values())) > 1  # each device its own


def test_batched_peers_crop_and_mirror_cifar_batches_as_the_per_peer_engine_does(
    tmp_path: Path,
) -> None:
    """The batched simulator gives each peer the augmented batches ``peer_sampler`` gives it
    (it trained on plain images)."""
    cifar10(tmp_path)
    config = load_config(
        None, peers=2, steps=2, dataset="cifar10", data_dir=str(tmp_path), model="logistic",
        algorithm="dense", batch_size=8, threads=1, batched=True, out=str(tmp_path / "run"),
    )  # fmt: skip
    sim = BatchedSimulation(config, RunDir(tmp_path / "run").create(), step_time=0.01)
    samplers = [peer_sampler(config, dataset_of(config), peer) for peer in range(2)]
    for _ in range(2):
        x, labels = sim.batches()
        for peer, sampler in enumerate(samplers):
            want_x, want_labels = sampler.next()
            assert torch.equal(x[peer], want_x) and torch.equal(labels[peer], want_labels)


def test_corrupt_leaf_files_name_themselves(tmp_path: Path) -> None:
    """Arrays nested deeper than json's parser recurses escaped as a RecursionError."""
    leaf(tmp_path, "femnist")
    bad = tmp_path / "femnist" / "test" / "all_data_1.json"
    for text in ('{"users": ["a"]', "[" * 100_000):
        bad.write_text(text)
        with pytest.raises(DataError, match=rf"{bad}.*not LEAF's JSON.*data fetch femnist"):
            load_dataset("femnist", tmp_path)
    with pytest.raises(DataError, match=r"no train files.*gossipdl data fetch shakespeare"):
        load_dataset("shakespeare", tmp_path)


def edit_leaf(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the LEAF JSON document at ``path``."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def one_letter_per_writer(doc: dict[str, Any]) -> None:
    """Every sample of a writer labelled with one class, the writer's own (u10: class 10)."""
    for user, samples in doc["user_data"].items():
        samples["y"] = [int(user[1:])] * len(samples["y"])


def first_user(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["user_data"][doc["users"][0]]


def halve_texts(doc: dict[str, Any]) -> None:
    """Every sample 40 characters: an even count of them once read as 80-character rows."""
    for user in doc["user_data"].values():
        user["x"] = [text[:40] for text in user["x"]]


@pytest.mark.parametrize(
    ("name", "change", "error"),
    [
        ("femnist", lambda d: d["users"].append(d["users"][0]), "lists a user twice"),
        ("femnist", lambda d: d["users"].append("u10"), r"user 'u10' is in both .*all_data_1"),
        ("femnist", lambda d: first_user(d)["x"][0].__setitem__(5, float("nan")), "784 finite"),
        ("femnist", lambda d: first_user(d)["x"][0].pop(), "784 finite"),
        ("femnist", lambda d: first_user(d)["x"][0].__setitem__(5, 10**400), "784 finite"),
        ("femnist", lambda d: first_user(d)["y"].__setitem__(0, 10**29), r"label .* 0\.\.61"),
        ("femnist", lambda d: first_user(d)["y"].__setitem__(0, 2.5), r"label .* 0\.\.61"),
        # refused when met: the bad entry after it is never looked at (nor paid for)
        ("femnist", lambda d: d["users"].extend([d["users"][0], 5]), "lists a user twice"),
        ("shakespeare", lambda d: halve_texts(d), "80 characters"),
    ],
)
def test_leaf_files_with_a_repeated_user_or_a_bad_sample_are_refused_naming_the_file(
    tmp_path: Path, name: str, change: Callable[[dict[str, Any]], None], error: str
) -> None:
    """A user listed twice (in one file or two) doubled its samples; a NaN pixel or a sample
    of the wrong length failed later, naming no file; a number too large for its type
    (a 401-digit pixel, a label of 10**29) escaped as an OverflowError."""
    leaf(tmp_path, name)
    user_data = tmp_path / name / "train" / "all_data_0.json"
    if "in both" in error:  # u10 is all_data_1's: list it in all_data_0 too, with samples
        other = json.loads((tmp_path / name / "train" / "all_data_1.json").read_text())
        edit_leaf(user_data, lambda d: d["user_data"].update(u10=other["user_data"]["u10"]))
    edit_leaf(user_data, change)
    with pytest.raises(DataError, match=rf"{name}: .*{error}") as info:
        load_dataset(name, tmp_path)
    assert str(tmp_path / name / "train") in str(info.value)
    assert f"gossipdl data fetch {name}" in str(info.value)


def test_a_leaf_file_over_the_size_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """json.load read a file of any size, holding several times it in memory."""
    leaf(tmp_path, "femnist")
    limit = max(f.stat().st_size for f in (tmp_path / "femnist").rglob("*.json"))
    big = tmp_path / "femnist" / "train" / "all_data_1.json"
    big.write_text(big.read_text().ljust(limit + 1))  # one byte over the limit
    monkeypatch.setattr(published, "LEAF_FILE_LIMIT", limit)
    loads, load = [], json.load
    monkeypatch.setattr(published.json, "load", lambda f: loads.append(f.name) or load(f))
    with pytest.raises(DataError, match=rf"{big} holds .* bytes, more than a LEAF file may"):
        load_dataset("femnist", tmp_path)
    assert str(big) not in loads


@pytest.mark.parametrize("name", ["femnist", "shakespeare"])
def test_a_leaf_file_without_users_adds_no_samples_and_a_split_without_any_is_refused(
    tmp_path: Path, name: str
) -> None:
    """FEMNIST refused an empty file as 'a sample is not 784 finite numbers', while the
    Shakespeare reader took it."""
    leaf(tmp_path, name)
    empty = {"users": [], "num_samples": [], "user_data": {}}
    (tmp_path / name / "train" / "all_data_2.json").write_text(json.dumps(empty))
    assert load_dataset(name, tmp_path).num_train == 4 * 10
    for part in range(2):
        (tmp_path / name / "test" / f"all_data_{part}.json").write_text(json.dumps(empty))
    with pytest.raises(DataError, match=rf"the test files in {tmp_path / name / 'test'} hold no"):
        load_dataset(name, tmp_path)


def test_fedprox_synthetic_is_generated_by_device() -> None:
    data = load_dataset("synthetic-fedprox:0.5:0.5:12")
    again = load_dataset("synthetic-fedprox:0.5:0.5:12")
    assert np.array_equal(data.x_train, again.x_train) and data.input_shape == (60,)
    assert data.owners_train is not None and set(np.unique(data.owners_train)) == set(range(12))
    counts = np.bincount(data.owners_train)
    assert counts.min() >= 45 and counts.max() > 2 * counts.min()  # lognormal sizes
    with pytest.raises(DataError, match="synthetic-fedprox:ALPHA:BETA"):
        load_dataset("synthetic-fedprox:1")


def test_fedprox_beta_shifts_all_of_a_devices_features_by_one_draw() -> None:
    """B_k is one number per device (FedProx's generator): with a large β every feature's
    mean on a device moves with it, so the features' means agree across devices (they were
    drawn one per feature, and did not)."""
    data = load_dataset("synthetic-fedprox:0:100:40")
    assert data.owners_train is not None
    means = np.stack([data.x_train[data.owners_train == k].mean(0) for k in range(40)])
    agreement = np.corrcoef(means.T)[np.triu_indices(means.shape[1], 1)]
    assert agreement.mean() > 0.9


def test_crop_flip_shifts_and_mirrors_each_image_by_its_own_draw() -> None:
    """Every output image is a window of the zero-padded image, maybe mirrored; the draws
    differ between images and repeat with the seed."""
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6) + 1
    padded = F.pad(x, (2, 2, 2, 2))
    windows = [
        w.flip(-1) if mirror else w
        for dy in range(5) for dx in range(5) for mirror in (False, True)
        for w in [padded[:, :, dy : dy + 6, dx : dx + 6]]
    ]  # fmt: skip
    seen = set()
    for seed in range(30):
        out = crop_flip(x, torch.Generator().manual_seed(seed), pad=2)
        assert torch.equal(out, crop_flip(x, torch.Generator().manual_seed(seed), pad=2))
        for image in range(2):
            found = [k for k, w in enumerate(windows) if torch.equal(out[image], w[image])]
            assert found, (seed, image)
            seen.add(found[0])
    assert len(seen) > 20 and any(k % 2 for k in seen)  # many offsets, mirrored ones too


def test_the_papers_models_refuse_shapes_and_widths_they_do_not_take() -> None:
    with pytest.raises(ModelError, match=r"resnet20.*32"):
        build_model("resnet20", (1, 28, 28), 10)
    with pytest.raises(ModelError, match="paper's widths"):
        build_model("vgg11", (3, 32, 32), 10, hidden=[64])
    with pytest.raises(ModelError, match="leaf-lstm"):
        build_model("leaf-lstm", (1, 28, 28), 62)


@contextlib.contextmanager
def http_server(handler: type[socketserver.BaseRequestHandler]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering with ``handler``, in a thread; its URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on 127.0.0.1 serving ``tmp_path/www``."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    with http_server(Quiet) as url:
        yield url, root


def tiny_archive(path: Path, members: dict[str, bytes]) -> Source:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = path.read_bytes()
    needed = tuple((n, len(d)) for n, d in members.items() if not n.startswith(".."))
    return Source("", hashlib.md5(blob).hexdigest(), len(blob), needed)


def test_fetch_checks_the_download_and_keeps_only_the_files_it_needs(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    url, www = server
    members = {"cifar-10-batches-bin/test_batch.bin": bytes(3073 * 2), "../evil": b"x",
               "cifar-10-batches-bin/readme.html": b"<p>"}  # fmt: skip
    source = tiny_archive(www / "c.tar.gz", members)
    data_dir = tmp_path / "data"
    kept = fetch("cifar10", data_dir, Source(f"{url}/c.tar.gz", source.md5, source.size,
                                             source.members[:1]), progress=False)  # fmt: skip
    assert kept == [data_dir / "cifar-10-batches-bin" / "test_batch.bin"]
    assert sorted(p.name for p in data_dir.rglob("*")) == ["cifar-10-batches-bin", "test_batch.bin"]
    assert not (tmp_path / "evil").exists()
    wrong = Source(f"{url}/c.tar.gz", "0" * 32, source.size, source.members[:1])
    with pytest.raises(FetchError, match=r"not the published .* MD5 0{32}; nothing was kept"):
        fetch("cifar10", tmp_path / "other", wrong, progress=False)
    assert list((tmp_path / "other").iterdir()) == []
    short = Source(f"{url}/c.tar.gz", source.md5, source.size - 10, source.members[:1])
    with pytest.raises(FetchError, match="more than the published"):
        fetch("cifar10", tmp_path / "short", short, progress=False)
    with pytest.raises(FetchError, match=r"download of .* failed"):
        fetch("cifar10", tmp_path / "gone", Source(f"{url}/nope", "", 1, ()), progress=False)


def test_the_fetch_command_refuses_a_mirror_that_changed_the_file(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    url, www = server
    (www / "cifar.tar.gz").write_bytes(b"not the archive")
    runner = CliRunner()
    done = runner.invoke(
        cli.app,
        ["data", "fetch", "cifar10", "--data-dir", str(tmp_path / "d"), "--url",
         f"{url}/cifar.tar.gz"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    text = " ".join(done.stderr.split())
    assert done.exit_code == 2 and "c32a1d4ab5d03f1284b67883e8d87530" in text
    assert list((tmp_path / "d").iterdir()) == []
    leafed = runner.invoke(cli.app, ["data", "fetch", "femnist"], env={"COLUMNS": "200"})
    assert leafed.exit_code == 2 and "preprocess.sh" in leafed.stderr


def replying(reply: bytes) -> type[socketserver.StreamRequestHandler]:
    """A handler that reads a request's head and answers ``reply``, whatever that is."""

    class Raw(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            self.wfile.write(reply)

    return Raw


def stalled(
    blob: bytes, requested: threading.Event, go: threading.Event
) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler that announces all of ``blob``, sends its first half, sets ``requested``
    and sends the rest only once ``go`` is set."""

    class Stalled(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob[: len(blob) // 2])
            self.wfile.flush()
            requested.set()
            go.wait(60)
            with contextlib.suppress(OSError):  # the client may be gone
                self.wfile.write(blob[len(blob) // 2 :])

        def log_message(self, *args: object) -> None:
            pass

    return Stalled


def files_in(folder: Path) -> list[str]:
    """The files under ``folder``, relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


MEMBER = "cifar-10-batches-bin/test_batch.bin"


def test_a_bad_mirror_or_url_is_a_fetch_error_naming_the_url(tmp_path: Path) -> None:
    """http.client's errors (not an HTTP server, a chunked body cut short or malformed, a
    bad port) and urllib's ValueError for a malformed URL escaped as tracebacks."""
    replies = (
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    )
    with contextlib.ExitStack() as servers:
        urls = [servers.enter_context(http_server(replying(r))) + "/c.tar.gz" for r in replies]
        for url in [*urls, "http://127.0.0.1:80a/c.tar.gz", "http://[::1/c.tar.gz"]:
            with pytest.raises(FetchError, match=rf"download of {re.escape(url)} failed .*URL"):
                fetch("cifar10", tmp_path, Source(url, "", 1 << 20, ()), progress=False)
    assert files_in(tmp_path) == []


def test_a_fetch_that_cannot_write_says_where_and_why_and_leaves_nothing(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    """A full disk while the archive streamed in or a member was written escaped as a raw
    OSError and left the member's .part file; a --data-dir naming a file, as a
    FileExistsError. A file-size limit fails writes as a full disk does, in a process of
    its own (here: first the archive's, then the member's)."""
    url, www = server
    archive = tiny_archive(www / "c.tar.gz", {MEMBER: bytes(1 << 20)})
    source = dataclasses.replace(archive, url=f"{url}/c.tar.gz")
    a_file = tmp_path / "a file"
    a_file.write_text("x")
    with pytest.raises(FetchError, match=rf"cannot write its files in {a_file}: it is not a dir"):
        fetch("cifar10", a_file, source, progress=False)
    data_dir = tmp_path / "data"
    limits = [archive.size // 2, 64 << 10]  # under the archive's size, then the member's
    child = (
        "import dataclasses, resource, sys\n"
        "from gossipdl.data.fetch import FetchError, Source, fetch\n"
        f"source = Source({source.url!r}, {source.md5!r}, {source.size}, {source.members!r})\n"
        f"for limit in {limits}:\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))\n"
        "    try:\n"
        f"        fetch('cifar10', {str(data_dir)!r}, source, progress=False)\n"
        "    except FetchError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert f"cannot write its files in {data_dir}: File too large" in line, line
    assert files_in(data_dir) == []


class Interrupting(tarfile.ExFileObject):
    """A member's reader that is interrupted (Ctrl-C) after its first block."""

    def read(self, size: int | None = -1) -> bytes:
        if self.tell():
            raise KeyboardInterrupt
        return super().read(size)


def test_ctrl_c_while_a_member_is_written_leaves_no_part_file(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member's .part file had no cleanup: Ctrl-C left it in the data directory."""
    url, www = server
    source = tiny_archive(www / "c.tar.gz", {MEMBER: bytes(3 << 20)})
    monkeypatch.setattr(tarfile.TarFile, "fileobject", Interrupting)
    data_dir = tmp_path / "data"
    source = dataclasses.replace(source, url=f"{url}/c.tar.gz")
    with pytest.raises(KeyboardInterrupt):
        fetch("cifar10", data_dir, source, progress=False)
    assert files_in(data_dir) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_fetch_command_with_nothing_left(tmp_path: Path, signum: int) -> None:
    """SIGTERM killed the command, which had no handler for it, leaving its (up to 170 MB)
    download in the data directory; now it unwinds as Ctrl-C does: exit 128 + the signal."""
    requested, go = threading.Event(), threading.Event()
    data_dir = tmp_path / "d"
    with http_server(stalled(bytes(1 << 20), requested, go)) as url:
        command = ["data", "fetch", "cifar10", "--data-dir", str(data_dir), "--url", url]
        proc = subprocess.Popen(
            [sys.executable, "-m", "gossipdl", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert requested.wait(60), "the command never asked for the archive"
            proc.send_signal(signum)
            _, stderr = proc.communicate(timeout=30)
        finally:
            go.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    assert files_in(data_dir) == []


def test_two_fetches_into_one_directory_do_not_share_a_download(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    """Both streamed into .cifar10.download: the second truncated the first's file and
    deleted it, and the first failed after its whole download on a file that was gone."""
    url, www = server
    data = RNG.integers(0, 256, 3073 * 100, dtype=np.uint8).tobytes()
    source = tiny_archive(www / "c.tar.gz", {MEMBER: data})
    requested, go = threading.Event(), threading.Event()
    data_dir, outcome = tmp_path / "data", {}

    def first(slow: str) -> None:
        try:
            fresh = dataclasses.replace(source, url=slow)
            outcome["kept"] = fetch("cifar10", data_dir, fresh, progress=False)
        except BaseException as exc:  # reported below, with the test's failure
            outcome["kept"] = exc

    blob = (www / "c.tar.gz").read_bytes()
    with http_server(stalled(blob, requested, go)) as slow_url:
        thread = threading.Thread(target=first, args=(f"{slow_url}/c.tar.gz",))
        thread.start()
        assert requested.wait(30), "the first fetch never asked for the archive"
        fast = dataclasses.replace(source, url=f"{url}/c.tar.gz")
        second = fetch("cifar10", data_dir, fast, progress=False)
        go.set()
        thread.join(60)
    assert outcome["kept"] == second == [data_dir / MEMBER]
    assert (data_dir / MEMBER).read_bytes() == data and files_in(data_dir) == [MEMBER]


def test_the_fetch_commands_progress_bar_goes_to_the_terminal_it_was_shown_for(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command showed the bar when stderr was a terminal but drew it on stdout, so
    `gossipdl data fetch cifar10 > log` put the bar into the log."""
    url, www = server
    (www / "c.tar.gz").write_bytes(b"not the archive")
    terminal = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=terminal, force_terminal=True, width=100))
    done = CliRunner().invoke(
        cli.app,
        ["data", "fetch", "cifar10", "--data-dir", str(tmp_path), "--url", f"{url}/c.tar.gz"],
    )
    assert done.exit_code == 2 and done.stdout == ""
    assert "━" in terminal.getvalue()  # the bar


def test_a_data_dir_with_a_tilde_or_a_space_is_the_folder_the_fetch_hint_names(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file's data_dir = "~/cdata" was read as ./~/cdata while the error's fetch
    command, expanded by the shell, wrote to ~/cdata; a folder with a space got an unquoted
    --data-dir."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cifar10(tmp_path / "c data")
    config = tmp_path / "config.toml"
    config.write_text('dataset = "cifar10"\ndata_dir = "~/c data"\n')
    assert dataset_of(load_config(config)).num_train == 5 * CIFAR10_PER_FILE
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", "~/no data")
    command = shlex.split(str(info.value).split("`")[1])
    assert command[-2:] == ["--data-dir", str(tmp_path / "no data")]
    url, www = server
    source = tiny_archive(www / "c.tar.gz", {MEMBER: bytes(3073 * 2)})
    source = dataclasses.replace(source, url=f"{url}/c.tar.gz")
    kept = fetch("cifar10", "~/fetched", source, progress=False)
    assert kept == [tmp_path / "fetched" / MEMBER]
