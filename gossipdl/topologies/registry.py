"""Spec strings to topologies: ``ring``, ``torus:4x4``, ``random-regular:3``, ``pkg.mod:Graph``."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable

from gossipdl.plugins import call_plugin, is_dotted, load_callable
from gossipdl.topologies.base import Topology, check_peer_count
from gossipdl.topologies.edge_file import read_edge_file
from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.graphs import complete, exponential, ring, star, torus
from gossipdl.topologies.one_peer import OnePeerExponential
from gossipdl.topologies.random_graphs import erdos_renyi, random_regular

__all__ = [
    "TOPOLOGY_NAMES",
    "TopologyFactory",
    "available_topologies",
    "build_topology",
    "builtin_topology",
    "register_topology",
]

TopologyFactory = Callable[[int, str | None, int], Topology]
"""Builds a topology from ``(n, arg, seed)``; ``arg`` is the text after ``:`` or None."""

_FACTORIES: dict[str, TopologyFactory] = {}
_USAGE: dict[str, str] = {}
_READS_A_FILE = frozenset({"edges"})  # families whose argument is a path on this machine
_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]*")


def register_topology(
    name: str, factory: TopologyFactory, *, usage: str | None = None, replace: bool = False
) -> None:
    """Make ``name`` (and ``name:ARG``) a valid spec, built by ``factory(n, arg, seed)``.

    ``usage`` is shown in error messages, e.g. ``"my-graph:K"``. Re-registering
    a name is an error unless ``replace=True``.

    Example::

        >>> from gossipdl.topologies import build_topology, register_topology
        >>> from gossipdl.topologies.graphs import complete
        >>> register_topology("everyone", lambda n, arg, seed: complete(n), replace=True)
        >>> build_topology("everyone", n=3).neighbors(0)
        [1, 2]
    """
    key = name.strip().lower()
    if not _NAME.fullmatch(key):
        raise TopologyError(
            f"topology name must be lowercase letters, digits, '-' or '_' (no ':'), got {name!r}"
        )
    if key in _FACTORIES and not replace:
        raise TopologyError(f"topology {key!r} is already registered; pass replace=True")
    if not callable(factory):
        raise TopologyError(f"factory for topology {key!r} must be callable, got {factory!r}")
    _FACTORIES[key] = factory
    _USAGE[key] = usage or key


def available_topologies() -> list[str]:
    """Names accepted by :func:`build_topology`: built-ins first, then user-registered ones."""
    return list(_FACTORIES)


def builtin_topology(spec: str) -> bool:
    """Whether ``spec`` names a family registered in this process that reads no file
    (``edges:PATH`` reads one, ``module.path:Class`` imports code): the only topologies
    a config from another peer may name.

    Example::

        >>> builtin_topology("torus:4x4"), builtin_topology("edges:/etc/passwd")
        (True, False)
    """
    head = spec.partition(":")[0].strip().lower()
    return head in _FACTORIES and head not in _READS_A_FILE


def _choices() -> str:
    """The accepted spec forms, for error messages."""
    return ", ".join([*_USAGE.values(), "module.path:ClassName"])


def build_topology(spec: str, n: int, seed: int = 0) -> Topology:
    """Build the topology named by ``spec`` over ``n`` peers; ``seed`` fixes random graphs.

    Specs: ``ring``, ``torus``, ``torus:RxC``, ``star``, ``complete``,
    ``exponential``, ``one-peer-exponential``, ``random-regular:D``,
    ``erdos-renyi:P``, ``edges:PATH``, any name added with
    :func:`register_topology`, or ``module.path:ClassName`` to import a
    :class:`Topology` subclass and call ``ClassName(n=n, seed=seed)`` (this
    imports and runs that module, like any plugin).

    Example::

        >>> build_topology("torus", n=9).neighbors(4)
        [1, 3, 5, 7]
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TopologyError(f"topology spec must be a non-empty string, got {spec!r}")
    n = check_peer_count(n)
    if isinstance(seed, bool) or not hasattr(type(seed), "__index__"):
        raise TopologyError(f"seed must be an integer, got seed={seed!r}")
    seed = operator.index(seed)
    if seed < 0:  # numpy's generators take none below 0
        raise TopologyError(f"seed must be 0 or more, got seed={seed}")
    spec = spec.strip()
    head, colon, tail = spec.partition(":")
    arg = tail.strip() if colon else None
    factory = _FACTORIES.get(head.strip().lower())
    topology: object
    if factory is not None:
        topology = factory(n, arg, seed)
    elif arg is not None and is_dotted(head) and is_dotted(arg):
        return _sound(_checked(spec, _load_class(head, arg, n, seed), n))
    else:
        raise TopologyError(f"unknown topology {head!r} in spec {spec!r}; choose from {_choices()}")
    return _checked(spec, topology, n)


