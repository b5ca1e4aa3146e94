"""Typed experiment config: read from TOML, overridden by CLI flags, validated once.

Everything downstream receives a ``Config`` and trusts it; nothing else reads
files or environment variables for settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gossipdl.suggest import did_you_mean

if TYPE_CHECKING:
    from gossipdl.averaging.robust import Defence
    from gossipdl.topologies import Topology

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODES = ("gossip", "single", "ring", "ps")
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
MAX_THREADS = 4096
"""The most torch threads a peer may ask for: more than any machine has cores (torch starts
as many as it is told; past 2**31 it cannot even read the count)."""
# ``peer`` and ``join`` read ``advertise`` from here when no --advertise is given: a launcher's
# way to tell each peer it starts the address other machines reach it at.
ADVERTISE_ENV = "GOSSIPDL_ADVERTISE"
# Keys whose values are tables (``[profiles.NAME]``, ``[[faults]]``): no flag of their own,
# set in a file or with --set; a sweep cannot vary them.
TABLE_KEYS = ("profiles", "faults")


class ConfigError(ValueError):
    """A config value that cannot be used; the message names it and what is allowed."""


@dataclass(frozen=True)
class Config:
    """One experiment. Field docs double as the CLI help and the README reference."""

    mode: str = field(
        default="gossip",
        metadata={
            "help": "gossip | single (one process, all data) | ring (ring all-reduce) "
            "| ps (parameter server)"
        },
    )
    peers: int = field(default=4, metadata={"help": "number of peer processes"})
    topology: str = field(default="ring", metadata={"help": "ring, torus, exponential, ..."})
    algorithm: str = field(
        default="auto",
        metadata={
            "help": "auto (choco if the codec is lossy, else dense) | dense | choco | broadcast "
            "| gossip-learning | powergossip | beer"
        },
    )
    ps: str = field(
        default="sync",
        metadata={"help": "ps mode rule: sync (average every H = trigger period) | async | fedavg"},
    )
    staleness: str = field(
        default="scale",
        metadata={"help": "ps async: none | scale (lr/τ) | soft:S (apply S at once) | ssp:S"},
    )
    ps_shards: int = field(default=1, metadata={"help": "ps mode: parameter-server shards"})
    local_epochs: int = field(default=1, metadata={"help": "ps fedavg: local epochs per round"})
    fraction: float = field(
        default=1.0, metadata={"help": "ps fedavg: fraction of workers picked per round"}
    )
    trigger: str = field(
        default="always",
        metadata={"help": "when peers talk: always | periodic:H | dynamic:DELTA[%][:B]"},
    )
    codec: str = field(
        default="none",
        metadata={
            "help": "what peers send, e.g. none, fp16, topk:0.01+qsgd:16, threshold:auto+sign"
        },
    )
    gamma: float = field(
        default=0.0,
        metadata={"help": "consensus step of CHOCO and PowerGossip (0: chosen automatically)"},
    )
    defence: str = field(
        default="none",
        metadata={
            "help": "Byzantine-robust combining for dense gossip, CHOCO and BEER: none, "
            "clip[:BAD], trimmed[:TRIM], median, balance[:GAMMA[:RHO]], each +descent[:TAU] "
            "(e.g. balance:0.5:3+descent)"
        },
    )
    evict_after: int = field(
        default=0,
        metadata={
            "help": "with defence clip or balance: a neighbour set aside this many rounds in a "
            "row is accused, and one most of its neighbours accuse leaves the swarm (0: never)"
        },
    )
    loss: float = field(
        default=0.0, metadata={"help": "fraction of model messages dropped on purpose (testing)"}
    )
    slowdown: str = field(
        default="",
        metadata={"help": "stragglers: PEER:FACTOR[,...], e.g. 3:4 (peer 3 computes 4x slower)"},
    )
    drift: str = field(
        default="",
        metadata={"help": "concept drift: STEP:permute[:FRACTION] permutes labels from STEP"},
    )
    dataset: str = field(
        default="mnist1d",
        metadata={
            "help": "mnist1d[:N] | digits | synthetic[:N] | cifar10 | cifar100 | femnist | "
            "shakespeare | synthetic-fedprox:ALPHA:BETA | module:function (N: samples)"
        },
    )
    data_dir: str = field(
        default="",
        metadata={
            "help": "where cifar10, cifar100, femnist and shakespeare are read from "
            "(gossipdl data fetch NAME puts them there; empty: ~/.cache/gossipdl/data)"
        },
    )
    samples_per_peer: int = field(
        default=0,
        metadata={
            "help": "generate mnist1d or synthetic with this many training samples per peer "
            "(0: the data set's own size)"
        },
    )
    model: str = field(
        default="cnn1d",
        metadata={
            "help": "logistic | mlp | cnn1d | cnn2d | resnet20 | vgg11 | lenet5 | leaf-cnn | "
            "leaf-lstm | module:function"
        },
    )
    hidden: tuple[int, ...] = field(
        default=(),
        metadata={"help": "layer widths / channels, e.g. 1024,512 (empty: model default)"},
    )
    partition: str = field(
        default="iid",
        metadata={"help": "iid | dirichlet:ALPHA | shards:K | powerlaw:A | natural (by owner)"},
    )
    steps: int = field(default=1500, metadata={"help": "local training steps per peer"})
    batch_size: int = field(
        default=32, metadata={"help": "mini-batch per peer (single mode: × peers)"}
    )
    optimizer: str = field(default="sgd", metadata={"help": "sgd | adam"})
    lr: float = field(default=0.05, metadata={"help": "learning rate"})
    lr_schedule: str = field(
        default="constant",
        metadata={"help": "constant | cosine (anneals lr to 0 over the steps)"},
    )
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "L2 weight decay"})
    seed: int = field(default=0, metadata={"help": "seed for data split, model init and sampling"})
    eval_every: int = field(
        default=250, metadata={"help": "evaluate test accuracy every N steps (0: only at the end)"}
    )
    log_every: int = field(default=10, metadata={"help": "write a metrics line every N steps"})
    round_timeout: float = field(
        default=10.0, metadata={"help": "seconds a round waits for a neighbour"}
    )
    overlap: bool = field(
        default=False,
        metadata={
            "help": "communicate behind compute: gossip runs each round behind the next "
            "step (D-PSGD's order: the gradient at the model sent), a ring all-reduces "
            "gradients in buckets during backward"
        },
    )
    shared_memory: bool = field(
        default=False,
        metadata={
            "help": "ring mode, every peer on this host: all-reduce through shared memory "
            "(GPU tensors on the GPU) instead of the TCP ring; bytes sent: heartbeats only"
        },
    )
    startup_timeout: float = field(
        default=120.0, metadata={"help": "seconds to wait for the swarm to form"}
    )
    heartbeat: float = field(
        default=1.0, metadata={"help": "seconds between heartbeats to a member we sent nothing"}
    )
    dead_after: float = field(
        default=5.0,
        metadata={"help": "seconds of silence after which a member is declared dead"},
    )
    link: str = field(
        default="",
        metadata={
            "help": "emulated access link of every peer, e.g. up=10mbit,down=10mbit, "
            "latency=20ms,jitter=5ms,loss=1%"
        },
    )
    profiles: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "device profiles, [profiles.NAME] tables in the file: peers, up, down, "
            "latency, jitter, loss, slowdown, offline (see examples/edge-10mbit.toml)"
        },
    )
    faults: list[dict[str, Any]] = field(
        default_factory=list,
        metadata={
            "help": "simulate only: fault events, [[faults]] tables in the file, each an at time "
            'and one action: kill = "2-3", partition = ["0-3", "4-7"], heal = true, '
            'clog / unclog = "0>1", inject = {loss, duplicate, reorder}'
        },
    )
    batched: bool = field(
        default=False,
        metadata={
            "help": "simulate only: peers train as one batched computation (mode gossip, dense "
            "or CHOCO with top-k, threshold, sign or QSGD, a static topology, nothing fails): "
            "thousands of peers"
        },
    )
    checkpoint_every: int = field(
        default=0,
        metadata={"help": "save checkpoints/<id>.pt every N steps (0: never); see peer --resume"},
    )
    device: str = field(
        default="auto", metadata={"help": "auto (cuda:i mod GPUs, else cpu) | cpu | cuda[:N]"}
    )
    threads: int = field(
        default=0, metadata={"help": "torch threads per peer (0: cores / local peers)"}
    )
    max_message_mb: float = field(
        default=1024.0, metadata={"help": "largest message a peer accepts, MiB"}
    )
    max_message_rate: float = field(
        default=20_000.0,
        metadata={"help": "messages per second a peer accepts from one connection (0: no limit)"},
    )
    max_members: int = field(
        default=512,
        metadata={"help": "member table entries (live, dead, left); beyond, joins are refused"},
    )
    forget_after: float = field(
        default=600.0,
        metadata={"help": "seconds after which a dead or departed member is forgotten"},
    )
    max_queued_mb: float = field(
        default=256.0,
        metadata={"help": "MiB a peer queues for one slow receiver before dropping messages"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address launched peers listen on"})
    advertise: str = field(
        default="",
        metadata={
            "help": "address other machines dial to reach this peer, tcp://HOST:PORT "
            "(empty: the listen address, or for a wildcard listen the interface that routes "
            "to the swarm)"
        },
    )
    tensorboard: str = field(
        default="",
        metadata={"help": "also write each peer's metrics as TensorBoard events under DIR"},
    )
    csv: str = field(
        default="", metadata={"help": "also write each peer's metrics as DIR/<id>.csv"}
    )
    metrics_hook: str = field(
        default="",
        metadata={
            "help": "module:function(peer_id, run_dir) returning a callable that gets "
            "every metrics line (a dict)"
        },
    )
    out: str = field(default="", metadata={"help": "run directory (default runs/<timestamp>)"})

    def __post_init__(self) -> None:
        for name in FIELDS:  # the types first, as a file's values: checks compare numbers
            object.__setattr__(self, name, _coerce(name, getattr(self, name)))
        _validate(self)

    @property
    def processes(self) -> int:
        """Peer processes this config starts: one in single mode."""
        return 1 if self.mode == "single" else self.peers

    def replace(self, **changes: Any) -> Config:
        """A validated copy with ``changes`` applied (values coerced like file values)."""
        return from_dict({**to_dict(self), **changes})


FIELDS = {f.name: f for f in fields(Config)}


def _coerce(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type; a string where a number belongs is an error, not
    read as one (a quoted ``"300"`` in a file is a mistake to show, not to guess at)."""
    kind = FIELDS[name].type
    if kind == "dict[str, Any]":
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise ConfigError(
                f"{name} = {value!r}: write one table per profile, e.g. "
                '[profiles.phone] with peers = "0-3", up = "10mbit"'
            )
        return value
    if kind == "list[dict[str, Any]]":
        if not isinstance(value, list | tuple) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(
                f"{name} = {value!r}: write one [[{name}]] table per event, e.g. [[faults]] "
                'with at = "30s", kill = "3" (or --set \'faults=[{at = "30s", kill = "3"}]\')'
            )
        return list(value)
    if kind in ("int", "float") and isinstance(value, str):
        raise ConfigError(
            f"{name} = {value!r} is a string; write the number without quotes, e.g. "
            f"{name} = {FIELDS[name].default}"
        )
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{name} = {value!r} is not a valid bool; write true or false")
        return value
    try:
        if kind == "tuple[int, ...]":
            if isinstance(value, str):
                return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
            iterable = hasattr(value, "__iter__") and not isinstance(value, dict)
            items = list(value) if iterable else [value]  # a list, a tuple, an array
            if any(isinstance(v, bool) for v in items):
                raise ValueError
            return tuple(operator.index(v) for v in items)  # numpy's integers too
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):  # nor could config.toml hold it (TOML has no inf)
                raise ValueError
            return number
        if isinstance(value, os.PathLike):  # a path given from Python
            return os.fspath(value)
        if not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} = {value!r} is not a valid {kind}") from None


