"""What both engines do the same way around the protocol: a peer's starting model, optimizer,
learning rate, batches and evaluation, and the lines it writes to ``peers/<id>.jsonl``."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gossipdl.averaging import Averager, build_averager, parse_trigger
from gossipdl.averaging.attacks import Attack, flip_labels, in_swarm, parse_attack
from gossipdl.averaging.local_optimizer import SGD, LocalOptimizer
from gossipdl.conditions import Drift, parse_drift, parse_profiles
from gossipdl.config import Config
from gossipdl.data import BatchSampler, Dataset, load_dataset, partition
from gossipdl.models import build_model
from gossipdl.protocol.ps_server import ShardServer, fedavg_local_steps, fedavg_rounds
from gossipdl.protocol.ps_worker import WorkerSettings
from gossipdl.protocol.ring import chunk_bounds
from gossipdl.rundir import CARRIED, dumps, temporary_beside

AWAY_POLL_S = 0.25  # how often a device inside an offline window looks again (and logs)


def dataset_of(config: Config) -> Dataset:
    """The config's data set: ``dataset``, generated with ``samples_per_peer`` training
    samples per peer when that is set (the same data on every peer, from one recipe); a
    published one read from ``data_dir``."""
    if config.samples_per_peer:
        return load_dataset(f"{config.dataset}:{config.samples_per_peer * config.peers}")
    return load_dataset(config.dataset, config.data_dir or None)


def initial_model(config: Config, dataset: Dataset) -> torch.nn.Module:
    """The swarm's starting model, the same on every peer: built right after seeding torch
    with the config's seed."""
    torch.manual_seed(config.seed)
    return build_model(
        config.model, dataset.input_shape, dataset.num_classes, list(config.hidden) or None
    )


def peer_sampler(
    config: Config,
    dataset: Dataset,
    peer_id: int,
    step: int = 0,
    device: torch.device | str = "cpu",
) -> BatchSampler:
    """Peer ``peer_id``'s batches from its shard, drawn from local step ``step`` on (a peer
    resumed at a later step draws anew); mode single takes every peer's batch at once."""
    shard = shard_for(config, dataset, peer_id)
    batch = config.batch_size * (config.peers if config.mode == "single" else 1)
    seed = sampler_seed(config, peer_id, step)
    labels = dataset.y_train[shard]
    attack = byzantine_of(config, peer_id) if config.mode == "gossip" else None
    if attack is not None and attack.name == "label-flip":  # trains honestly on lies
        labels = flip_labels(labels, dataset.num_classes)
    return BatchSampler(
        dataset.x_train[shard], labels, batch, seed, device, dataset.augment, dataset.pixels
    )


def sampler_seed(config: Config, peer_id: int, step: int = 0) -> int:
    """The seed of peer ``peer_id``'s batch order from local step ``step`` on (both
    simulators and the real peers draw the same batches)."""
    return config.seed + 1000 + peer_id + 7919 * step


