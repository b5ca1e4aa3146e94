"""Spec string -> Averager. New algorithms are one file and one line here."""

from __future__ import annotations

from collections.abc import Callable

from gossipdl.averaging.base import Averager
from gossipdl.averaging.dense import DenseGossip

_ALGORITHMS: dict[str, Callable[[], Averager]] = {"dense": DenseGossip}


def available_algorithms() -> list[str]:
    """Names accepted by ``build_averager``."""
    return sorted(_ALGORITHMS)


def register_algorithm(name: str, factory: Callable[[], Averager]) -> None:
    """Make ``name`` buildable by ``build_averager``."""
    _ALGORITHMS[name] = factory


def build_averager(name: str) -> Averager:
    """The averaging strategy called ``name``."""
    try:
        return _ALGORITHMS[name]()
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of {', '.join(available_algorithms())}"
        ) from None