def _check_keys(values: Mapping[str, Any], where: str = "") -> None:
    """Every key of ``values`` is a config key; an unknown one names its nearest known key."""
    problems = [
        f"unknown config key {key!r}{where}; {did_you_mean(key, FIELDS)}"
        for key in values
        if key not in FIELDS
    ]
    if problems:
        raise ConfigError("; ".join(problems))


def from_dict(values: dict[str, Any]) -> Config:
    """Build a Config from plain values (None: the default); unknown keys and bad values
    raise ConfigError."""
    _check_keys(values)
    return Config(**{k: v for k, v in values.items() if v is not None})


def parse_value(key: str, text: str) -> Any:
    """``text`` (as typed on a command line) as a value for config key ``key``: a TOML value
    if it is one (``300`` an int, ``0.1`` a float, ``[64, 32]`` a list, ``"x"`` a string),
    else the text itself (``topk:0.01``, ``1024,512``); a string key takes any text as written.

    Example:
        >>> parse_value("steps", "300"), parse_value("codec", "topk:0.01"), parse_value("out", "7")
        (300, 'topk:0.01', '7')
    """
    _check_keys({key: text})
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    return text if FIELDS[key].type == "str" and not isinstance(value, str) else value


def parse_setting(text: str) -> tuple[str, Any]:
    """A ``--set KEY=VALUE`` argument as the key and its value (read by ``parse_value``).

    Example:
        >>> parse_setting("steps=300"), parse_setting("hidden=1024,512")
        (('steps', 300), ('hidden', '1024,512'))
    """
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise ConfigError(f"--set {text!r}: write KEY=VALUE, e.g. --set steps=300")
    return key.strip(), parse_value(key.strip(), value.strip())


