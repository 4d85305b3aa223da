"""In-network aggregation engine: SwitchML-style slot pool with shadow copies.

Sans-IO. The aggregation service decodes a REDUCE frame, calls
:meth:`AggregationEngine.contribute`, and turns the returned events
(:mod:`switchd.core.events`) into RESULT / NACK frames. Both data planes: the
frame plane's data travels in the frame and is reduced into the engine's slot
memory; the memory plane's frames (``JobSpec.referenced``) carry addresses
only, the engine keeps bitmaps and lengths, and the switch reduces from shared
memory when :class:`Completed` comes out.

Slot algorithm (docs/AGGREGATION.md has the argument): chunk ``c`` of a job
with ``S`` slots lives in slot ``c % S``, version ``(c // S) % 2``. A version
may be reset for chunk ``c`` only when it holds the *completed* chunk
``c - 2S``, and a contribution to ``c`` is counted only when the other version
holds the completed chunk ``c - S``; self-clocking workers (chunk ``c + S``
only after the result of ``c``) guarantee both, and then every member has
received the result of ``c - 2S``. Chunk numbers are dense and job-wide:
consecutive collectives on one job continue the numbering (restarting at 0
would alias a new chunk onto an old completed one).
"""

from __future__ import annotations

import operator
from dataclasses import astuple
from typing import Final

import numpy as np

from switchd.core.events import (
    DEFAULT_MAX_SLOTS,
    DTYPES,
    Completed,
    DuplicateIgnored,
    EngineStats,
    Event,
    Granted,
    JobSpec,
    Overflowed,
    Refused,
    Rejected,
    ResendResult,
    Stale,
    fmt_bytes,
    normalise,
    spec_error,
)
from switchd.core.slots import JobSlots, absmax

__all__ = ["AggregationEngine"]


# ------------------------------------------------------------------ internals

_NO_DATA: Final = np.empty(0)  # stands in for data on referenced jobs (never read)


