"""Layering: the protocol core is sans-IO (docs/ARCHITECTURE.md, "Pure core").

Every module of the core is walked, relative imports included: none may import
an I/O library or read a clock, and none may import a driver module (the
emulation's sockets and processes, or the simulator, which drives the core).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

#: The pure protocol core: frames, control, reliability, regions, topology, link
#: pipelines, the switch's decisions, the collective programs, workloads.
PURE = [
    "fabric.frame", "fabric.control", "fabric.memory", "fabric.semantic", "fabric.hostnode",
    "fabric.topology", "fabric.reliability", "fabric.timers", "fabric.faults", "fabric.link",
    "fabric.programs", "fabric.collective_programs", "fabric.moe", "fabric.workload",
    "fabric.errors", "fabric.testing", "fabric.placement",
    "switchd.aggregation", "switchd.core", "switchd.shaper", "kernels.dtypes",
]
IO_LIBS = {"zmq", "socket", "asyncio", "selectors", "subprocess", "threading", "time", "mmap",
           "os", "signal", "multiprocessing", "aiohttp", "shutil"}
#: Driver modules: the core never imports them (they import the core).
DRIVERS = {"fabric.endpoint", "fabric.transport", "fabric.launcher", "fabric.launch_cli",
           "fabric.node", "fabric.shm", "fabric.doorbell", "fabric.frametrace", "fabric.p2p",
           "fabric.collectives",
           "fabric.cli", "fabric.rendezvous", "fabric.run_cli",
           "fabric.serving", "fabric.sim", "fabric.communicator", "switchd.daemon",
           "switchd.memplane", "switchd.cli", "fabric.emulation", "bench"}
#: The core's allowed third-party imports.
ALLOWED = {"numpy", "ml_dtypes", "msgpack", "crc32c", "typing_extensions", "fabric", "switchd",
           "kernels"}
#: Narrow exceptions, with the reason. The topology model builds socket paths
#: (os.path, os.fspath) and parses files; it never opens a socket or reads a clock.
EXCEPTIONS = {"fabric.topology": {"os"}}


def _imports(name: str) -> set[str]:
    """Absolute names of every module ``name`` imports (relative ones resolved)."""
    mod = importlib.import_module(name)
    path = Path(mod.__file__ or "")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_no_io_and_no_driver(name: str) -> None:
    imported = _imports(name)
    roots = {m.split(".")[0] for m in imported}
    io = roots & IO_LIBS - EXCEPTIONS.get(name, set())
    assert not io, f"{name} imports {sorted(io)}"
    drivers = {m for m in imported if any(m == d or m.startswith(d + ".") for d in DRIVERS)}
    assert not drivers, f"{name} imports driver modules {sorted(drivers)}"
    import sys

    third = roots - set(sys.stdlib_module_names) - ALLOWED - {"__future__"}
    assert not third, f"{name} imports {sorted(third)}; allowed: {sorted(ALLOWED)}"


def test_every_module_of_the_core_packages_is_classified() -> None:
    """A new module must be declared pure or a driver: nothing slips through."""
    root = Path(importlib.import_module("fabric").__file__ or "").parent.parent
    known = set(PURE) | DRIVERS
    missing = []
    for pkg in ("fabric", "switchd"):
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            if name.endswith("__init__") or name.endswith("__main__"):
                continue
            if not any(name == k or name.startswith(k + ".") for k in known | EXTRA_DRIVERS):
                missing.append(name)
    assert not missing, f"declare these pure (PURE) or drivers (DRIVERS): {missing}"


#: Driver-side helpers that are neither core nor an entry point above.
EXTRA_DRIVERS = {"fabric.info", "fabric.errors"}
