"""Layering: the protocol core is sans-IO (docs/ARCHITECTURE.md, "Pure core").

The folders say which is which: every module under a core package (and the
few shared modules named below) is walked, relative imports included: none may
import an I/O library or read a clock, and none may import a driver package
(the emulation's sockets and processes, the simulator, serving, the CLIs).
The package code has no import cycle, type-only imports included.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(importlib.import_module("fabric").__file__ or "").parent.parent
TOP = ("fabric", "switchd", "kernels", "bench")

#: The pure protocol core, by package: frames, control, reliability, regions,
#: topology, link pipelines, the collective programs, workloads; the switch's
#: forwarding core and its in-network services.
PURE_PACKAGES = ("fabric.core", "switchd.core")
#: Pure modules outside those packages: the shared error types, the public
#: testing helpers (fake clock, in-memory links), the dtype and op registry, the
#: NumPy reference kernels.
PURE_MODULES = ("fabric.errors", "fabric.testing", "kernels.dtypes", "kernels.reference")
#: Driver packages: they import the core, never the other way round.
DRIVER_PACKAGES = ("fabric.emulation", "fabric.sim", "fabric.serving", "fabric.torch", "fabric.cli",
                   "fabric.info", "switchd.daemon", "switchd.memplane", "switchd.cli",
                   "switchd.plugins", "bench")
IO_LIBS = {"zmq", "socket", "asyncio", "selectors", "subprocess", "threading", "time", "mmap",
           "os", "signal", "multiprocessing", "aiohttp", "shutil"}
#: The core's allowed third-party imports.
ALLOWED = {"numpy", "ml_dtypes", "msgpack", "crc32c", "typing_extensions", "mypy_extensions",
           "fabric", "switchd", "kernels"}
#: Narrow exceptions, with the reason. The topology model builds socket paths
#: (os.path, os.fspath) and parses files; it never opens a socket or reads a clock.
EXCEPTIONS = {"fabric.core.topology": {"os"}}


def _modules(top: str = "") -> dict[str, Path]:
    """Every module of the package code (``top`` only, when given), by dotted name."""
    out: dict[str, Path] = {}
    for pkg in TOP:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not top or name == top or name.startswith(top + "."):
                out[name] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str:
    """The module an imported name lives in (``a.b.C`` -> ``a.b``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def _imports(name: str, path: Path, *, type_only: bool = True) -> set[str]:
    """Absolute names of every module ``name`` imports (relative ones resolved);
    imports under ``if TYPE_CHECKING:`` count unless ``type_only`` is false."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


PURE = sorted(n for n in _modules() if _under(n, PURE_PACKAGES) or n in PURE_MODULES)


def test_the_core_packages_hold_modules() -> None:
    assert len([n for n in PURE if n.startswith("fabric.core.")]) >= 10
    assert any(n.startswith("switchd.core") for n in PURE)


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_no_io_and_no_driver(name: str) -> None:
    imported = _imports(name, _modules()[name])
    roots = {m.split(".")[0] for m in imported}
    io = roots & IO_LIBS - EXCEPTIONS.get(name, set())
    assert not io, f"{name} imports {sorted(io)}"
    drivers = {m for m in imported if _under(m, DRIVER_PACKAGES)}
    assert not drivers, f"{name} imports driver modules {sorted(drivers)}"
    mods = _modules()
    ours = {_resolve(m, mods) for m in imported if m.split(".")[0] in TOP}
    outside = {m for m in ours if m not in PURE and m not in ("fabric", "switchd")}
    assert not outside, f"{name} imports {sorted(outside)}, which is not core"
    third = roots - set(sys.stdlib_module_names) - ALLOWED - {"__future__"}
    assert not third, f"{name} imports {sorted(third)}; allowed: {sorted(ALLOWED)}"


def test_every_module_is_core_or_driver() -> None:
    """A new module lands in a core package or a driver one: nothing slips through."""
    loose = [n for n in _modules() if n not in TOP and not n.endswith("__main__")
             and n not in PURE and not _under(n, DRIVER_PACKAGES)
             and not _under(n, ("kernels",))]
    assert not loose, f"put these under a core or a driver package: {loose}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package_code() -> None:
    """Type-only imports count: a cycle of types is still a cycle of ideas."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for imported in _imports(name, path):
            m = _resolve(imported, mods)
            if m and m != name and not name.startswith(m + "."):
                edges.add(m)
        graph[name] = edges
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_a_cycle_is_found() -> None:
    """The detector itself: a two-module loop and a three-module loop."""
    found = _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": set()})
    assert sorted(found) == [["a", "b"], ["c", "d", "e"]]


def test_fabric_is_packages_not_a_flat_list() -> None:
    top = [p for p in (ROOT / "fabric").glob("*.py")]
    assert len(top) <= 12, f"fabric/ holds {len(top)} modules at its top level"
    for pkg in ("core", "emulation", "sim", "serving"):
        assert (ROOT / "fabric" / pkg / "__init__.py").exists()