def local_gradients(
    config: Config,
    model: torch.nn.Module,
    optimizer: LocalOptimizer,
    sampler: BatchSampler,
    step: int,
) -> torch.Tensor:
    """One local step's compute, before its optimizer step: the learning rate of ``step``, a
    batch, and its loss's gradients; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(config, step)
    x, y = sampler.next()
    for group in optimizer.param_groups:  # zero_grad(set_to_none=True), without its profiler
        for p in group["params"]:  # scope: a swarm of small models makes it count
            p.grad = None
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def evaluation(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, own: torch.Tensor | None = None
) -> dict[str, float]:
    """``accuracy`` and ``test_loss`` over the held-out set, rounded as a metrics line holds
    them; with ``own`` (the indices of the peer's own owners' test samples, a natural
    split's), also ``own_accuracy`` on those alone: the device's accuracy on its data."""
    accuracy, test_loss = evaluate(model, x, y)
    out = {"accuracy": round(accuracy, 6), "test_loss": round(test_loss, 6)}
    if own is not None and len(own):
        out["own_accuracy"] = round(evaluate(model, x[own], y[own])[0], 6)
    return out


def own_test(config: Config, dataset: Dataset, peer_id: int) -> np.ndarray | None:
    """The test samples of the owners whose training samples peer ``peer_id`` holds, in a
    natural split (None in any other: its test set is everybody's)."""
    if config.partition != "natural" or config.mode == "single" or dataset.owners_test is None:
        return None
    assert dataset.owners_train is not None
    mine = np.unique(dataset.owners_train[shard_for(config, dataset, peer_id)])
    return np.flatnonzero(np.isin(dataset.owners_test, mine))


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy over the whole held-out set."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), 1024):
        logits = model(x[i : i + 1024])
        loss += F.cross_entropy(logits, y[i : i + 1024], reduction="sum").item()
        correct += int((logits.argmax(1) == y[i : i + 1024]).sum())
    model.train()
    return correct / len(y), loss / len(y)


def make_optimizer(config: Config, model: torch.nn.Module) -> LocalOptimizer:
    """The optimizer the config names: gossipdl's :class:`SGD` (``torch.optim.SGD``'s steps,
    without importing ``torch._dynamo``), or ``torch.optim.Adam``."""
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def lr_at(config: Config, step: int) -> float:
    """The learning rate for local step ``step`` (from 0): a function of the step alone, so a
    resumed peer picks up where it left off.

    ``cosine`` anneals from ``lr`` to 0 over ``steps`` (Loshchilov and Hutter 2017).

    Example:
        >>> lr_at(Config(lr=0.1, steps=100, lr_schedule="cosine"), 50)
        0.05
    """
    if config.lr_schedule == "cosine":
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))
    return config.lr


def shard_server(config: Config, dataset: Dataset, shard: int) -> ShardServer:
    """Parameter-server shard ``shard`` of ``config``'s run: its slice of the swarm's starting
    model, the run's rule, and FedAvg's rounds sized by the workers' shards of the data."""
    flat = torch.nn.utils.parameters_to_vector(initial_model(config, dataset).parameters())
    a, b = chunk_bounds(flat.numel(), config.ps_shards)[shard]
    sizes = [len(p) for p in parts_of(config, dataset)]
    return ShardServer(
        flat.detach()[a:b],
        rule=config.ps,
        workers=config.peers,
        shard=shard,
        codec=config.codec,
        staleness=config.staleness,
        fraction=config.fraction,
        rounds=fedavg_rounds(config.steps, sizes, config.batch_size, config.local_epochs),
        seed=config.seed,
        timeout=config.round_timeout,
        startup_timeout=config.startup_timeout,
    )


def last_steps(config: Config) -> dict[int, int]:
    """Each worker's last step where it is not ``steps``: a FedAvg worker's count goes by the
    server's rounds, each its own local steps (picked for the round or not); {} elsewhere."""
    if config.mode != "ps" or config.ps != "fedavg":
        return {}
    sizes = [len(part) for part in parts_of(config, dataset_of(config))]
    rounds = fedavg_rounds(config.steps, sizes, config.batch_size, config.local_epochs)
    return {
        i: rounds * fedavg_local_steps(n, config.batch_size, config.local_epochs)
        for i, n in enumerate(sizes)
    }


def ps_worker_settings(config: Config, dataset: Dataset, rank: int) -> WorkerSettings:
    """How parameter-server worker ``rank`` of ``config``'s run takes part: the rule, the
    codec, the trigger's period, and under FedAvg its local steps and sample count (its
    shard of the data)."""
    shard = shard_for(config, dataset, rank)
    return WorkerSettings(
        rule=config.ps,
        codec=config.codec,
        period=parse_trigger(config.trigger).period,
        local_steps=fedavg_local_steps(len(shard), config.batch_size, config.local_epochs),
        samples=len(shard),
        timeout=config.round_timeout,
        seed=config.seed,
    )


def attacks_of(config: Config) -> dict[int, Attack]:
    """Every Byzantine peer's attack, by id (its profile's ``byzantine``; the profiles read
    once). ALIE's z, unless given, comes from the swarm's size and how many of its peers
    are Byzantine (:func:`~gossipdl.averaging.attacks.alie_z`)."""
    profiles = parse_profiles(config.profiles, config.peers)
    liars = {i: profile.byzantine for i, profile in profiles.items() if profile.byzantine}
    return {i: in_swarm(parse_attack(spec), config.peers, len(liars)) for i, spec in liars.items()}


