"""The one exception type of the topology package, kept apart so every module can raise it."""

from __future__ import annotations

__all__ = ["TopologyError"]


class TopologyError(ValueError):
    """A topology spec, graph or mixing matrix is invalid; the message names the bad value."""
