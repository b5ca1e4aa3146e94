"""A config from another peer may name built-in parts only: never code, never a file.

``gossipdl join`` learns the swarm's settings from a member it has no reason
to trust yet. Before anything is built from them, every setting that could
import a module (a ``module:function`` plug-in for the codec, topology,
dataset or model) or open a file on this machine (``edges:PATH``) must name a
part built into gossipdl; otherwise the join stops, naming the setting. A
user who trusts the plug-in names it in a config file of their own, which is
their decision on their own machine. Settings that describe this machine or
protect it (``LOCAL_KEYS``: where to write, which device, its own limits)
never come from a peer at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from gossipdl.config import Config, ConfigError, from_dict

# This machine's settings and its own limits: from the user's config or the defaults only.
LOCAL_KEYS = frozenset(
    {
        "out",
        "device",
        "threads",
        "host",
        "max_message_mb",
        "max_message_rate",
        "max_members",
        "forget_after",
        "max_queued_mb",
        "advertise",
        "tensorboard",
        "csv",
        "metrics_hook",
        "data_dir",  # a path on this machine: where its own copy of a data set lives
        "faults",  # a simulated experiment's schedule (the real engine refuses it)
    }
)


def _builtin_checks() -> dict[str, Callable[[str], bool]]:
    """Per setting that can name a plug-in: whether a value is built into gossipdl."""
    from gossipdl.averaging import available_algorithms
    from gossipdl.compression import builtin_codec
    from gossipdl.data import builtin_dataset
    from gossipdl.models import available_models
    from gossipdl.topologies import builtin_topology

    return {
        "codec": builtin_codec,
        "topology": builtin_topology,
        "dataset": builtin_dataset,
        "model": lambda name: name in available_models(),
        "algorithm": lambda name: name in available_algorithms(),
    }


class RemoteCodeError(ConfigError):
    """A config from another peer names code or a file; the message says how to run it anyway."""


def config_from_peer(remote: Any, source: str, local: dict[str, Any] | None = None) -> Config:
    """The config to run with: the swarm's settings as the member at ``source`` sent them
    (``remote``), under the user's own values ``local`` (a config file, flags), which win.
    This machine's settings (``LOCAL_KEYS``) come from ``local`` or the defaults only.

    Raises :class:`RemoteCodeError` before anything is imported or opened if a setting
    that ``local`` leaves to the swarm names a plug-in or a file; ``ConfigError`` for
    anything else wrong with it.

    Example:
        >>> config_from_peer({"codec": "fp16", "out": "/tmp/x"}, "tcp://10.0.0.5:5555").codec
        'fp16'
        >>> config_from_peer({"codec": "evil:Codec"}, "tcp://10.0.0.5:5555")
        Traceback (most recent call last):
        ...
        gossipdl.trust.RemoteCodeError: the swarm at tcp://10.0.0.5:5555 names codec = ...
    """
    if not isinstance(remote, dict):
        raise ConfigError(f"the member at {source} sent a config that is not a table")
    local = local or {}
    swarm = {key: value for key, value in remote.items() if key not in LOCAL_KEYS}
    for key, builtin in _builtin_checks().items():
        value = swarm.get(key)
        if key in local or not isinstance(value, str) or builtin(value):
            continue
        raise RemoteCodeError(
            f"the swarm at {source} names {key} = {value!r}, which is not built into gossipdl: "
            "running it would import code or read a file on this machine, and gossipdl never "
            "does that on another peer's word. If you trust it, name the same value in a "
            f"config file of your own ({key} = {value!r}) and run: gossipdl join {source} "
            "--config FILE"
        )
    config = from_dict({**swarm, **local})
    if "hidden" not in local:
        _refuse_unsendable_widths(config, source)
    return config


def least_parameters(hidden: Sequence[int]) -> int:
    """A lower bound on the parameters of any built-in model with these widths, whatever
    its input: each width is a layer's output (a bias or more apiece), and each two in a
    row a weight of their product at least (a matrix, or a convolution's kernels).

    >>> least_parameters([256, 256])
    66048
    """
    return sum(hidden) + sum(a * b for a, b in itertools.pairwise(hidden))


def _refuse_unsendable_widths(config: Config, source: str) -> None:
    """ConfigError if the swarm's ``hidden`` widths make a model this machine could not
    send dense under its own ``max_message_mb`` (a join's model, a resync's copy), before
    anything allocates it: ``hidden = [10**7, 10**7]`` from a member was 10**14 parameters."""
    size = 4 * least_parameters(config.hidden)
    if size > config.max_message_mb * 2**20:
        raise ConfigError(
            f"the swarm at {source} names hidden = {list(config.hidden)}, a model of at least "
            f"{size / 2**20:,.0f} MiB, more than this machine's max_message_mb = "
            f"{config.max_message_mb:g}: it could not take the model a join sends; raise "
            "max_message_mb in a config file of your own if you mean to join it"
        )
