"""Applying a CPU plan (:func:`fabric.placement.cpu_plan`) inside a launched process.

The launcher hands each process its CPUs in ``SEMFAB_CPUS``; the process pins
its main thread first thing, so the threads it starts later (ZeroMQ's I/O
thread) inherit the mask. A switch's kernel thread pool must not: a large
reduction needs every core, so the memory plane widens the pool's threads
back to the whole machine once it exists (:func:`widen_other_threads`).
``SEMFAB_PIN=0`` turns the plan off, for comparisons.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping

log = logging.getLogger("semfab.affinity")

#: The CPUs a launched process runs on, comma-separated (set by the launcher).
ENV = "SEMFAB_CPUS"
#: "0" launches fabrics without a CPU plan.
PIN_ENV = "SEMFAB_PIN"

_before: frozenset[int] | None = None  # the mask this process had before pinning
_plan: frozenset[int] | None = None  # the mask pin_from_env set


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """True unless ``SEMFAB_PIN=0``."""
    return env.get(PIN_ENV, "1") != "0"


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def encode(cpus: Iterable[int]) -> str:
    """The ``SEMFAB_CPUS`` value for ``cpus``."""
    return ",".join(str(c) for c in sorted(cpus))


def pin_from_env(env: Mapping[str, str] = os.environ) -> tuple[int, ...] | None:
    """Pin the calling thread to the CPUs in ``SEMFAB_CPUS``; the CPUs, or None
    when there is no plan (or it cannot be applied, which is logged: the
    process then runs unpinned, as it would without a plan)."""
    global _before, _plan
    text = env.get(ENV, "")
    if not text:
        return None
    try:
        cpus = {int(c) for c in text.split(",")}
        before = frozenset(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        log.warning("%s=%r not applied (%s); running unpinned", ENV, text, exc)
        return None
    _before, _plan = before, frozenset(cpus)
    log.info("pinned to CPU %s", encode(cpus))
    return tuple(sorted(cpus))


def widen(wide: bool) -> None:
    """Let the calling thread run on every CPU the process had (``wide``), or
    on its planned ones again. A worker widens for a memory-plane call it
    waits for blocked (beyond the spin limit): it does not compete with the
    switch then, and its own copies of a large tensor may use every core."""
    if _before is None or _plan is None:
        return
    os.sched_setaffinity(0, _before if wide else _plan)


def widen_other_threads() -> int:
    """Let every thread but the caller run on the CPUs the process had before
    :func:`pin_from_env`; how many threads were widened (0 when not pinned)."""
    if _before is None:
        return 0
    me = threading.get_native_id()
    n = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == me:
            continue
        try:
            os.sched_setaffinity(tid, _before)
            n += 1
        except OSError:  # a thread that just ended
            continue
    return n