def _checked(spec: str, topology: object, n: int) -> Topology:
    """Insist a factory returned a Topology over exactly ``n`` peers."""
    if not isinstance(topology, Topology):
        raise TopologyError(
            f"topology spec {spec!r} produced {type(topology).__name__}, not a Topology"
        )
    if getattr(topology, "n", None) != n:
        raise TopologyError(
            f"topology spec {spec!r} produced a graph over {getattr(topology, 'n', '?')} peers, "
            f"expected n={n}"
        )
    return topology


PLUGIN_ROUNDS_CHECKED = 64
"""The rounds of a plug-in topology's period checked when it is built (its first ones)."""


def _sound(topology: Topology) -> Topology:
    """A plug-in topology, its graph and weights checked now, not inside the first round
    that reads them (a traceback there): symmetric edges, symmetric doubly stochastic
    weights on them, and every peer's news reaching every other."""
    for t in range(min(topology.period, PLUGIN_ROUNDS_CHECKED)):
        topology.mixing_matrix(t)
    topology.spread_rounds()
    return topology


def _load_class(module_name: str, attr: str, n: int, seed: int) -> object:
    """Import ``module_name``, look up ``attr`` and call it with ``n`` and ``seed``."""
    spec = f"{module_name}:{attr}"
    target = load_callable(
        spec, "topology spec", TopologyError, hint=f"; built-in topologies are {_choices()}"
    )
    return call_plugin(target, spec, "topology spec", TopologyError, n=n, seed=seed)


def _no_arg(name: str, arg: str | None) -> None:
    """Reject ``name:ARG`` for families that take no argument."""
    if arg is not None:
        raise TopologyError(f"topology {name!r} takes no argument, got {name}:{arg}")


def _need_arg(usage: str, arg: str | None) -> str:
    """Return the argument of ``name:ARG``, or say how to write it."""
    if not arg:
        raise TopologyError(f"topology spec needs an argument: {usage}")
    return arg


def _torus(n: int, arg: str | None, seed: int) -> Topology:
    """``torus`` or ``torus:RxC``."""
    if arg is None:
        return torus(n)
    match = re.fullmatch(r"(\d+)\s*[xX]\s*(\d+)", arg)
    if match is None:
        raise TopologyError(f"torus:{arg}: expected torus:RxC with integers R, C, e.g. torus:4x4")
    return torus(n, int(match[1]), int(match[2]))


def _random_regular(n: int, arg: str | None, seed: int) -> Topology:
    """``random-regular:D``."""
    text = _need_arg("random-regular:D, e.g. random-regular:4", arg)
    try:
        degree = int(text)
    except ValueError:
        raise TopologyError(
            f"random-regular:{text}: degree D must be an integer, got {text!r}"
        ) from None
    return random_regular(n, degree, seed=seed)


def _erdos_renyi(n: int, arg: str | None, seed: int) -> Topology:
    """``erdos-renyi:P``."""
    text = _need_arg("erdos-renyi:P, e.g. erdos-renyi:0.3", arg)
    try:
        p = float(text)
    except ValueError:
        p = math.nan
    if not 0.0 < p <= 1.0:
        raise TopologyError(f"erdos-renyi:{text}: edge probability P must be in (0, 1]")
    return erdos_renyi(n, p, seed=seed)


def _edges(n: int, arg: str | None, seed: int) -> Topology:
    """``edges:PATH``."""
    return read_edge_file(_need_arg("edges:PATH, e.g. edges:graph.txt", arg), n)


def _plain(name: str, build: Callable[[int], Topology]) -> TopologyFactory:
    """Factory for a family that takes no argument and no seed."""

    def factory(n: int, arg: str | None, seed: int) -> Topology:
        _no_arg(name, arg)
        return build(n)

    return factory


register_topology("ring", _plain("ring", ring))
register_topology("torus", _torus, usage="torus[:RxC]")
register_topology("star", _plain("star", star))
register_topology("complete", _plain("complete", complete))
register_topology("exponential", _plain("exponential", exponential))
register_topology("one-peer-exponential", _plain("one-peer-exponential", OnePeerExponential))
register_topology("random-regular", _random_regular, usage="random-regular:D")
register_topology("erdos-renyi", _erdos_renyi, usage="erdos-renyi:P")
register_topology("edges", _edges, usage="edges:PATH")

TOPOLOGY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""The built-in topology names (see :func:`available_topologies` for user-added ones too)."""
