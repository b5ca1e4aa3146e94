"""Load user code named by a ``module.path:function`` spec (datasets, models)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(spec: str, what: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``spec`` names; ``error(message)`` says what is wrong if it cannot be had.

    ``what`` names the kind of thing in messages, e.g. ``"custom dataset"``.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{what} {spec!r} must be of the form 'module.path:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise error(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise error(f"{what} {spec!r}: {attr!r} is not callable")
    return fn