def load_config(path: str | Path | None = None, **overrides: Any) -> Config:
    """Read ``path`` (TOML) if given, then apply ``overrides`` whose value is not None."""
    values = read_config_file(path) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(values)


def read_config_file(path: str | Path, *, known_keys: bool = True) -> dict[str, Any]:
    """The values a TOML config file sets; an unknown key is an error naming the file and the
    nearest known key (``from_dict`` checks the values), unless ``known_keys`` is False (a
    run directory's record, which a newer gossipdl may have written with keys added)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start]:#x}); "
            "save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if known_keys:
        _check_keys(values, where=f" in {path}")
    return values


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain values (tuples become lists)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()
    }


SINK_DIRS = ("csv", "tensorboard")  # keys naming a folder every peer writes its metrics into


def resolved(config: Config) -> Config:
    """``config`` as it runs, for the record (config.toml, the banner): in the gossip mode the
    algorithm ``auto`` stands for is named; the metrics sinks' folders (``csv``,
    ``tensorboard``) are absolute, so a peer resumed from another working directory writes
    into its own files (``out`` needs not: ``--resume`` names the run directory); other
    settings are already explicit (CHOCO's γ 0 stays 0: it is chosen per codec and model,
    ``averaging.choco.auto_gamma``).

    Example:
        >>> c = resolved(Config(codec="topk:0.01", csv="/tmp/csv/../csv"))
        >>> c.algorithm, c.gamma, c.csv
        ('choco', 0.0, '/tmp/csv')
    """
    from gossipdl.averaging import resolve_algorithm

    changes = {k: os.path.abspath(v) for k in SINK_DIRS if (v := getattr(config, k))}
    if config.mode == "gossip":
        changes["algorithm"] = resolve_algorithm(config.algorithm, config.codec)
    return config.replace(**changes)


def to_toml(config: Config) -> str:
    """The config as a TOML document: flat keys, one per line, then one ``[profiles.NAME]``
    table per device profile and one ``[[faults]]`` table per fault event (every key is
    written, defaults too)."""
    lines = ["# gossipdl experiment config (every key, defaults resolved)"]
    values = to_dict(config)
    profiles, faults = values.pop("profiles"), values.pop("faults")
    lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    for name, table in profiles.items():
        lines += ["", f"[profiles.{json.dumps(name)}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    for event in faults:
        lines += ["", "[[faults]]"]
        lines += [f"{_toml_key(key)} = {_toml_value(value)}" for key, value in event.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A TOML value: JSON writes strings, numbers and lists the way TOML reads them; tables
    are written inline."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def _toml_key(key: str) -> str:
    """A TOML key: bare if it can be, else quoted."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def cautions(c: Config) -> list[str]:
    """Settings that are valid but known to go wrong where they meet, each a warning to give
    before the run starts (the README says what was measured)."""
    from gossipdl.averaging import parse_trigger

    found = []
    trigger = parse_trigger(c.trigger)
    period = trigger.period
    if _follows_trigger(c) and period > c.steps:
        found.append(
            f"trigger = {c.trigger!r} with steps = {c.steps}: a round every {period} steps "
            f"never comes, so the {'workers' if c.mode == 'ps' else 'peers'} train alone and "
            "send nothing; lower the period or raise steps"
        )
    elif c.mode == "gossip" and trigger.dynamic and c.steps % period:
        found.append(
            f"trigger = {c.trigger!r} with steps = {c.steps}: the swarm's last sync ends at "
            f"step {c.steps - c.steps % period}, and the last {c.steps % period} steps are "
            f"trained alone, so the swarm does not end on an agreed model; make steps a "
            f"multiple of {period}"
        )
    if _median_of_three(c):
        found.append(
            f"defence = {c.defence!r} on topology = {c.topology!r}: a peer with two neighbours "
            "takes the coordinate-wise median of three models, which leaves models apart for "
            "good, attack or not (no consensus: 8 peers, ring, 80 steps, iid shards, consensus "
            "distance 0.99 against plain gossip's 0.009; Dirichlet(0.1) shards, 150 steps: "
            "accuracy 0.554 against 0.886); use defence clip or balance there, or a graph "
            "where every peer has 3 neighbours or more (README, Misbehaving peers)"
        )
    if c.evict_after and c.partition != "iid" and not c.partition.startswith("powerlaw"):
        found.append(
            f"evict_after = {c.evict_after} with partition = {c.partition!r}: on label-skewed "
            "shards honest peers whose classes differ sit far from their neighbours round "
            "after round, and the fault search has seen them evicted (README, Misbehaving "
            "peers); leave eviction off there unless liars are the likelier fault"
        )
    return found


