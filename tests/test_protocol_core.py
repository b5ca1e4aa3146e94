"""The protocol core is free of I/O: no sockets, threads, clocks or the real engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gossipdl

FORBIDDEN = ("zmq", "threading", "socket", "time", "asyncio", "gossipdl.transport.sockets",
             "gossipdl.peers")  # fmt: skip
ROOT = Path(gossipdl.__file__).parent
# The codec, averaging and topology packages stay as they are and are called from the core;
# one of them takes a lock: the codecs' buffer pool, which a finalizer on any thread may enter.
ALLOWED = {("gossipdl.compression._kernels", "threading")}


def _module_file(name: str) -> Path | None:
    """The source of gossipdl module ``name`` (a package's ``__init__``), None if not ours."""
    if name != "gossipdl" and not name.startswith("gossipdl."):
        return None
    base = ROOT.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path, module: str, everywhere: bool) -> set[str]:
    """The modules ``path`` imports when it loads (``everywhere``: in its functions too),
    and the packages above each (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``).
    Imports under ``if TYPE_CHECKING:`` never run and do not count."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        if everywhere or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    with_parents = set(names)
    for name in names:
        parts = name.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return with_parents


def import_graph(start: str) -> dict[str, set[str]]:
    """gossipdl module -> what it imports, for every gossipdl module reachable from ``start``
    (the protocol's own modules with the imports inside their functions too)."""
    graph: dict[str, set[str]] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in graph or path is None:
            continue
        inside = name if path.name != "__init__.py" else name + ".x"
        graph[name] = _imports(path, inside, everywhere=name.startswith("gossipdl.protocol"))
        todo.extend(graph[name])
    return graph


def test_the_protocol_core_imports_no_io_and_not_the_real_engine() -> None:
    modules = [f"gossipdl.protocol.{p.stem}" for p in (ROOT / "protocol").glob("*.py")]
    graph: dict[str, set[str]] = {}
    for module in modules:
        graph.update(import_graph(module))
    assert "gossipdl.protocol.core" in graph and "gossipdl.averaging" in graph
    bad = {
        module: sorted(
            n
            for n in imported
            if (n in FORBIDDEN or n.startswith(FORBIDDEN[-1] + ".")) and (module, n) not in ALLOWED
        )
        for module, imported in graph.items()
    }
    assert not {m: b for m, b in bad.items() if b}, "the protocol core reaches I/O"


def test_the_import_check_sees_an_import_of_the_real_engine() -> None:
    """The checker is not blind: the real engine's modules do import sockets and threads."""
    graph = import_graph("gossipdl.peers.peer")
    assert {"threading", "zmq", "gossipdl.transport.sockets"} <= set().union(*graph.values())


def test_importing_the_core_loads_no_socket_library_and_not_the_real_engine() -> None:
    """What Python really loads (torch brings threading and asyncio of its own)."""
    probe = (
        "import sys, gossipdl.protocol.core, gossipdl.sim.clock; "
        "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith("
        "('gossipdl.peers', 'gossipdl.transport.sockets', 'gossipdl.config'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