def byzantine_of(config: Config, peer_id: int | None) -> Attack | None:
    """The attack peer ``peer_id`` runs (:func:`attacks_of`), None for an honest peer (or one
    without a rank yet)."""
    return None if peer_id is None else attacks_of(config).get(peer_id)


def averager_of(config: Config, attack: Attack | None = None, peer: int | None = None) -> Averager:
    """The averaging rule peer ``peer`` of ``config`` runs (a new one each call): its
    algorithm, codec (with random draws of its own, as a real peer's), γ and defence, and with
    ``attack`` a Byzantine peer's. Both simulators build their peers' rules with it."""
    return build_averager(
        config.algorithm,
        config.codec,
        config.seed,
        config.gamma or None,
        config.defence,
        attack,
        peer,
    )


def drift_of(config: Config, peer_id: int) -> Drift | None:
    """The label drift peer ``peer_id`` goes through (``drift``), None if it does not."""
    drift = parse_drift(config.drift)
    return drift if drift is not None and drift.affects(peer_id, config.peers) else None


def drifted(
    config: Config, dataset: Dataset, sampler: BatchSampler, y_test: torch.Tensor
) -> torch.Tensor:
    """Permute a drifting peer's labels, its shard's (in ``sampler``) and its test set's
    (returned), the same permutation for every peer of the swarm."""
    new_label = Drift.permutation(dataset.num_classes, config.seed)
    perm = torch.as_tensor(new_label, device=y_test.device)
    sampler.y = perm[sampler.y]
    return perm[y_test]


def parts_of(config: Config, dataset: Dataset) -> list[np.ndarray]:
    """Every peer's training indices: the config's partition of the data set (``natural``
    by its samples' owners)."""
    return partition(
        dataset.y_train, config.peers, config.partition, config.seed, owners=dataset.owners_train
    )


def shard_for(config: Config, dataset: Dataset, peer_id: int) -> np.ndarray:
    """Training indices of ``peer_id``: its partition (ids beyond ``peers`` wrap around)."""
    if config.mode == "single":
        return np.arange(len(dataset.y_train))
    return parts_of(config, dataset)[peer_id % config.peers]


def carried_from(previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a life resumed from a checkpoint carries on from ``previous``, the last metrics
    line of its last life: the :data:`CARRIED` sums and the drop reasons (none: nothing)."""
    if previous is None:
        return {}
    return {
        **{k: previous.get(k, 0) for k in CARRIED},
        "messages_dropped": dict(previous.get("dropped_reasons", {})),
    }


def carry_on(stats: dict[str, Any], carried: Mapping[str, Any]) -> dict[str, Any]:
    """``stats``, a life's counters, with what it carried on (:func:`carried_from`) added."""
    for key, base in carried.items():
        if key == "messages_dropped":
            stats[key] = dict(Counter(base) + Counter(stats[key]))
        else:
            stats[key] = round(stats[key] + base, 4) if key == "idle_s" else stats[key] + base
    return stats


def metrics_line(
    peer_id: int,
    step: int,
    elapsed: float,
    unix_time: float,
    losses: list[float],
    stats: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One line of ``peers/<id>.jsonl`` (the run directory's contract, both engines): the
    peer's counters ``stats`` at ``elapsed`` seconds into the swarm, the mean of ``losses``
    since the last line, and ``extra`` (accuracy, start, final, ...)."""
    dropped = stats["messages_dropped"]
    return {
        "peer": peer_id,
        "step": step,
        "time": round(elapsed, 4),
        "unix_time": round(unix_time, 3),
        "loss": round(float(np.mean(losses)), 6) if losses else None,
        **{k: v for k, v in stats.items() if k not in ("round", "messages_dropped")},
        "messages_dropped": sum(dropped.values()),
        "dropped_reasons": dict(dropped),
        **extra,
    }


def json_line(value: dict[str, Any]) -> str:
    """One compact, strict JSON line (a NaN loss is null: :func:`~gossipdl.rundir.dumps`)."""
    return dumps(value, separators=(",", ":")) + "\n"


def save_atomic(value: Any, path: Path) -> None:
    """``torch.save`` via a temporary file and a rename: a reader (another peer summarising
    the run) sees the old file or the new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        torch.save(value, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
