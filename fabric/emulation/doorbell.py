"""Shared-memory doorbells: memory-plane descriptors without socket wake-ups.

On a scale-up fabric the doorbell of a memory-semantic operation is itself a
memory write. Here each worker on the switch's host shares one file in
/dev/shm with its switch: two single-producer, single-consumer rings of
64-byte slots (worker -> switch and switch -> worker), each slot holding one
header-only frame (the same 32-byte header, plus its CRC when present), and a
named pipe per direction to wake a reader that stopped spinning.

Waiting is a short spin on the ring (yielding the core between looks, so 4+
processes on 2 cores do not starve each other), then a block in ``poll`` on
the pipe: an idle fabric burns no CPU. A reader about to block raises its
``sleeping`` word; a writer rings the pipe (one byte) only when it sees that
word up. Ringing is what costs: waking a process on another CPU is an
inter-processor interrupt, which on a virtual machine took about 100 us of the
writer's CPU per wake-up here, more than the whole descriptor exchange. So a
spinning reader is never rung, and the data path makes no system call.

The "raise the word, look at the ring once more, block" / "publish, look at
the word" pair is Dekker's handshake: each side's store must be visible
before its load. x86-64 keeps stores in order but may let a load pass a
store, so each side puts a full fence (a locked instruction, taken from an
uncontended lock) between the two; the pipe is level-triggered, so a ring
that lands between the last look and the block still wakes the reader.
Slots are written before the index that publishes them and read after it is
seen (x86-64's total store order); on other CPUs :func:`available` is False
and everything goes over ZeroMQ.

This is an emulation-driver module: the protocol never knows which transport
carried a frame.
"""

from __future__ import annotations

import os
import platform
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from fabric.core.frame import Flag, Op
from fabric.emulation.shm import SHM_DIR, SharedRegion, is_semfab_file

__all__ = ["SLOT", "SLOTS", "SPIN_S", "Ring", "Doorbell", "available", "carries", "enabled",
           "fence", "sleep_all", "spin_until", "wake_all"]

#: Bytes per ring slot: one length byte and a frame of up to 63 bytes (a
#: 32-byte header and its 4-byte CRC fit; payload frames never go this way).
SLOT = 64
#: Slots per ring: a member posts one descriptor per chunk in its window
#: (4 slots by default), so 256 never fills; a full ring falls back to ZeroMQ.
SLOTS = 256
#: The file starts with a magic and the slot count (a version check on attach).
_MAGIC = 0x5345_4D46_4442_0001  # "SEMFDB" v1
_HEAD = struct.Struct("<QQ")
# per ring: the reader's index at +0 and its sleeping word at +8, the writer's
# index at +64 (each side writes only its own cache line)
_CTRL = 128
_RING_BYTES = _CTRL + SLOTS * SLOT
_U64 = (1 << 64) - 1
FILE_BYTES = 64 + 2 * _RING_BYTES
#: How long a waiter looks at its rings before it blocks on the pipes. A look
#: that finds nothing yields the core (sched_yield), so the budget costs little
#: when other processes need the CPU; measured in docs/BENCHMARKS.md ("Doorbells").
#: SEMFAB_BELL_SPIN_US sets it.
SPIN_S = float(os.environ.get("SEMFAB_BELL_SPIN_US", "100")) / 1e6
#: A worker spins only for memory-plane calls up to this size: beyond it the
#: switch's kernel takes milliseconds and needs every core (spinning there cost
#: 12-15% at 16-64 MiB on 2 cores).
SPIN_MAX_BYTES = 1 << 20
_DESCRIPTORS = (int(Op.REDUCE), int(Op.RESULT))
_REF = int(Flag.REF)


_LOCK = threading.Lock()


def fence() -> None:
    """A full memory fence: acquiring a lock is a locked read-modify-write,
    which x86-64 never reorders with earlier stores or later loads."""
    _LOCK.acquire()
    _LOCK.release()


def carries(header: bytes | memoryview) -> bool:
    """True for the frames doorbells carry: the memory plane's header-only REDUCE
    and RESULT descriptors (Flag.REF). Everything else keeps to ZeroMQ."""
    return len(header) < SLOT and header[1] in _DESCRIPTORS and bool(header[2] & _REF)


def spin_until(ready: Callable[[], bool], seconds: float) -> bool:
    """Look at ``ready()`` for up to ``seconds``, yielding the core between looks."""
    if ready():
        return True
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()
        if ready():
            return True
    return False


