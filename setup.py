"""The compiled build: ``SEMFAB_COMPILE=1 pip install .`` compiles the pure core
with mypyc (the same source; docs/ARCHITECTURE.md, "The compiled core").

Everything else is in pyproject.toml. Without SEMFAB_COMPILE=1, and for every
editable install (a built module would shadow the edits), the build is plain.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent

#: The modules compiled: the nodes' and the switch's pure cores and the
#: simulator's event loop. Interpreted code subclasses only classes marked
#: ``allow_interpreted_subclasses``.
COMPILED_PACKAGES = ("fabric/core", "switchd/core")
COMPILED_MODULES = ("fabric/sim/engine.py", "kernels/dtypes.py")


def compiled_sources() -> list[str]:
    """Every source file the compiled build compiles, relative to the root."""
    files = [str(p.relative_to(ROOT)) for pkg in COMPILED_PACKAGES
             for p in sorted((ROOT / pkg).glob("*.py")) if p.name != "__init__.py"]
    return files + list(COMPILED_MODULES)


def _ext_modules() -> list[object]:
    if os.environ.get("SEMFAB_COMPILE", "0") in ("", "0"):
        return []
    if any(cmd.startswith("editable") for cmd in sys.argv) or "develop" in sys.argv:
        print("semfab: SEMFAB_COMPILE=1 ignored for an editable install "
              "(compiled modules would shadow your edits)", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    # SEMFAB_MULTI_FILE=1 (CI): one C file per module, which compiles in about 100 s
    # instead of 170 s here; the same code, but calls across modules are not
    # inlined (bench core's ina-mem row was slower), so releases keep one file
    multi = os.environ.get("SEMFAB_MULTI_FILE", "0") not in ("", "0")
    return list(mypycify(compiled_sources(), opt_level="3", multi_file=multi))


setup(ext_modules=_ext_modules())