class AggregationEngine:
    """Sans-IO in-network aggregation: slot pools per job, exactly-once reduction.

    ``memory_budget_bytes`` bounds the slot memory of all jobs together;
    ``max_slots`` bounds the number of slots (it also applies to referenced
    jobs, which hold no data but still hold bitmaps).
    """

    def __init__(
        self, memory_budget_bytes: int = 256 * 2**20, *, max_slots: int = DEFAULT_MAX_SLOTS
    ) -> None:
        if memory_budget_bytes < 0 or max_slots < 0:
            raise ValueError("memory_budget_bytes and max_slots must be >= 0")
        self._budget = int(memory_budget_bytes)
        self._max_slots = int(max_slots)
        self._jobs: dict[int, JobSlots] = {}
        # Jobs refused for resources: their contributions get NO_RESOURCE, which
        # tells the worker "use the host path" rather than "who are you?".
        self._refused: set[int] = set()
        self._reserved = 0
        self._slots_used = 0
        self._contributions = 0
        self._completions = 0
        self._duplicates = 0
        self._resends = 0
        self._stale = 0
        self._rejected = 0

    # -------------------------------------------------------------- control

    def register(self, spec: JobSpec) -> Granted | Refused:
        """Reserve slot memory for a job, or refuse it with a reason.

        Memory asked = ``slots * 2 * slot_elems * itemsize`` (0 if referenced);
        slots are also counted against ``max_slots``. Registering the same job
        id again with an equal spec is idempotent (``Granted`` again, nothing
        reserved twice); with a different spec it is refused.
        """
        try:
            err = spec_error(spec)
        except (TypeError, ValueError) as exc:  # e.g. members not a sequence
            err = f"{type(exc).__name__}: {exc}"
        if err is not None:
            return Refused(getattr(spec, "job", -1), f"invalid job spec: {err}", 0)
        spec = normalise(spec)
        old = self._jobs.get(spec.job)
        if old is not None:
            if astuple(old.spec) == astuple(spec):  # compiled, == on specs is identity
                return Granted(spec.job, spec.slots, spec.slot_elems)
            return Refused(
                spec.job,
                f"job {spec.job} is already registered with a different spec "
                f"({old.spec}); release it first",
                0,
            )
        per_slot = 0 if spec.referenced else 2 * spec.slot_elems * DTYPES[spec.dtype].itemsize
        asked = spec.slots * per_slot
        bytes_free = self._budget - self._reserved
        slots_free = self._max_slots - self._slots_used
        fit = min(slots_free, bytes_free // per_slot if per_slot else slots_free)
        if asked > bytes_free or spec.slots > slots_free:
            self._refused.add(spec.job)
            return Refused(
                spec.job,
                f"job {spec.job} asks {spec.slots} slots x 2 versions x "
                f"{spec.slot_elems} x {spec.dtype} = {fmt_bytes(asked)}; "
                f"{fmt_bytes(bytes_free)} of {fmt_bytes(self._budget)} free, "
                f"{slots_free} of {self._max_slots} slots free; "
                f"{fit} slots of this shape would fit",
                max(fit, 0),
            )
        mem: np.ndarray | None = None
        if not spec.referenced:
            try:
                # One block per job; np.empty: every element is written (copied)
                # by a chunk's first contribution before anything reads it.
                mem = np.empty((spec.slots, 2, spec.slot_elems), dtype=DTYPES[spec.dtype])
            except MemoryError:
                self._refused.add(spec.job)
                return Refused(
                    spec.job, f"job {spec.job}: host could not allocate {fmt_bytes(asked)}", 0
                )
        self._jobs[spec.job] = JobSlots(spec, mem, asked)
        self._refused.discard(spec.job)
        self._reserved += asked
        self._slots_used += spec.slots
        return Granted(spec.job, spec.slots, spec.slot_elems)

    def install_result(self, job: int, chunk: int, data: np.ndarray) -> bool:
        """Overwrite a completed chunk's kept result with ``data`` (tree aggregation).

        A leaf switch completes a chunk with its *partial* sum and sends it up;
        when the parent's final result comes back, it replaces the partial so
        that a later ``ResendResult`` hands a member the final result. Returns
        False (and changes nothing) unless ``chunk`` is the completed chunk held
        in its slot version and ``data`` has its length and dtype.
        """
        j = self._jobs.get(job)
        if j is None or j.mem is None:
            return False
        s = j.slots
        q, slot = chunk // s, chunk % s  # native int ops when compiled (divmod is generic)
        idx = 2 * slot + (q & 1)
        n = j.length[idx]
        if (j.held[idx] != chunk or j.bitmap[idx] != j.full or data.dtype != j.dtype
                or data.shape != (n,) or j.overflowed[idx] is not None):
            return False
        np.copyto(j.mem[slot, q & 1, :n], data)
        return True

    def _has_contributed(self, job: int, chunk: int, member: int) -> bool | None:
        """Whether ``member``'s contribution to ``chunk`` is in, while the chunk is
        being aggregated; None when it is not (unknown job, member or chunk, or
        the chunk is complete or not held)."""
        j = self._jobs.get(job)
        bit = None if j is None else j.bits.get(member)
        if j is None or bit is None or chunk < 0:
            return None
        q, slot = chunk // j.slots, chunk % j.slots
        idx = 2 * slot + (q & 1)
        if j.held[idx] != chunk or j.bitmap[idx] == j.full:
            return None
        return bool(j.bitmap[idx] & bit)

    def pending(self, job: int, chunk: int, member: int) -> bool:
        """True when ``chunk`` is being aggregated and ``member`` has not contributed
        to it yet (a contribution the switch still waits for)."""
        return self._has_contributed(job, chunk, member) is False

    def contributed(self, job: int, chunk: int, member: int) -> bool:
        """True when ``chunk`` is being aggregated (not complete) and already holds
        ``member``'s contribution: it waits for someone else."""
        return self._has_contributed(job, chunk, member) is True

    def missing(self, job: int, chunk: int) -> tuple[int, ...]:
        """Members whose contribution to ``chunk`` (being aggregated) is still out."""
        j = self._jobs.get(job)
        if j is None or chunk < 0:
            return ()
        q, slot = chunk // j.slots, chunk % j.slots
        idx = 2 * slot + (q & 1)
        bm = j.bitmap[idx]
        if j.held[idx] != chunk or bm == j.full:
            return ()
        return tuple(m for m, bit in j.bits.items() if not bm & bit)

    def kept_result(self, job: int, chunk: int) -> np.ndarray | None:
        """The kept result of completed ``chunk`` (None if not held or not complete)."""
        j = self._jobs.get(job)
        if j is None or chunk < 0:
            return None
        q, slot = chunk // j.slots, chunk % j.slots
        idx = 2 * slot + (q & 1)
        if j.held[idx] != chunk or j.bitmap[idx] != j.full or j.overflowed[idx] is not None:
            return None
        return j.view(idx, j.length[idx])

    def overflow(self, job: int, chunk: int, reason: str) -> bool:
        """Completed ``chunk`` turned out to wrap (the memory plane checks as it
        stores): resends of it now get :class:`Overflowed`, not its result.
        False (and nothing changes) unless ``chunk`` is complete and held."""
        j = self._jobs.get(job)
        if j is None or chunk < 0:
            return False
        q, slot = chunk // j.slots, chunk % j.slots
        idx = 2 * slot + (q & 1)
        if j.held[idx] != chunk or j.bitmap[idx] != j.full:
            return False
        j.overflowed[idx] = reason
        self._rejected += 1
        return True

    def release(self, job: int) -> None:
        """Free a job's slots and memory. Unknown jobs are ignored (idempotent).

        Result views already handed out stay readable (NumPy keeps the block
        alive); the budget is returned at once.
        """
        self._refused.discard(job)
        j = self._jobs.pop(job, None)
        if j is None:
            return
        self._reserved -= j.nbytes
        self._slots_used -= j.slots

    def statistics(self) -> EngineStats:
        """A snapshot of counters and resource use."""
        return EngineStats(
            jobs=len(self._jobs),
            slots_total=self._max_slots,
            slots_in_use=self._slots_used,
            bytes_reserved=self._reserved,
            budget_bytes=self._budget,
            contributions=self._contributions,
            completions=self._completions,
            duplicates=self._duplicates,
            resends=self._resends,
            stale=self._stale,
            rejected=self._rejected,
        )

    # ------------------------------------------------------------ data path

    def _reject(self, job: int, chunk: int, member: int, code: str, reason: str) -> list[Event]:
        self._rejected += 1
        return [Rejected(job, chunk, member, code, reason)]

    def contribute(
        self,
        job: int,
        chunk: object,
        member: int,
        data: object,
        *,
        length: object = None,
    ) -> list[Event]:
        """Count one member's contribution to one chunk and say what to send.

        ``data`` is a 1-D array of the job's dtype with 1..slot_elems elements
        (frame plane); for a referenced job pass ``data=None`` and ``length``
        (element count). All members must agree on a chunk's length.

        Returns ``[]`` (counted, chunk not complete), ``[Completed]``,
        ``[ResendResult]``, ``[DuplicateIgnored]``, ``[Stale]`` or
        ``[Rejected]``. A rejection never changes any slot.
        """
        # chunk, data and length come from peers: typed ``object`` so that a wrong type
        # is an INVALID rejection in both builds, never a compiled TypeError
        if chunk.__class__ is int:
            return self._contribute(job, chunk, member, data, length)
        try:
            c = operator.index(chunk)  # type: ignore[arg-type]
        except TypeError:
            return self._reject(job, -1, member, "INVALID", f"chunk {chunk!r} not an int")
        return self._contribute(job, c, member, data, length)

    def _contribute(self, job: int, chunk: int, member: int, data: object,
                    length: object) -> list[Event]:
        j = self._jobs.get(job)
        if j is None:
            if job in self._refused:
                why = f"job {job} was refused switch resources; use the host path"
                return self._reject(job, chunk, member, "NO_RESOURCE", why)
            return self._reject(job, chunk, member, "UNKNOWN_JOB", f"job {job} not registered")
        bit = j.bits.get(member)
        if bit is None:
            return self._reject(
                job, chunk, member, "PERMISSION", f"node {member} is not a member of job {job}"
            )
        if chunk < 0:
            return self._reject(job, chunk, member, "INVALID", "negative chunk number")

        # ---- validate the payload before looking at (let alone touching) a slot
        if j.mem is None:
            if data is not None:
                return self._reject(
                    job, chunk, member, "INVALID", "referenced job takes no inline data"
                )
            try:
                n = operator.index(length)  # type: ignore[arg-type]
            except TypeError:
                why = f"referenced contribution needs an integer length=, got {length!r}"
                return self._reject(job, chunk, member, "INVALID", why)
            arr = _NO_DATA
        else:
            if not isinstance(data, np.ndarray):
                return self._reject(
                    job, chunk, member, "INVALID", f"data is {type(data).__name__}, not ndarray"
                )
            if data.dtype != j.dtype or data.ndim != 1:
                why = f"data is {data.dtype} shape {data.shape}; job {job} wants 1-D {j.dtype}"
                return self._reject(job, chunk, member, "INVALID", why)
            arr = data
            n = arr.shape[0]
            if length is not None and length != n:
                return self._reject(
                    job, chunk, member, "INVALID", f"length={length} but data has {n} elements"
                )
        if not 0 < n <= j.elems:
            return self._reject(
                job, chunk, member, "INVALID", f"{n} elements; 1..{j.elems} allowed"
            )

        # ---- locate the slot version and classify
        s = j.slots
        q, slot = chunk // s, chunk % s  # native int ops when compiled (divmod is generic)
        ver = q & 1
        idx = 2 * slot + ver
        held = j.held[idx]

        if held == chunk:
            if n != j.length[idx]:
                why = f"chunk {chunk} has {j.length[idx]} elements, this contribution {n}"
                return self._reject(job, chunk, member, "INVALID", why)
            bm = j.bitmap[idx]
            if bm == j.full:
                self._resends += 1
                wrapped = j.overflowed[idx]
                if wrapped is not None:
                    return [Overflowed(job, chunk, (member,), wrapped)]
                return [ResendResult(job, chunk, member, j.view(idx, n))]
            if bm & bit:
                self._duplicates += 1
                return [DuplicateIgnored(job, chunk, member)]
            fresh = False
        elif held > chunk:
            # Same residue mod 2S, so held >= chunk + 2S: the version was reused,
            # which (self-clocking) means every member already had this result.
            self._stale += 1
            return [Stale(job, chunk, member)]
        elif held == chunk - 2 * s and j.bitmap[idx] == j.full:
            # Reuse: chunk - 2S is complete, and nobody sends `chunk` before the
            # result of chunk - S, which nobody sent before the result of chunk - 2S.
            bm = 0
            fresh = True
        else:
            if held < 0:
                why = f"slot {slot} version {ver} is unused; a first chunk must be < {2 * s}"
            elif held == chunk - 2 * s:
                why = (
                    f"slot {slot} version {ver} still holds incomplete chunk {held} "
                    f"({j.bitmap[idx].bit_count()}/{len(j.bits)} members)"
                )
            else:
                why = (
                    f"chunk {chunk} is more than 2x{s} slots ahead of chunk {held} "
                    f"held in slot {slot} version {ver}"
                )
            return self._reject(job, chunk, member, "OUT_OF_WINDOW", why)

        # Self-clocking check: whoever sends `chunk` has the result of chunk - S, so
        # the other version of this slot must hold chunk - S, complete. (It cannot
        # hold chunk + S yet: that needs `chunk` complete, handled above.) This
        # catches a sender that did not wait before it can disturb a slot.
        o = idx ^ 1
        if j.held[o] != chunk - s or j.bitmap[o] != j.full:
            why = f"chunk {chunk} sent before the result of chunk {chunk - s} (not complete)"
            return self._reject(job, chunk, member, "OUT_OF_WINDOW", why)

        if fresh:
            if j.mem is not None:
                dst = j.mem[slot, ver, :n]
                np.copyto(dst, arr)  # first contribution is copied, as hardware does
                if j.int_max:
                    j.bound[idx] = absmax(dst)
            j.held[idx] = chunk
            j.length[idx] = n
            j.overflowed[idx] = None
        elif j.mem is not None:
            dst = j.mem[slot, ver, :n]
            if j.int_max:
                overflow = j.add_int_checked(dst, arr, idx)
                if overflow is not None:
                    # the chunk ends here for everyone (no member waits for a sum
                    # that cannot be), and the window moves on
                    j.overflowed[idx] = overflow
                    j.bitmap[idx] = j.full
                    self._rejected += 1
                    return [Overflowed(job, chunk, j.spec.members, overflow)]
            else:
                j.ufunc(dst, arr, out=dst)  # arrival-order, in place
        bm |= bit
        j.bitmap[idx] = bm

        self._contributions += 1
        if bm != j.full:
            return []
        self._completions += 1
        return [Completed(job, chunk, slot, j.view(idx, n), j.spec.members)]
