"""Shared-memory regions on one host: the memory plane's "device memory".

Each region is a file in /dev/shm mapped by its owner and by the switch, so a
switch can load, reduce and store straight into a worker's memory (the
NVLink SHARP ld_reduce/st model). Plain files + mmap rather than
multiprocessing.shared_memory, whose resource tracker unlinks segments that
another process attached to.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


# What a run id and a node name (the topology's rule) may hold in a region's file
# name: no '/' or leading '.', and no '-' in the run id, so that no (run, owner)
# pair spells another pair's file
_RUN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OWNER_CHARS = _RUN_CHARS | {"-"}


def region_name(run: str, owner: str, key: int) -> str:
    """The file name of node ``owner``'s memory-plane region ``key`` in run ``run``:
    the worker creates it, the switch derives it from the region's handle (run,
    the registering node, key) and maps nothing else. ValueError on a name that
    could leave SHM_DIR or pose as another node's."""
    if not run or not set(run) <= _RUN_CHARS:
        raise ValueError(f"run id {run!r}: letters, digits and '_' only")
    if not owner or not set(owner) <= _OWNER_CHARS:
        raise ValueError(f"node name {owner!r}: letters, digits, '_' and '-' only")
    return f"semfab-{run}-{owner}-{key:x}"


def is_semfab_file(path: str | Path) -> bool:
    """True for a path a peer may name for us to map: a semfab file in SHM_DIR
    (never anything elsewhere on the host)."""
    p = Path(path)
    return p.parent == SHM_DIR and p.name.startswith("semfab-")


class SharedRegion:
    """A mapped shared-memory file; ``array(dtype)`` views it without copying."""

    def __init__(self, path: Path, size: int, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)

    @classmethod
    def create(cls, name: str, size: int) -> SharedRegion:
        """Create and map a new region of ``size`` bytes (zero-filled)."""
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, owner=True)

    @classmethod
    def attach(cls, path: str | Path, size: int) -> SharedRegion:
        """Map a region another process created."""
        p = Path(path)
        actual = p.stat().st_size
        if actual < size:
            raise ValueError(f"shared region {p} has {actual} B, expected {size} B")
        return cls(p, size, owner=False)

    @classmethod
    def attach_checked(cls, path: Path, size: int) -> SharedRegion:
        """Map a region a peer names, only if it is what the fabric creates: a
        regular file of ours in SHM_DIR, not a symbolic link and with no other
        name (a hard link could make another tenant's file look like ours)."""
        if not is_semfab_file(path):
            raise ValueError(f"{path} is not a semfab file in {SHM_DIR}")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a region file the fabric created")
        return cls.attach(path, size)

    def buffer(self) -> memoryview:
        """The whole region as a writable byte view."""
        if self._map is None:
            return memoryview(bytearray())
        return memoryview(self._map)

    def array(self, dtype: np.dtype | str, count: int | None = None, offset: int = 0) -> np.ndarray:
        """A NumPy view of ``count`` elements at byte ``offset`` (default: all)."""
        dt = np.dtype(dtype)
        if count is None:
            count = (self.size - offset) // dt.itemsize
        return np.frombuffer(self.buffer(), dtype=dt, count=count, offset=offset)

    def close(self) -> None:
        """Unmap; the owner also removes the file."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # Views still exist (NumPy arrays); the mapping goes with them.
                pass
            self._map = None
        if self.owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
