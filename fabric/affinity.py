"""Applying a CPU plan (:func:`fabric.placement.cpu_plan`) inside a launched process.

The launcher hands each process its CPUs in ``SEMFAB_CPUS``. The plan keeps
spinning waiters out of each other's way, so it holds where they spin: a
switch pins its main thread first thing (ZeroMQ's I/O thread, started later,
inherits the mask) and leaves its core only for a memory-plane chunk large
enough for the kernel's thread pool (switchd.memplane); a worker keeps to its
CPUs only for the memory-plane calls it waits for spinning (:func:`hold`).
The kernel's pool is widened for good (:func:`widen_other_threads`).
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

_before: frozenset[int] | None = None  # the mask this process had before the plan
_plan: frozenset[int] | None = None  # the planned mask (SEMFAB_CPUS)
_held = False  # the calling thread keeps to _plan now


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """True unless ``SEMFAB_PIN=0``."""
    return env.get(PIN_ENV, "1") != "0"


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def encode(cpus: Iterable[int]) -> str:
    """The ``SEMFAB_CPUS`` value for ``cpus``."""
    return ",".join(str(c) for c in sorted(cpus))


def setup_from_env(env: Mapping[str, str] = os.environ, *, pin: bool) -> tuple[int, ...] | None:
    """Take this process's planned CPUs from ``SEMFAB_CPUS`` and, with ``pin``,
    keep the calling thread to them from now on (else only while :func:`hold`
    says so). The CPUs, or None when there is no plan (or it cannot be applied,
    which is logged: the process then runs unpinned, as without a plan)."""
    global _before, _plan, _held
    text = env.get(ENV, "")
    if not text:
        return None
    try:
        cpus = frozenset(int(c) for c in text.split(","))
        before = frozenset(os.sched_getaffinity(0))
        if pin:
            os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        log.warning("%s=%r not applied (%s); running unpinned", ENV, text, exc)
        return None
    _before, _plan, _held = before, cpus, pin
    log.info("planned CPUs %s (%s)", encode(cpus), "pinned" if pin else "while spinning")
    return tuple(sorted(cpus))


def hold(narrow: bool) -> None:
    """Keep the calling thread to its planned CPUs (``narrow``) or let it run on
    every CPU the process had; a system call only when that changes."""
    global _held
    if _plan is None or _before is None or narrow is _held:
        return
    os.sched_setaffinity(0, _plan if narrow else _before)
    _held = narrow


def widen_other_threads() -> int:
    """Let every thread but the caller run on the CPUs the process had before
    the plan; how many threads were widened (0 without a plan)."""
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
