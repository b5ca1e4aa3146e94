"""Spec strings to codecs: ``topk:0.01+qsgd:16+delta-golomb``, ``sign+ef``, ``pkg.mod:MyCodec``.

A spec is stages joined by ``+``, in this order::

    [SPARSIFIER] [+ VALUES] [+ INDEX CODER] [+ ef]      e.g. topk:0.01+fp16+ef
    WHOLE-VECTOR CODEC [+ ef]                           e.g. powersgd:2+ef, none

* sparsifiers: ``topk:RATIO``, ``randomk:RATIO[:noscale]``, ``threshold:TAU``,
  ``threshold:auto[:DENSITY]``;
* value codecs (on the kept values, or on the whole vector alone): ``fp16``,
  ``bf16``, ``uniform:BITS[:BLOCK]``, ``qsgd:LEVELS[:BUCKET][:trits]``, ``sign[:BLOCK]``,
  ``ternary[:BLOCK]`` (float32 when none is given);
* index coders: ``raw``, ``delta-varint``, ``delta-golomb`` (the default),
  ``delta-zlib``, ``delta-zstd`` (with the ``zstandard`` package);
* whole-vector codecs: ``none`` (alias ``dense``), ``powersgd:RANK``, anything
  added with :func:`register_codec`, or ``module.path:ClassName``;
* ``ef``: wrap everything in :class:`~gossipdl.compression.ErrorFeedback`.

Names are case-insensitive. :attr:`Codec.spec` is the normalized form:
``dense`` becomes ``none``, numbers are written canonically, arguments equal to
their default are dropped, and the index coder is always named, so two peers
agree on a codec exactly when their normalized specs are equal.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from gossipdl.compression.base import Codec, CodecError, ValueCodec
from gossipdl.compression.feedback import ErrorFeedback
from gossipdl.compression.floating import BFloat16, Float16, Identity
from gossipdl.compression.indices import (
    DeltaGolomb,
    DeltaVarint,
    DeltaZlib,
    DeltaZstd,
    IndexCoder,
    RawIndices,
)
from gossipdl.compression.powersgd import PowerSGD
from gossipdl.compression.quantization import QSGD, Sign, Ternary, Uniform
from gossipdl.compression.sparse import RandomK, SparseCodec, Sparsifier, Threshold, TopK
from gossipdl.numerals import is_decimal
from gossipdl.plugins import call_plugin, is_dotted, load_callable

__all__ = [
    "DEFAULT_INDEX_CODER",
    "CodecFactory",
    "available_codecs",
    "build_codec",
    "register_codec",
]

DEFAULT_INDEX_CODER = "delta-golomb"
"""Used when a spec names a sparsifier but no index coder (see ``gossipdl.compression.indices``)."""

CodecFactory = Callable[[str | None, int], Codec]
"""Builds a whole-vector codec from ``(arg, seed)``; ``arg`` is the text after ``:`` or None."""

_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]*")


@dataclass(frozen=True)
class _Stage:
    kind: str  # "sparsifier" | "values" | "indices" | "codec"
    usage: str
    build: Callable[[list[str], int], object]  # (arguments, seed) -> stage object


_STAGES: dict[str, _Stage] = {}
_ORDER = ("sparsifier", "values", "indices")
_KIND_NAMES = {
    "sparsifier": "sparsifier",
    "values": "value codec",
    "indices": "index coder",
    "codec": "whole-vector codec",
}


def _stage(name: str, kind: str, usage: str, build: Callable[[list[str], int], object]) -> None:
    _STAGES[name] = _Stage(kind, usage, build)


# --- argument parsing --------------------------------------------------------------------------


def _args(usage: str, args: list[str], least: int, most: int) -> list[str]:
    if not least <= len(args) <= most:
        raise CodecError(f"codec stage expects {usage}, got {len(args)} argument(s): {args}")
    return args


def _float(usage: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise CodecError(f"{usage}: {text!r} is not a finite number")
    return value


def _int(usage: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CodecError(f"{usage}: {text!r} is not an integer") from None


def _topk(args: list[str], seed: int) -> object:
    (ratio,) = _args("topk:RATIO", args, 1, 1)
    return TopK(_float("topk:RATIO", ratio), seed=seed)


def _randomk(args: list[str], seed: int) -> object:
    usage = "randomk:RATIO[:noscale]"
    args = _args(usage, args, 1, 2)
    if len(args) == 2 and args[1].lower() != "noscale":
        raise CodecError(f"{usage}: the only option is 'noscale', got {args[1]!r}")
    return RandomK(_float(usage, args[0]), scaled=len(args) == 1, seed=seed)


def _threshold(args: list[str], seed: int) -> object:
    usage = "threshold:TAU or threshold:auto[:DENSITY]"
    args = _args(usage, args, 1, 2)
    if args[0].lower() == "auto":
        density = _float(usage, args[1]) if len(args) == 2 else 0.01
        return Threshold(None, density=density, seed=seed)
    if len(args) == 2:
        raise CodecError(f"{usage}: only 'auto' takes a DENSITY, got {':'.join(args)!r}")
    return Threshold(_float(usage, args[0]), seed=seed)


def _uniform(args: list[str], seed: int) -> object:
    usage = "uniform:BITS[:BLOCK]"
    args = _args(usage, args, 1, 2)
    block = _int(usage, args[1]) if len(args) == 2 else 0
    return Uniform(_int(usage, args[0]), block)


def _qsgd(args: list[str], seed: int) -> object:
    usage = "qsgd:LEVELS[:BUCKET][:trits]"
    args = _args(usage, args, 1, 3)
    coding = "fixed"
    if len(args) > 1 and not is_decimal(args[-1].lstrip("-")):
        coding = args.pop().lower()
        if coding != "trits":
            raise CodecError(f"{usage}: the only coding is 'trits', got {coding!r}")
    if len(args) > 2:
        raise CodecError(f"{usage}: the third argument is the coding, got {args[2]!r}")
    bucket = _int(usage, args[1]) if len(args) == 2 else 512
    return QSGD(_int(usage, args[0]), bucket, seed=seed, coding=coding)


def _block_only(cls: type, name: str) -> Callable[[list[str], int], object]:
    def build(args: list[str], seed: int) -> object:
        usage = f"{name}[:BLOCK]"
        args = _args(usage, args, 0, 1)
        block = _int(usage, args[0]) if args else 0
        return cls(block, seed=seed) if cls is Ternary else cls(block)

    return build


def _no_args(factory: Callable[[], object], name: str) -> Callable[[list[str], int], object]:
    def build(args: list[str], seed: int) -> object:
        _args(name, args, 0, 0)
        return factory()

    return build


def _powersgd(args: list[str], seed: int) -> object:
    (rank,) = _args("powersgd:RANK", args, 1, 1)
    return PowerSGD(_int("powersgd:RANK", rank), seed=seed)


# One line per stage: a new stage is one class and one line here.
_stage("topk", "sparsifier", "topk:RATIO", _topk)
_stage("randomk", "sparsifier", "randomk:RATIO[:noscale]", _randomk)
_stage("threshold", "sparsifier", "threshold:TAU|auto[:DENSITY]", _threshold)
_stage("fp16", "values", "fp16", _no_args(Float16, "fp16"))
_stage("bf16", "values", "bf16", _no_args(BFloat16, "bf16"))
_stage("uniform", "values", "uniform:BITS[:BLOCK]", _uniform)
_stage("qsgd", "values", "qsgd:LEVELS[:BUCKET][:trits]", _qsgd)
_stage("sign", "values", "sign[:BLOCK]", _block_only(Sign, "sign"))
_stage("ternary", "values", "ternary[:BLOCK]", _block_only(Ternary, "ternary"))
_stage("raw", "indices", "raw", _no_args(RawIndices, "raw"))
_stage("delta-varint", "indices", "delta-varint", _no_args(DeltaVarint, "delta-varint"))
_stage("delta-golomb", "indices", "delta-golomb", _no_args(DeltaGolomb, "delta-golomb"))
_stage("delta-zlib", "indices", "delta-zlib", _no_args(DeltaZlib, "delta-zlib"))
_stage("delta-zstd", "indices", "delta-zstd", _no_args(DeltaZstd, "delta-zstd"))
_stage("none", "codec", "none", _no_args(Identity, "none"))
_stage("dense", "codec", "dense", _no_args(Identity, "dense"))
_stage("powersgd", "codec", "powersgd:RANK", _powersgd)
_BUILTIN = frozenset(_STAGES)


def register_codec(
    name: str, factory: CodecFactory, *, usage: str | None = None, replace: bool = False
) -> None:
    """Make ``name`` (and ``name:ARG``) a whole-vector codec built by ``factory(arg, seed)``.

    ``arg`` is the text after the first ``:`` (None without one). The codec
    can be combined with ``+ef`` only. Its ``spec`` should be the spec that
    rebuilds it (peers compare and rebuild codecs from it); if the factory
    leaves ``spec`` empty it is set to the spec text. ``usage`` is shown in
    error messages. Built-in names cannot be replaced; a user name can with
    ``replace=True``.

    Example::

        >>> from gossipdl.compression import build_codec, register_codec
        >>> from gossipdl.compression.floating import Float16
        >>> register_codec("half", lambda arg, seed: Float16(), replace=True)
        >>> build_codec("half+ef").spec
        'fp16+ef'
    """
    key = name.strip().lower() if isinstance(name, str) else ""
    if not _NAME.fullmatch(key) or key == "ef":
        raise CodecError(
            f"codec name must be lowercase letters, digits, '-' or '_' (no ':' or '+'), "
            f"and not 'ef'; got {name!r}"
        )
    if key in _BUILTIN:
        raise CodecError(f"{key!r} is a built-in codec stage and cannot be replaced")
    if key in _STAGES and not replace:
        raise CodecError(f"codec {key!r} is already registered; pass replace=True")
    if not callable(factory):
        raise CodecError(f"factory for codec {key!r} must be callable, got {factory!r}")

    def build(args: list[str], seed: int) -> object:
        return factory(":".join(args) if args else None, seed)

    _STAGES[key] = _Stage("codec", build=build, usage=usage or key)


def available_codecs() -> list[str]:
    """The accepted stage forms, grouped: sparsifiers, value codecs, index coders, whole codecs, ef.

    Example::

        >>> "topk:RATIO" in available_codecs()
        True
    """
    forms = [
        stage.usage
        for kind in (*_ORDER, "codec")
        for stage in _STAGES.values()
        if stage.kind == kind
    ]
    return [*forms, "module.path:ClassName", "ef"]


def builtin_codec(spec: str) -> bool:
    """Whether every stage of ``spec`` is registered in this process (so building it
    imports nothing): the only codecs a config from another peer may name.

    Example::

        >>> builtin_codec("topk:0.01+fp16+ef"), builtin_codec("mymodule:MyCodec")
        (True, False)
    """
    return all(part.split(":")[0].strip().lower() in (*_STAGES, "ef") for part in spec.split("+"))


def stage_names(spec: str) -> list[str]:
    """The stage names of a spec, without their arguments (what averagers pick defaults by).

    Example::

        >>> stage_names("topk:0.01+qsgd:16+ef")
        ['topk', 'qsgd', 'ef']
    """
    return [part.split(":")[0] for part in spec.split("+")]


def _choices() -> str:
    groups = []
    for kind in (*_ORDER, "codec"):
        usages = [s.usage for s in _STAGES.values() if s.kind == kind]
        if kind == "codec":
            usages.append("module.path:ClassName")
        groups.append(f"{_KIND_NAMES[kind]}s: {', '.join(usages)}")
    return "; ".join(groups) + "; then optionally +ef"


def build_codec(spec: str, seed: int = 0) -> Codec:
    """Build the codec named by ``spec``; ``seed`` fixes its random choices.

    See the module docstring for the grammar. Raises :class:`CodecError`
    naming the bad part and listing the allowed forms.

    Example::

        >>> import torch
        >>> codec = build_codec("topk:0.01+qsgd:16")
        >>> codec.spec
        'topk:0.01+qsgd:16+delta-golomb'
        >>> payload, sent = codec.encode(torch.randn(10_000))
        >>> int(payload.meta["k"]), bool((codec.decode(payload, 10_000) == sent).all())
        (100, True)
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"codec spec must be a non-empty string, got {spec!r}; {_choices()}")
    if isinstance(seed, bool) or not hasattr(type(seed), "__index__"):
        raise CodecError(f"codec seed must be an integer, got {seed!r}")
    seed = operator.index(seed)
    parts = [part.strip() for part in spec.split("+")]
    if any(not part for part in parts):
        raise CodecError(f"codec spec {spec!r} has an empty stage (a stray '+')")
    feedback = parts[-1].lower() == "ef"
    if feedback:
        parts = parts[:-1]
    if not parts:
        raise CodecError(f"codec spec {spec!r}: 'ef' needs a codec to wrap, e.g. 'sign+ef'")
    built: dict[str, object] = {}
    last = -1
    for part in parts:
        if part.lower() == "ef":
            raise CodecError(f"codec spec {spec!r}: 'ef' must be the last stage")
        kind, stage = _build_stage(part, spec, seed)
        if kind == "codec":
            if len(parts) > 1:
                raise CodecError(
                    f"codec spec {spec!r}: {part!r} is a whole-vector codec and combines "
                    "only with '+ef'"
                )
            codec = stage
            break
        position = _ORDER.index(kind)
        if kind in built:
            raise CodecError(f"codec spec {spec!r}: two {_KIND_NAMES[kind]}s ({part!r})")
        if position < last:
            raise CodecError(
                f"codec spec {spec!r}: {part!r} is out of order; stages go "
                "[sparsifier]+[value codec]+[index coder]+[ef]"
            )
        last = position
        built[kind] = stage
    else:
        codec = _compose(spec, built)
    assert isinstance(codec, Codec)
    return ErrorFeedback(codec) if feedback else codec


