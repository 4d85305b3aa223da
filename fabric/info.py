"""`semfab info`: what this machine offers semfab."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tomllib
from importlib import metadata
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def semfab_version() -> str:
    """semfab's version: the installed distribution's, else the source checkout's pyproject."""
    try:
        return metadata.version("semfab")
    except metadata.PackageNotFoundError:
        pass
    # Run from a checkout without `pip install -e .` (python -m fabric).
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        with pyproject.open("rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


#: One module of each compiled part stands for it (setup.py compiles them all or none).
BUILD_PROBES = ("fabric.core.frame", "fabric.core.programs", "switchd.core.switch",
                "switchd.core.engine", "fabric.sim.engine")


def build() -> str:
    """Which build of the core runs: ``compiled (mypyc)``, ``plain`` (interpreted),
    or ``mixed`` naming the compiled modules (a stale or partial build)."""
    import importlib

    compiled = [m for m in BUILD_PROBES
                if not str(importlib.import_module(m).__file__ or "").endswith(".py")]
    if not compiled:
        return "plain"
    if len(compiled) == len(BUILD_PROBES):
        return "compiled (mypyc)"
    return f"mixed (compiled: {', '.join(compiled)})"


def collect() -> dict[str, object]:
    """Backends (available or why not), GPU and versions, as plain data."""
    import zmq

    from kernels import describe_backends, gpu_info

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "build": build(),
        "versions": {
            "semfab": semfab_version(),
            "numpy": _version("numpy"),
            "numba": _version("numba"),
            "pyzmq": zmq.pyzmq_version(),
            "libzmq": zmq.zmq_version(),
            "msgpack": _version("msgpack"),
            "ml_dtypes": _version("ml_dtypes"),
            "cupy": _version("cupy-cuda12x"),
            "torch": _version("torch"),
            "mpi4py": _version("mpi4py"),
        },
        "gpu": gpu_info(),
        "backends": [
            {"name": b.name, "available": b.available, "reason": b.reason, "device": b.device}
            for b in describe_backends()
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Print the report as text or JSON."""
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"semfab {info['versions']['semfab']}  python {info['python']}  "  # type: ignore[index]
          f"{info['platform']}")
    print(f"build: {info['build']} (SEMFAB_COMPILE=1 pip install . compiles the core)")
    print(f"GPU: {info['gpu'] or 'none found'}")
    print("kernel backends:")
    for b in info["backends"]:  # type: ignore[attr-defined]
        state = "available" if b["available"] else "unavailable"
        detail = b["device"] if b["available"] else b["reason"]
        print(f"  {b['name']:<11} {state:<12} {detail}")
    print("versions:")
    for name, ver in info["versions"].items():  # type: ignore[attr-defined]
        print(f"  {name:<10} {ver}")
    return 0
