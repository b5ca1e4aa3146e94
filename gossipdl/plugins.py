"""Load user code named by a ``module.path:function`` spec (datasets, models)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_dotted(name: str) -> bool:
    """Whether ``name`` is an absolute dotted Python name (``pkg.mod``, ``Class``): what
    each half of a plug-in spec must be, so that a relative one (``.mod``, which
    importlib refuses with a TypeError) or a path is refused before any import."""
    return _DOTTED.fullmatch(name) is not None


def load_callable(spec: str, what: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``spec`` names; ``error(message)`` says what is wrong if it cannot be had.

    ``what`` names the kind of thing in messages, e.g. ``"custom dataset"``.
    """
    module_name, _, attr = spec.partition(":")
    if not is_dotted(module_name) or not is_dotted(attr):
        raise error(
            f"{what} {spec!r} must be of the form 'module.path:function' (an importable, "
            "absolute module name: no leading dot)"
        )
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