def sleep_all(bells: Iterable[Doorbell]) -> bool:
    """Tell every bell's writer we are about to block; True if a frame came
    meanwhile (then do not block). Call :func:`wake_all` after either."""
    found = False
    for bell in bells:
        found = bell.sleep() or found
    return found


def wake_all(bells: Iterable[Doorbell]) -> None:
    """Back from a block: writers stop ringing, the pipes are emptied."""
    for bell in bells:
        bell.wake()


def available() -> bool:
    """True where the rings' ordering argument holds (x86-64 total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def enabled() -> bool:
    """Doorbells on for this process: available and not turned off
    (``SEMFAB_DOORBELLS=0`` sends every frame over ZeroMQ, for comparisons)."""
    return available() and os.environ.get("SEMFAB_DOORBELLS", "1") != "0"


class Ring:
    """One single-producer, single-consumer ring of :data:`SLOT`-byte slots in a
    shared buffer. The producer only writes the tail index and the slots, the
    consumer only the head index, so neither needs a lock."""

    def __init__(self, buf: memoryview) -> None:
        if buf.nbytes < _RING_BYTES:
            raise ValueError(f"a ring needs {_RING_BYTES} B, got {buf.nbytes}")
        self._buf = buf
        # [0] head and [1] sleeping (consumer), [8] tail (producer)
        self._idx = buf[:_CTRL].cast("Q")
        self.posted = 0
        self.taken = 0
        self.full = 0  # posts refused because the ring was full

    def post(self, frame: bytes | memoryview) -> bool:
        """Append one frame; False when it is too large or the ring is full.

        Indices are free-running 64-bit counters; the other side can write
        anything into the shared file, so every use wraps them (a hostile
        peer can fill or empty its own ring, never make this side raise)."""
        n = len(frame)
        idx = self._idx
        tail = idx[8]
        if n >= SLOT or (tail - idx[0]) & _U64 >= SLOTS:
            if n < SLOT:
                self.full += 1
            return False
        off = _CTRL + (tail % SLOTS) * SLOT
        buf = self._buf
        buf[off + 1: off + 1 + n] = frame
        buf[off] = n
        idx[8] = (tail + 1) & _U64  # publish: the slot's stores are already visible (TSO)
        self.posted += 1
        return True

    def reader_sleeping(self) -> bool:
        """After a post: True when the consumer may be blocked (ring its pipe)."""
        fence()  # our tail store before its sleeping word's load (Dekker)
        return bool(self._idx[1])

    def sleep(self) -> bool:
        """The consumer is about to block: raise its word; True if a frame came
        meanwhile (then it must not block, and calls :meth:`wake`)."""
        self._idx[1] = 1
        fence()  # our sleeping store before the tail's load (Dekker)
        return bool(self._idx[0] != self._idx[8])

    def wake(self) -> None:
        """The consumer is awake again: writers stop ringing."""
        self._idx[1] = 0

    def take(self) -> bytes | None:
        """The oldest frame, or None when the ring is empty."""
        idx = self._idx
        head = idx[0]
        if head == idx[8]:
            return None
        off = _CTRL + (head % SLOTS) * SLOT
        buf = self._buf
        n = buf[off]
        frame = bytes(buf[off + 1: off + 1 + n]) if n < SLOT else b""
        idx[0] = (head + 1) & _U64  # the slot may be reused only after it was copied out
        self.taken += 1
        return frame

    def pending(self) -> bool:
        """True when a frame is waiting."""
        return bool(self._idx[0] != self._idx[8])

    def backlog(self) -> int:
        """Frames posted and not yet taken (at most SLOTS, whatever the peer wrote)."""
        return min((self._idx[8] - self._idx[0]) & _U64, SLOTS)

    def release(self) -> None:
        """Drop the views of the shared buffer (before it is unmapped)."""
        self._idx.release()
        self._buf.release()


def _fifo(path: Path, create: bool) -> int:
    if create:
        os.mkfifo(path, 0o600)
    elif not stat.S_ISFIFO(os.stat(path).st_mode):
        raise ValueError(f"{path} is not a named pipe")
    # read-write: never blocks on open, never sees end-of-file
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


class Doorbell:
    """One worker's doorbell pair, seen from one side.

    The worker creates it (:meth:`create`) and names its file to the switch,
    which attaches (:meth:`attach`). ``send`` posts to the other side and rings
    it; ``recv`` takes what the other side posted; ``fileno`` is the pipe to
    poll when blocking, after :meth:`sleep`; :meth:`wake` once back.
    """

    def __init__(self, region: SharedRegion, side: int) -> None:
        self.region = region
        self.path = region.path
        buf = region.buffer()
        magic, slots = _HEAD.unpack_from(buf, 0)
        if magic != _MAGIC or slots != SLOTS:
            raise ValueError(f"{self.path} is not a doorbell file of this version")
        rings = [Ring(buf[64 + i * _RING_BYTES: 64 + (i + 1) * _RING_BYTES]) for i in (0, 1)]
        # ring 0 carries worker -> switch, ring 1 switch -> worker
        self.outbox, self.inbox = (rings[0], rings[1]) if side == 0 else (rings[1], rings[0])
        owner = side == 0
        up, down = Path(f"{self.path}.up"), Path(f"{self.path}.down")
        self._fds: list[int] = []
        try:
            fd_up = _fifo(up, owner)
            self._fds.append(fd_up)
            fd_down = _fifo(down, owner)
            self._fds.append(fd_down)
        except BaseException:
            self.close()
            raise
        self._ring_fd, self._wait_fd = (fd_up, fd_down) if side == 0 else (fd_down, fd_up)
        self.rings = 0  # times this side rang the other's pipe (it was asleep)

    @classmethod
    def create(cls, name: str) -> Doorbell:
        """The worker's side: a new doorbell file ``name`` in /dev/shm and its pipes."""
        region = SharedRegion.create(name, FILE_BYTES)
        _HEAD.pack_into(region.buffer(), 0, _MAGIC, SLOTS)
        try:
            return cls(region, 0)
        except BaseException:
            region.close()
            raise

    @classmethod
    def attach(cls, path: str | Path) -> Doorbell:
        """The switch's side of a worker's doorbell (OSError / ValueError if it is not one)."""
        p = Path(path)
        if not is_semfab_file(p):
            raise ValueError(f"doorbell {p} is not a semfab file in {SHM_DIR}")
        region = SharedRegion.attach_checked(p, FILE_BYTES)  # no link to another's file
        try:
            return cls(region, 1)
        except BaseException:
            region.close()
            raise

    def send(self, frame: bytes | memoryview, handoff: bool = False) -> bool:
        """Post a header-only frame, ringing only a reader that sleeps; False
        (nothing sent) if it does not fit.

        ``handoff``: after ringing, give up the rest of our time slice. The
        scheduler often wakes the reader on the writer's own CPU, and a writer
        that goes on working (rather than waiting for an answer) then keeps it
        waiting for its whole slice (measured: docs/SERVING.md, "Doorbells").
        """
        if not self.outbox.post(frame):
            return False
        if self.outbox.reader_sleeping():
            self.rings += 1
            try:
                os.write(self._ring_fd, b"\x01")
            except BlockingIOError:
                pass  # the pipe is full of earlier rings: the reader will wake anyway
            if handoff:
                os.sched_yield()
        return True

    def recv(self) -> bytes | None:
        """The next frame the other side posted, or None."""
        return self.inbox.take()

    def pending(self) -> bool:
        """True when the other side posted a frame not yet taken."""
        return self.inbox.pending()

    def backlog(self) -> int:
        """Frames this side posted that the other has not taken yet."""
        return self.outbox.backlog()

    def fileno(self) -> int:
        """The pipe that becomes readable when the other side rings."""
        return self._wait_fd

    def sleep(self) -> bool:
        """About to block on :meth:`fileno`: say so to the writer; True if a frame
        came meanwhile (do not block; call :meth:`wake`)."""
        return self.inbox.sleep()

    def wake(self) -> None:
        """Back from blocking (or not blocking after all): empty the pipe and tell
        the writer to stop ringing."""
        self.inbox.wake()
        try:
            while os.read(self._wait_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the pipes and unmap; the worker's side also removes the files."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for ring in (getattr(self, "outbox", None), getattr(self, "inbox", None)):
            if ring is not None:
                ring.release()
        owner = self.region.owner
        self.region.close()
        if owner:
            for suffix in (".up", ".down"):
                try:
                    Path(f"{self.path}{suffix}").unlink()
                except FileNotFoundError:
                    pass
