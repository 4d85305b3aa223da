"""The protocol core is sans-IO: these modules import no I/O library (DESIGN.md §2)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PURE = ["fabric.frame", "fabric.memory", "fabric.control", "fabric.semantic",
        "fabric.hostnode", "fabric.topology", "switchd.aggregation",
        "fabric.reliability", "fabric.faults", "fabric.testing"]
IO_LIBS = {"zmq", "socket", "asyncio", "selectors", "subprocess", "threading", "time"}


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_no_io(name: str) -> None:
    path = Path(importlib.import_module(name).__file__ or "")
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & IO_LIBS, f"{name} imports {imported & IO_LIBS}"
