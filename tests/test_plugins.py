"""User code named by ``module.path:function`` (models, datasets, topologies, codecs): a
module that fails to import, or a factory gossipdl cannot call as documented, is refused
with the caller's own error naming the spec, never a traceback."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gossipdl.compression import CodecError, build_codec
from gossipdl.data import DataError, load_dataset
from gossipdl.models import ModelError, build_model
from gossipdl.topologies import TopologyError, build_topology

BUILDERS: list[tuple[Callable[[str], object], type[Exception]]] = [
    (lambda spec: build_model(spec, (4,), 2), ModelError),
    (load_dataset, DataError),
    (lambda spec: build_topology(spec, 4), TopologyError),
    (build_codec, CodecError),
]


@pytest.fixture
def broken_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Two importable modules that fail on import: a syntax error on line 2, and a name
    error raised by the module's top level on line 3."""
    (tmp_path / "gossipdl_test_syntax.py").write_text("x = 1\ndef f(:\n    pass\n")
    (tmp_path / "gossipdl_test_raises.py").write_text("import math\n\nx = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("gossipdl_test_syntax", "gossipdl_test_raises"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("build", "error"), BUILDERS, ids=["model", "dataset", "topology", "codec"]
)
def test_a_plugin_module_that_fails_on_import_is_the_callers_error(
    broken_modules: Path, build: Callable[[str], object], error: type[Exception]
) -> None:
    """A SyntaxError or a module-level exception escaped as a raw traceback (only an
    ImportError was caught): now the message names the spec, the module, the exception
    and where it was raised."""
    syntax = broken_modules / "gossipdl_test_syntax.py"
    with pytest.raises(error) as info:
        build("gossipdl_test_syntax:f")
    said = str(info.value)
    assert "'gossipdl_test_syntax:f'" in said and "module 'gossipdl_test_syntax'" in said
    assert f"{syntax}:2: SyntaxError" in said
    with pytest.raises(error) as info:
        build("gossipdl_test_raises:f")
    said = str(info.value)
    assert "'gossipdl_test_raises:f'" in said
    assert re.search(r"gossipdl_test_raises\.py:3: NameError: name 'undefined_name'", said)


def test_a_factory_whose_signature_does_not_fit_names_the_call_it_must_take() -> None:
    """A model builder without ``hidden`` and a dataset factory wanting an argument raised
    a bare TypeError from inside gossipdl; topologies already said what call failed."""
    with pytest.raises(ModelError) as info:
        build_model(f"{__name__}:no_hidden", (4,), 2)
    said = str(info.value)
    assert f"'{__name__}:no_hidden'" in said and "unexpected keyword argument 'hidden'" in said
    assert "no_hidden(input_shape, num_classes, hidden)" in said
    with pytest.raises(DataError, match=re.escape("calling wants_size() failed: missing")):
        load_dataset(f"{__name__}:wants_size")
    with pytest.raises(TopologyError, match=re.escape("calling no_seed(n=4, seed=0) failed")):
        build_topology(f"{__name__}:no_seed", 4)


def test_a_type_error_inside_a_factory_is_not_taken_for_a_wrong_signature() -> None:
    """Only the signature is checked before the call: the user's own bug is named as such,
    with the line that raised it, and chained to it (its traceback into their code)."""
    with pytest.raises(ModelError, match=r"buggy\(.*\) raised .*test_plugins.py:\d+: Type") as got:
        build_model(f"{__name__}:buggy", (4,), 2)
    assert "give buggy the signature" not in str(got.value)
    assert isinstance(got.value.__cause__, TypeError)


def test_a_decorated_factory_is_checked_by_its_wrappers_own_signature() -> None:
    """``functools.wraps`` makes ``inspect.signature`` read the wrapped function's: a
    wrapper taking ``(n, seed)`` around a function of three was refused."""
    topology = build_topology(f"{__name__}:wrapped_ring", 4, seed=0)
    assert topology.n == 4


def _ring_with(n: int, seed: int, extra: str) -> object:
    return build_topology("ring", n, seed=seed)


@functools.wraps(_ring_with)
def wrapped_ring(n: int, seed: int) -> object:
    return _ring_with(n, seed, "filled in")


def no_hidden(input_shape: tuple[int, ...], num_classes: int) -> object:
    raise AssertionError("not called")


def wants_size(size: int) -> object:
    raise AssertionError("not called")


def no_seed(n: int) -> object:
    raise AssertionError("not called")


def buggy(input_shape: tuple[int, ...], num_classes: int, hidden: object) -> object:
    raise TypeError("the builder's own bug")