def _median_of_three(c: Config) -> bool:
    """Whether ``c``'s defence is a coordinate-wise median of three models at some peer: the
    median, or a trimmed mean of TRIM 1, on a graph that gives a peer two neighbours."""
    from gossipdl.averaging.robust import parse_defence
    from gossipdl.topologies import build_topology

    defence = parse_defence(c.defence)
    coordinate = defence is not None and (
        defence.rule == "median" or (defence.rule == "trimmed" and defence.param == 1)
    )
    return coordinate and fewest_neighbours(build_topology(c.topology, c.peers, c.seed)) == 2


def fewest_neighbours(graph: Topology) -> int:
    """The fewest neighbours a peer of ``graph`` has in a round it talks in, over every round
    of its period (a peer idle in a round, as the one-peer exponential graph leaves some, does
    not count): what a defence's :attr:`~gossipdl.averaging.robust.Defence.least_neighbours`
    is held against."""
    counts = [graph.adjacency(r).sum(1) for r in range(graph.period)]
    talking = [int(k) for degrees in counts for k in degrees if k > 0]
    return min(talking, default=0)


def _too_few(c: Config, defence: Defence, fewest: int, static: bool) -> str:
    """Why ``defence`` never mixes on ``c``'s graph, whose peers have ``fewest`` neighbours
    (a round, if it changes), and what to use instead."""
    need, bad = defence.least_neighbours, int(defence.param)
    what = {
        "clip": f"clipping for {bad} bad neighbour{'s' * (bad != 1)} (its radius is 0 with "
        f"{bad} or fewer)",
        "trimmed": f"a trimmed mean of TRIM {bad} (2·TRIM + 1 values, the peer's own among them)",
        "median": "the median (3 values, the peer's own among them)",
    }[defence.rule]
    has = f"has {fewest} neighbour{'s' * (fewest != 1)}" + ("" if static else " a round")
    smaller = {"clip": fewest - 1, "trimmed": fewest // 2}.get(defence.rule, 0)  # 0 is no rule
    instead = f"{defence.rule}:{smaller}, " if smaller >= 1 else ""
    return (
        f"defence = {c.defence!r} on topology = {c.topology!r}: a peer there {has}, and "
        f"{what} takes a neighbour's model in only with {need} or more, so it would keep its "
        f"own model every round and never mix; use {instead}defence balance, or a graph "
        f"where every peer has {need} neighbours or more (e.g. exponential or "
        f"random-regular:{max(need, 3)})"
    )


def _follows_trigger(c: Config) -> bool:
    """Whether ``c``'s processes talk when its trigger says: gossip, the ring and the
    parameter server's sync and async workers do; FedAvg rounds last ``local_epochs``, and a
    single process talks to nobody."""
    return c.mode in ("gossip", "ring") or (c.mode == "ps" and c.ps != "fedavg")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(c: Config) -> None:
    """Every static check; anything that needs the data (partition feasibility) runs at launch."""
    from gossipdl.averaging import (
        TriggerError,
        available_algorithms,
        build_averager,
        check_overlap,
        check_trigger,
        parse_trigger,
    )
    from gossipdl.averaging.attacks import in_swarm, parse_attack
    from gossipdl.averaging.base import check_graph
    from gossipdl.averaging.robust import EVICTING_RULES, parse_defence
    from gossipdl.compression import CodecError, build_codec
    from gossipdl.compression.base import FLOAT32_MAX
    from gossipdl.conditions import (
        ConditionError,
        parse_drift,
        parse_profiles,
        parse_slowdown,
    )
    from gossipdl.coordinator.ring import check_ring_codec, check_shared_memory
    from gossipdl.data import available_datasets
    from gossipdl.data.datasets import sized_limit
    from gossipdl.models import available_models
    from gossipdl.protocol.ps_server import PS_RULES
    from gossipdl.protocol.staleness import parse_staleness
    from gossipdl.sim.faults import parse_faults
    from gossipdl.topologies import TopologyError, build_topology
    from gossipdl.transport.addresses import address_problem
    from gossipdl.transport.shaping import LinkError, parse_link

    _check(c.mode in MODES, f"mode = {c.mode!r}; choose one of {', '.join(MODES)}")
    if c.mode == "ring":
        try:
            check_ring_codec(c.codec)
        except ValueError as exc:
            raise ConfigError(f"codec = {c.codec!r}: {exc}") from None
    if c.mode in ("ring", "ps"):
        _check(
            not c.trigger.startswith("dynamic"),
            f"trigger = {c.trigger!r}: the {c.mode} mode combines every worker's model in "
            "every round; use always or periodic:H",
        )
    _check(c.ps in PS_RULES, f"ps = {c.ps!r}; choose one of {', '.join(PS_RULES)}")
    try:
        parse_staleness(c.staleness)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check(c.ps_shards >= 1, f"ps_shards = {c.ps_shards}; must be at least 1")
    _check(c.local_epochs >= 1, f"local_epochs = {c.local_epochs}; must be at least 1")
    _check(0 < c.fraction <= 1, f"fraction = {c.fraction}; must be in (0, 1]")
    minimum = 1 if c.mode == "single" else 2
    _check(c.peers >= minimum, f"peers = {c.peers}; the {c.mode} mode needs at least {minimum}")
    # before anything sized by peers (the topology): a joiner reads peers from the swarm
    _check(c.max_members >= 2, f"max_members = {c.max_members}; a swarm needs at least 2")
    _check(
        c.max_members >= c.peers,
        f"max_members = {c.max_members} is below peers = {c.peers}; raise max_members",
    )
    _check(0 <= c.seed < 2**32, f"seed = {c.seed}; use 0 <= seed < 2**32")  # draws the graph
    static_graph = True
    if c.mode == "gossip":
        try:
            graph = build_topology(c.topology, c.peers, c.seed)
        except TopologyError as exc:
            raise ConfigError(f"topology = {c.topology!r}: {exc}") from None
        static_graph = graph.is_static
    try:
        build_codec(c.codec)
    except CodecError as exc:
        raise ConfigError(f"codec = {c.codec!r}: {exc}") from None
    _check(0 <= c.gamma <= 1, f"gamma = {c.gamma}; must be in [0, 1] (0: chosen automatically)")
    _check(0 <= c.loss < 1, f"loss = {c.loss}; must be in [0, 1)")
    _check(
        c.algorithm != "broadcast" or c.mode == "single" or c.topology == "complete",
        f"algorithm = 'broadcast' sends every update to every peer; use topology = 'complete' "
        f"(got {c.topology!r})",
    )
    _check(
        c.algorithm in available_algorithms(),
        f"algorithm = {c.algorithm!r}; choose one of {', '.join(available_algorithms())}",
    )
    try:
        defence = parse_defence(c.defence)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check(
        c.defence == "none" or c.mode == "gossip",
        f"defence = {c.defence!r} combines gossip neighbours' models; mode {c.mode!r} has none "
        "(use mode gossip, or defence none)",
    )
    if defence is not None and c.mode == "gossip":
        fewest = fewest_neighbours(graph)
        if fewest < defence.least_neighbours:
            raise ConfigError(_too_few(c, defence, fewest, static_graph))
    _check(
        c.evict_after == 0 or (defence is not None and defence.rule in EVICTING_RULES),
        f"evict_after = {c.evict_after} needs defence clip or balance (got {c.defence!r}): "
        "they set a bad model aside whole, the coordinate-wise rules part of every model",
    )
    try:
        averager = build_averager(c.algorithm, c.codec, defence=c.defence)
        trigger = parse_trigger(c.trigger)
        check_trigger(trigger, averager)
        check_graph(averager, c.topology, static_graph)
    except TriggerError as exc:
        raise ConfigError(f"trigger = {c.trigger!r}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"algorithm = {c.algorithm!r}: {exc}") from None
    _check(
        c.gamma == 0 or (c.mode == "gossip" and averager.takes_gamma),
        f"gamma = {c.gamma}: "
        + (
            f"algorithm {averager.name!r} takes no consensus step (choco, beer and powergossip do)"
            if c.mode == "gossip"
            else f"mode {c.mode!r} takes no consensus step"
        )
        + "; leave gamma at 0",
    )
    _check(
        not c.overlap or c.mode in ("gossip", "ring"),
        f"overlap = true overlaps a gossip round or a ring's gradient all-reduce with compute; "
        f"mode {c.mode!r} has neither: set overlap = false",
    )
    try:
        every_step = trigger.period == 1
        check_overlap(c.overlap, c.mode == "ring", every_step, averager.asynchronous, c.codec)
    except ValueError as exc:
        raise ConfigError(f"overlap = true: {exc}") from None
    try:
        check_shared_memory(c.shared_memory, c.mode == "ring", c.codec)
    except ValueError as exc:
        raise ConfigError(f"shared_memory = true: {exc}") from None
    try:
        parse_slowdown(c.slowdown, c.peers)
        drift = parse_drift(c.drift)
        devices = parse_profiles(c.profiles, c.peers)
        parse_faults(c.faults, c.peers)
    except ConditionError as exc:
        raise ConfigError(str(exc)) from None
    if drift is not None:  # a drift the run never reaches, or that no peer goes through
        _check(
            drift.step < c.steps,
            f"drift = {c.drift!r}: step {drift.step} comes after the run's last step "
            f"(steps = {c.steps}); use a STEP below {c.steps}",
        )
        _check(
            any(drift.affects(i, c.peers) for i in range(c.peers)),
            f"drift = {c.drift!r}: a fraction {drift.fraction} of {c.peers} peers is none of "
            f"them; use a FRACTION of at least {1 / c.peers:.3g}",
        )
    _check(
        c.mode == "gossip" or not any(d.link.offline for d in devices.values()),
        f"profiles: offline windows need the gossip mode, where the swarm drops a silent peer "
        f"and takes it back; the {c.mode} mode would stop or wait for it",
    )
    liars = sorted(i for i, d in devices.items() if d.byzantine)
    if liars:
        _check(
            c.mode == "gossip",
            f"profiles: byzantine peers {liars} lie to gossip neighbours; mode {c.mode!r} has none",
        )
        for spec in sorted({devices[i].byzantine for i in liars}):  # each attack the swarm runs
            try:
                attack = parse_attack(spec)
            except ValueError as exc:
                raise ConfigError(f"profiles: {exc}") from None
            if attack.name == "alie" and attack.param is None:  # z from n and f, as at launch
                _check(
                    len(liars) < c.peers,
                    f"profiles: byzantine {spec!r} on all {c.peers} peers; ALIE's z is worked "
                    "out from how many peers are honest, and none is: leave a peer honest, "
                    "or give z (alie:Z)",
                )
            try:
                build_averager(c.algorithm, c.codec, attack=in_swarm(attack, c.peers, len(liars)))
            except ValueError as exc:
                raise ConfigError(f"profiles: {exc}") from None
    _check(
        c.dataset in available_datasets() or ":" in c.dataset,
        f"dataset = {c.dataset!r}; choose one of {', '.join(available_datasets())} "
        "or module:function",
    )
    _check(
        c.model in available_models() or ":" in c.model,
        f"model = {c.model!r}; choose one of {', '.join(available_models())} or module:function",
    )
    _check(
        re.fullmatch(r"iid|natural|(dirichlet|powerlaw):[0-9.eE+-]+|shards:\d+", c.partition)
        is not None,
        f"partition = {c.partition!r}; use iid, dirichlet:ALPHA, shards:K, powerlaw:A or natural",
    )
    _check(c.optimizer in OPTIMIZERS, f"optimizer = {c.optimizer!r}; choose sgd or adam")
    _check(
        c.samples_per_peer == 0 or c.dataset in ("mnist1d", "synthetic"),
        f"samples_per_peer = {c.samples_per_peer} generates mnist1d or synthetic; dataset = "
        f'{c.dataset!r} has a size of its own (use dataset = "mnist1d", or samples_per_peer = 0)',
    )
    _check(
        c.lr_schedule in LR_SCHEDULES,
        f"lr_schedule = {c.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}",
    )
    for name in ("steps", "batch_size", "log_every"):
        _check(getattr(c, name) >= 1, f"{name} = {getattr(c, name)}; must be at least 1")
    _check(c.host.strip() != "", 'host = ""; give the address launched peers listen on')
    if c.samples_per_peer and c.dataset in ("mnist1d", "synthetic"):
        most = sized_limit(c.dataset) // c.peers
        _check(
            c.samples_per_peer <= most,
            f"samples_per_peer = {c.samples_per_peer}; {c.dataset} generates at most "
            f"{most:,} per peer for {c.peers} peers",
        )
    try:
        parse_link(c.link)
    except LinkError as exc:
        raise ConfigError(f"link = {c.link!r}: {exc}") from None
    _check(
        0 < c.heartbeat < c.dead_after,
        f"heartbeat = {c.heartbeat}, dead_after = {c.dead_after}; a member is declared dead "
        "after missing several heartbeats, so 0 < heartbeat < dead_after",
    )
    for name in (
        "eval_every", "threads", "weight_decay", "max_message_rate", "checkpoint_every",
        "samples_per_peer", "evict_after",
    ):  # fmt: skip
        _check(getattr(c, name) >= 0, f"{name} = {getattr(c, name)}; must not be negative")
    for name in (
        "lr",
        "round_timeout",
        "startup_timeout",
        "max_message_mb",
        "forget_after",
        "max_queued_mb",
    ):
        _check(getattr(c, name) > 0, f"{name} = {getattr(c, name)}; must be positive")
    for name in ("lr", "weight_decay"):  # they scale the model's float32 tensors
        _check(
            getattr(c, name) <= FLOAT32_MAX,
            f"{name} = {getattr(c, name):g}; above float32's largest value ({FLOAT32_MAX:.4g}), "
            "which the model's tensors cannot hold",
        )
    _check(c.threads <= MAX_THREADS, f"threads = {c.threads}; use at most {MAX_THREADS}")
    _check(0 <= c.momentum < 1, f"momentum = {c.momentum}; must be in [0, 1)")
    _check(all(h >= 1 for h in c.hidden), f"hidden = {list(c.hidden)}; widths must be >= 1")
    _check(
        _DEVICE.match(c.device) is not None,
        f"device = {c.device!r}; use auto, cpu, mps, cuda or cuda:N",
    )
    advertised = address_problem(c.advertise) if c.advertise else None
    _check(
        advertised is None,
        f"advertise = {c.advertise!r}: {advertised}; give the address other machines reach "
        "this peer at, tcp://HOST:PORT with a concrete host, e.g. tcp://10.0.0.5:5555",
    )
    _check(
        not c.metrics_hook or _PLUGIN.fullmatch(c.metrics_hook) is not None,
        f"metrics_hook = {c.metrics_hook!r}; use module:function, e.g. mypkg.hooks:make_sink",
    )


DEFAULTS = Config()
