"""What the processes of a placed run (`semfab run`) leave on their host, and who
removes it.

Each process of a placed run on a host shares one socket folder there (by
default ``/tmp/semfab-run-<port>``) and creates shared-memory files named
``semfab-<run id>-...``. No process on that host is the others' parent, so
none can simply remove everything at the end: the others may still run, and
any of them may be killed before its own cleanup. Instead each process marks
its presence in the folder (``<node>.pid``: its pid and run id) and, when it
leaves, under a lock on the folder:

* removes its mark and its node's socket file (ZeroMQ leaves a bound ipc
  socket's file behind);
* removes the marks and socket files of processes that died (their pid is
  gone), and the shared memory of any run with no live process left here
  (and the temporary folder of its coordinator, if one was killed here);
* when no mark is left, it was the last one out: it removes the socket files
  of the topology's nodes and, if the folder is the default one, the folder.

A process joining sweeps the same way first, so what a run killed outright
(every process of a host at once) left is removed by the next run there.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fabric.emulation.shm import SHM_DIR

MARK_SUFFIX = ".pid"


def pid_gone(pid: int) -> bool:
    """True when no process ``pid`` runs on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False  # unknown: assume alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


@contextmanager
def _locked(folder: Path, create: bool = False) -> Iterator[None]:
    """Hold the folder's lock; with ``create``, make it first (again, if the last
    process out of an earlier run removed it while this one waited for the lock)."""
    while True:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(folder).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same or not create:
                yield
                return
        finally:
            os.close(fd)  # closing releases the lock


def _marks(folder: Path) -> list[tuple[Path, int, str]]:
    """(mark, pid, run id) of every process that marked its presence here."""
    out = []
    for mark in folder.glob(f"*{MARK_SUFFIX}"):
        try:
            pid_text, run_id = mark.read_text().split()
            out.append((mark, int(pid_text), run_id))
        except (OSError, ValueError):
            continue  # half-written by a process starting now, or not ours
    return out


def _remove_run(run_id: str) -> None:
    """The run's shared memory here, and the temporary folder its coordinator
    keeps here (``semfab-<run id>-*``, removed at its end unless it was killed)."""
    for leftover in SHM_DIR.glob(f"semfab-{run_id}-*"):
        leftover.unlink(missing_ok=True)
    for folder in Path(tempfile.gettempdir()).glob(f"semfab-{run_id}-*"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


def _sweep(folder: Path, ended: Iterable[str]) -> list[tuple[Path, int, str]]:
    """Remove the dead's marks and sockets, and the shared memory of runs ``ended``
    or left with no live process here; the live marks."""
    live, runs = [], set(ended)
    for mark, pid, run_id in _marks(folder):
        if pid_gone(pid):
            mark.unlink(missing_ok=True)
            (folder / f"{mark.name.removesuffix(MARK_SUFFIX)}.sock").unlink(missing_ok=True)
            runs.add(run_id)
        else:
            live.append((mark, pid, run_id))
    for run_id in runs - {run_id for _, _, run_id in live}:
        _remove_run(run_id)
    return live


def arrive(folder: Path, name: str, run_id: str) -> None:
    """Create ``folder`` if need be, sweep what dead processes left, mark this one."""
    with _locked(folder, create=True):
        _sweep(folder, ())
        mark = folder / f"{name}{MARK_SUFFIX}"
        tmp = folder / f".{name}{MARK_SUFFIX}.tmp"
        tmp.write_text(f"{os.getpid()} {run_id}\n")
        os.replace(tmp, mark)  # never read half-written


def leave(folder: Path, name: str, run_id: str, nodes: Iterable[str], *,
          remove_folder: bool) -> None:
    """This process is done: remove its traces, the dead's, and, as the last one
    out of this host, the run's (``nodes``: the topology's node names)."""
    try:
        with _locked(folder):
            (folder / f"{name}{MARK_SUFFIX}").unlink(missing_ok=True)
            (folder / f"{name}.sock").unlink(missing_ok=True)
            if _sweep(folder, [run_id]):
                return  # others still run here
            for node in nodes:
                (folder / f"{node}.sock").unlink(missing_ok=True)
            if remove_folder:
                try:
                    folder.rmdir()  # under the lock: a process arriving now makes it again
                except OSError:
                    pass  # something else is in it: keep it
    except FileNotFoundError:
        return  # another process's last one out removed the folder already
