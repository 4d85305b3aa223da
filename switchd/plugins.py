"""Services named on a command line: ``module:Class`` or ``path/to/file.py:Class``.

The drivers (the switch daemon, the simulator) load the in-network services a
user adds (:class:`switchd.core.Service` subclasses) by name, so the same
class runs on real processes and in virtual time. A name that does not load
is a :class:`~fabric.errors.UsageError` saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from fabric.errors import UsageError
from switchd.core.service import Service
from switchd.core.switch import ServiceFactory

__all__ = ["load_service", "load_services"]


def load_service(spec: str | ServiceFactory) -> ServiceFactory:
    """The service class named by ``spec`` (a class or factory passes through)."""
    if not isinstance(spec, str):
        return spec
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise UsageError(f"service {spec!r}: write module:Class or path/to/file.py:Class")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise UsageError(f"service {spec!r}: no file {where}")
            name = f"semfab_service_{path.stem}"
            module = sys.modules.get(name)
            if module is None:
                loader = importlib.util.spec_from_file_location(name, path)
                assert loader is not None and loader.loader is not None
                module = importlib.util.module_from_spec(loader)
                sys.modules[name] = module  # dataclasses look their module up
                loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"service {spec!r}: cannot import {where}: "
                         f"{type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise UsageError(f"service {spec!r}: {attr} in {where} is not a subclass of "
                         "switchd.core.Service")
    return cls


def load_services(specs: Sequence[str | ServiceFactory]) -> list[ServiceFactory]:
    """Every service of ``specs``, loaded (see :func:`load_service`)."""
    return [load_service(s) for s in specs]