def _compose(spec: str, built: dict[str, object]) -> Codec:
    sparsifier = built.get("sparsifier")
    values = built.get("values")
    indices = built.get("indices")
    if sparsifier is None:
        if indices is not None:
            raise CodecError(
                f"codec spec {spec!r}: an index coder needs a sparsifier before it, "
                "e.g. 'topk:0.01+delta-golomb'"
            )
        assert isinstance(values, ValueCodec)
        return values
    assert isinstance(sparsifier, Sparsifier)
    if values is None:
        values = Identity()
    assert isinstance(values, ValueCodec)
    if indices is None and sparsifier.sends_indices:
        indices = _STAGES[DEFAULT_INDEX_CODER].build([], 0)
    if indices is not None and not sparsifier.sends_indices:
        raise CodecError(
            f"codec spec {spec!r}: {sparsifier.spec} regenerates its indices from a seed "
            "and sends none; drop the index coder"
        )
    assert indices is None or isinstance(indices, IndexCoder)
    return SparseCodec(sparsifier, values, indices)


def _build_stage(part: str, spec: str, seed: int) -> tuple[str, object]:
    head, *args = [piece.strip() for piece in part.split(":")]
    stage = _STAGES.get(head.lower())
    if stage is not None:
        try:
            built = stage.build(args, seed)
        except CodecError as exc:
            raise CodecError(f"codec spec {spec!r}, stage {part!r}: {exc}") from None
        if stage.kind == "codec":
            if not isinstance(built, Codec):
                raise CodecError(f"codec {head!r} built {type(built).__name__}, not a Codec")
            if not getattr(built, "spec", ""):
                built.spec = part
        return stage.kind, built
    if len(args) == 1 and is_dotted(head) and is_dotted(args[0]):
        return "codec", _load_class(head, args[0], seed)
    raise CodecError(f"codec spec {spec!r}: unknown stage {part!r}; {_choices()}")


def _load_class(module_name: str, attr: str, seed: int) -> Codec:
    """Import ``module_name``, look up ``attr`` and call it with ``seed=seed``."""
    spec = f"{module_name}:{attr}"
    target = load_callable(spec, "codec spec", CodecError)
    codec = call_plugin(target, spec, "codec spec", CodecError, seed=seed)
    if not isinstance(codec, Codec):
        raise CodecError(f"codec spec {spec!r} built {type(codec).__name__}, not a Codec")
    if not getattr(codec, "spec", ""):
        codec.spec = spec
    return codec
