"""The two builds of the core: which one runs, and the rules that keep the source
compilable by mypyc (docs/ARCHITECTURE.md, "The compiled core").

CI runs the suite on the plain build and the core and simulation tests again
on the compiled one, with SEMFAB_EXPECT_BUILD=compiled: then a stale or partial
build fails here instead of passing quietly as plain code.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.info import BUILD_PROBES, build

ROOT = Path(__file__).resolve().parents[1]


def _compiled_sources() -> list[Path]:
    """The files setup.py compiles (read from it without running setuptools)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("COMPILED_PACKAGES", "COMPILED_MODULES"):
                found[name] = tuple(ast.literal_eval(node.value))
    files = [p for pkg in found["COMPILED_PACKAGES"] for p in sorted((ROOT / pkg).glob("*.py"))
             if p.name != "__init__.py"]
    return files + [ROOT / m for m in found["COMPILED_MODULES"]]


def test_the_build_is_the_one_expected() -> None:
    expected = os.environ.get("SEMFAB_EXPECT_BUILD")
    got = build()
    if expected == "compiled":
        assert got == "compiled (mypyc)", got
        for path in _compiled_sources():
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            file = str(importlib.import_module(name).__file__)
            assert not file.endswith(".py"), f"{name} runs from {file}, not compiled"
    else:
        assert got in ("plain", "compiled (mypyc)"), got


def test_the_probes_are_compiled_sources() -> None:
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _compiled_sources()}
    assert set(BUILD_PROBES) <= names


def test_semfab_info_says_which_build() -> None:
    out = subprocess.run([sys.executable, "-m", "fabric", "info"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert f"build: {build()}" in out


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _except_name_clashes(source: str) -> list[str]:
    """Names bound by ``except ... as`` clauses of different types in one function:
    compiled, the second binding can take the first one's type (mypyc issue #620)."""
    clashes = []
    for fn in _functions(ast.parse(source)):
        seen: dict[str, str] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.ExceptHandler) and node.name:
                kind = ast.unparse(node.type) if node.type else ""
                if seen.setdefault(node.name, kind) != kind:
                    clashes.append(f"{fn.name}: {node.name} is {seen[node.name]} and {kind}")
    return clashes


def _method_aliases(source: str) -> list[str]:
    """``__rand__ = __and__`` in a class body: compiled, the alias fails at import."""
    found = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name) \
                    and stmt.value.id in methods:
                found.append(f"{cls.name}: {ast.unparse(stmt)}")
    return found


def test_the_rules_catch_what_they_are_for() -> None:
    clash = ("def f():\n    try: g()\n    except KeyError as exc: h(exc)\n"
             "    try: g()\n    except OSError as exc: h(exc)\n")
    assert _except_name_clashes(clash) == ["f: exc is KeyError and OSError"]
    assert _method_aliases("class F:\n    def __and__(s, o): ...\n    __rand__ = __and__\n")


@pytest.mark.parametrize("path", _compiled_sources(), ids=lambda p: p.name)
def test_compiled_sources_keep_the_mypyc_rules(path: Path) -> None:
    source = path.read_text()
    assert not _except_name_clashes(source), _except_name_clashes(source)
    assert not _method_aliases(source), _method_aliases(source)
