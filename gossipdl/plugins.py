"""Load and call user code named by a ``module.path:function`` spec (datasets, models,
topologies, codecs)."""

from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_dotted(name: str) -> bool:
    """Whether ``name`` is an absolute dotted Python name (``pkg.mod``, ``Class``): what
    each half of a plug-in spec must be, so that a relative one (``.mod``, which
    importlib refuses with a TypeError) or a path is refused before any import."""
    return _DOTTED.fullmatch(name) is not None


def load_callable(
    spec: str, what: str, error: type[Exception], hint: str = ""
) -> Callable[..., Any]:
    """The callable ``spec`` names (``module.path:name``, ``name`` may be dotted:
    ``Class.factory``); ``error(message)`` says what is wrong if it cannot be had.

    ``what`` names the kind of thing in messages, e.g. ``"custom dataset"``; ``hint`` is
    added where the module cannot be imported (e.g. the built-in names the spec may have
    meant).
    """
    module_name, _, attr = spec.partition(":")
    if not is_dotted(module_name) or not is_dotted(attr):
        raise error(
            f"{what} {spec!r} must be of the form 'module.path:function' (an importable, "
            "absolute module name: no leading dot)"
        )
    target: object = _import(spec, module_name, what, error, hint)
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise error(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise error(f"{what} {spec!r}: {attr!r} is not callable (a class or function)")
    return target


def _import(
    spec: str, module_name: str, what: str, error: type[Exception], hint: str
) -> ModuleType:
    """Module ``module_name``; any failure while importing it (not found, a syntax error,
    an exception its top level raises) is ``error`` naming the spec, the module and the
    failure, as user code must never end the program with a traceback of ours."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}){hint}") from exc
    except Exception as exc:
        raise error(
            f"{what} {spec!r}: importing module {module_name!r} failed: {_described(exc)}"
        ) from exc


def _described(exc: Exception) -> str:
    """``exc`` as ``file:line: Type: message``, the place being where it was raised (for a
    SyntaxError, the offending line of the file)."""
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"


def call_plugin(
    fn: Callable[..., Any],
    spec: str,
    what: str,
    error: type[Exception],
    /,
    *args: tuple[str, Any],
    **kwargs: Any,
) -> Any:
    """``fn(*values, **kwargs)``, the call gossipdl makes of a plug-in, ``args`` being the
    positional ones as ``(name, value)`` pairs. If ``fn``'s own signature (a decorator's
    wrapper's, not the function it wraps) cannot take exactly these, ``error`` names the
    spec and the call it must accept; whatever the call raises (but ``error`` itself) is
    ``error`` too, naming the spec and where it was raised, chained to it."""
    attr = spec.partition(":")[2]
    values = [value for _, value in args]
    shown = [repr(value) for value in values] + [f"{k}={v!r}" for k, v in kwargs.items()]
    call = f"{attr}({', '.join(shown)})"
    try:
        inspect.signature(fn, follow_wrapped=False).bind(*values, **kwargs)
    except ValueError:  # no signature to read (some builtins): the call tells
        pass
    except TypeError as exc:
        names = [name for name, _ in args] + list(kwargs)
        raise error(
            f"{what} {spec!r}: calling {call} failed: {exc}; give {attr} the signature "
            f"{attr}({', '.join(names)})"
        ) from None
    try:
        return fn(*values, **kwargs)
    except error:
        raise
    except Exception as exc:
        raise error(f"{what} {spec!r}: {call} raised {_described(exc)}") from exc
