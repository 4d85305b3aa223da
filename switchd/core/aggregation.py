"""In-network aggregation at a switch: the data path of granted jobs.

REDUCE frames addressed to the switch are contributions; the engine
(:mod:`switchd.core.engine`) counts each exactly once and says when a chunk
is complete. Then the result goes to every member (frame plane: in the
frame; memory plane: reduced from the members' regions and stored into each,
the RESULT frame a header only), or, below the tree's root, the switch's
partial goes up to its parent and the parent's RESULT comes down. Lost
contributions are detected here and asked for from the one member that lost
one (NACK MISSING); a RESULT carries a completion mark so a member can tell
"lost" from "not complete yet".

Congestion marks travel with a chunk: a contribution that came marked (``ECN``)
marks the switch's partial up and the results down, so every member's
congestion-control policy hears of a congested link anywhere in the chunk's
tree (``[congestion] cc``; the members are as slow as the slowest anyway).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import numpy as np

from fabric.core import frame as fr
from fabric.core.frame import Flag, NackCode, Op
from fabric.core.memory import AccessError
from fabric.core.reliability import PSN_MASK, unwrap_psn
from kernels.dtypes import DTYPES, byte_view
from switchd.core.context import SwitchContext
from switchd.core.engine import AggregationEngine
from switchd.core.events import Completed, JobSpec, Overflowed, Rejected, ResendResult
from switchd.core.jobs import JobPhase, JobTable
from switchd.core.regions import Regions
from switchd.core.service import Service

__all__ = ["ASKED_KEPT", "MISSING_ASKS", "MISSING_FEW", "MISSING_SCAN", "Aggregation"]

#: Chunks a switch checks behind a member's newest one for a lost contribution.
MISSING_SCAN: Final = 64
#: A chunk missing at most this many members checks whether they already sent
#: later chunks (then theirs was lost).
MISSING_FEW: Final = 2
#: Times one contribution is asked for (each ask with another proof).
MISSING_ASKS: Final = 4
#: MISSING requests remembered (so each lost contribution is asked for once).
ASKED_KEPT: Final = 65536
#: ``offset`` of a child switch's REDUCE whose partial is not a sum: the chunk's
#: sum would wrap below it (an inline REDUCE has no other use for the field).
OVERFLOWED_BELOW: Final = 1
#: Chunks that overflowed in a tree and are still on their way, kept at most.
OVERFLOWS_KEPT: Final = 4096
#: Chunks in progress with a marked contribution, kept at most.
MARKS_KEPT: Final = 4096
_ECN: Final = int(Flag.ECN)
_MARKED: Final = Flag.ECN
_REF_MARKED: Final = Flag.REF | Flag.ECN


class Aggregation(Service):
    """REDUCE and RESULT frames of granted jobs, and a parent's MISSING asks."""

    name: ClassVar[str] = "aggregation"
    ops: ClassVar[tuple[Op, ...]] = (Op.REDUCE, Op.RESULT, Op.NACK)

    def __init__(self, ctx: SwitchContext, table: JobTable, engine: AggregationEngine,
                 regions: Regions) -> None:
        super().__init__(ctx)
        self.table = table
        self.engine = engine
        self.regions = regions
        # per job: every chunk below ``_done_below`` has had its results sent, and
        # the chunks above it that have too (see _mark_for)
        self._done_below: dict[int, int] = {}
        self._done_above: dict[int, set[int]] = {}
        # memory plane: per (job, chunk) each member's (region key, offset)
        self._refs: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        # tree: chunks whose partial went up and whose result has not come down,
        # with the owner each awaits (owner-delivered jobs)
        self._awaiting: set[tuple[int, int]] = set()
        self._await_owner: dict[tuple[int, int], int] = {}
        # tree overflow: chunks a child switch said would wrap below it, and the
        # chunks whose sum wrapped here and went up as such (their element count)
        self._overflow_in: dict[tuple[int, int], int] = {}
        self._overflow_up: dict[tuple[int, int], int] = {}
        # chunks in progress with a contribution that came marked congestion
        # experienced: their partial and results carry the mark on
        self._marked: dict[tuple[int, int], bool] = {}
        # loss detection: per (job, member) the highest chunk seen, and the
        # (job, chunk, member, proof) already asked to resend
        self._high: dict[tuple[int, int], int] = {}
        self._asked: set[tuple[int, int, int, int]] = set()
        self._asked_n: dict[tuple[int, int, int], int] = {}
        regions.users.append(self.names_region)

    def claims(self, f: fr.Frame, port: bytes, speaker: int | None) -> bool:
        if f.dst != self.ctx.id:
            return False
        return f.op is not Op.NACK or f.offset == NackCode.MISSING or (
            f.offset == NackCode.OVERFLOW and port in self.ctx.switch_ports)

    def handle(self, f: fr.Frame, port: bytes, header: Any, payload: Any, now: float) -> None:
        if f.op is Op.REDUCE:
            self.ctx.counters.reduce_frames += 1
            self._on_reduce(f, port)
        elif f.op is Op.RESULT:
            self._on_parent_result(f)
        else:
            # never answer a NACK with a NACK (two switches would ping-pong)
            self.ctx.counters.nacks_received += 1
            if f.offset == NackCode.OVERFLOW:
                self._on_parent_overflow(f)
            else:
                self._resend_partial(f)

    def names_region(self, key: int) -> bool:
        """True while a chunk in progress names region ``key``."""
        return any(key == k for refs in self._refs.values() for k, _ in refs.values())

    def forget(self, job: int) -> None:
        """``job`` was released: drop its chunks' state."""
        self._refs = {k: v for k, v in self._refs.items() if k[0] != job}
        self._awaiting = {k for k in self._awaiting if k[0] != job}
        self._await_owner = {k: v for k, v in self._await_owner.items() if k[0] != job}
        self._overflow_in = {k: v for k, v in self._overflow_in.items() if k[0] != job}
        self._overflow_up = {k: v for k, v in self._overflow_up.items() if k[0] != job}
        self._marked = {k: True for k in self._marked if k[0] != job}
        self._high = {k: v for k, v in self._high.items() if k[0] != job}
        self._done_below.pop(job, None)
        self._done_above.pop(job, None)

    def _on_reduce(self, f: fr.Frame, port: bytes) -> None:
        ctx, table = self.ctx, self.table
        spec = table.specs.get(f.job)
        if spec is None:
            code = NackCode.NO_RESOURCE if table.phase.get(f.job) is JobPhase.REFUSED \
                else NackCode.UNKNOWN_JOB
            ctx.nack(port, f.src, f.job, f.psn, f.msg, code, f"job {f.job} is not registered")
            return
        if fr.DTYPE_NAMES[f.dtype] != spec.dtype:
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.INVALID,
                     f"frame dtype {fr.DTYPE_NAMES[f.dtype]} but job {f.job} is {spec.dtype}")
            return
        if f.job in table.owned and f.key not in table.members.get(f.job, ()):
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.INVALID,
                     f"job {f.job} delivers to an owner: key {f.key} is not a member")
            return
        chunk = unwrap_psn(f.psn, table.last.get(f.job, 0))
        if int(f.flags) & _ECN:
            self._marked[(f.job, chunk)] = True
            if len(self._marked) > MARKS_KEPT:
                self._marked.pop(next(iter(self._marked)))
        if f.offset == OVERFLOWED_BELOW and port in ctx.switch_ports and not f.referenced:
            # a child switch's partial that is not a sum: the chunk ends in an
            # overflow for every member once the others are in
            self._overflow_in[(f.job, chunk)] = f.elements
            if len(self._overflow_in) > OVERFLOWS_KEPT:
                self._overflow_in.pop(next(iter(self._overflow_in)))
        pending: dict[int, tuple[int, int]] | None = None
        had_ref = False
        if spec.referenced:
            if not f.referenced:
                ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.INVALID,
                         "memory-plane job needs REF frames")
                return
            try:
                info = self.regions.table.check(f.key, f.offset, f.length, f.src)
            except AccessError as exc:
                ctx.nack(port, f.src, f.job, f.psn, f.msg, exc.code, str(exc))
                return
            if info.owner != f.src:
                ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                         f"node {f.src} contributes from region {f.key:#x} of node "
                         f"{info.owner}")
                return
            pending = self._refs.setdefault((f.job, chunk), {})
            had_ref = f.src in pending
            pending[f.src] = (f.key, f.offset)
            data = None
        else:
            if f.referenced:
                ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.INVALID,
                         "frame-plane job needs inline payloads")
                return
            data = np.frombuffer(f.payload, dtype=DTYPES[spec.dtype])
        events = self.engine.contribute(f.job, chunk, f.src, data, length=f.elements)
        completed = False
        for ev in events:
            if isinstance(ev, Completed) and spec.referenced:
                wrap = self._reduce_regions(spec, ev.chunk, f.elements)
                if wrap is not None and self.engine.overflow(f.job, ev.chunk, wrap):
                    ev = Overflowed(f.job, ev.chunk, ev.recipients, wrap)  # nothing stored
            elif isinstance(ev, Completed) and self._overflow_in.pop((f.job, ev.chunk), None) \
                    is not None:
                why = f"{spec.dtype} sum of chunk {ev.chunk} would wrap below switch {ctx.id}"
                if self.engine.overflow(f.job, ev.chunk, why):
                    ev = Overflowed(f.job, ev.chunk, ev.recipients, why)
            if isinstance(ev, Completed):
                completed = True
                table.last[f.job] = max(table.last.get(f.job, 0), ev.chunk)
                marked = bool(self._marked) and self._marked.pop((f.job, ev.chunk), False)
                if f.job in table.parent:  # a partial: up first, results come down
                    self._awaiting.add((f.job, ev.chunk))
                    if f.job in table.owned:
                        self._await_owner[(f.job, ev.chunk)] = f.key
                    self._send_up(spec, ev.chunk, ev.result, f, retx=False, marked=marked)
                else:
                    self._mark_done(f.job, ev.chunk)
                    self._send_results(spec, ev.chunk, ev.recipients, ev.result, f,
                                       marked=marked)
            elif isinstance(ev, ResendResult):
                if (f.job, ev.chunk) in self._awaiting:
                    # we only hold our partial: ask the parent again instead
                    self._send_up(spec, ev.chunk, ev.result, f, retx=True)
                else:
                    self._send_results(spec, ev.chunk, (ev.member,), ev.result, f)
            elif isinstance(ev, Rejected):
                ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode[ev.code], ev.reason)
            elif isinstance(ev, Overflowed):
                completed = True  # the chunk is over: the window moves on
                table.last[f.job] = max(table.last.get(f.job, 0), ev.chunk)
                if f.job in table.parent:
                    if self._is_done(f.job, ev.chunk):
                        pass  # the parent's verdict came: tell this member again
                    else:
                        # below the root: the members elsewhere in the tree wait for
                        # this chunk too. The parent learns it (again, on each resend
                        # of a member here, as partials are) and its verdict comes
                        # down to every member (_on_parent_overflow)
                        key = (f.job, ev.chunk)
                        again = key in self._awaiting
                        if not again:
                            self._awaiting.add(key)
                            self._overflow_up[key] = f.elements
                            if len(self._overflow_up) > OVERFLOWS_KEPT:
                                self._overflow_up.pop(next(iter(self._overflow_up)))
                        if key in self._overflow_up:
                            self._send_overflow_up(spec, ev.chunk, f, retx=again)
                        continue
                else:
                    self._mark_done(f.job, ev.chunk)
                for member in ev.recipients:  # every member learns it, once
                    if member in ctx.ident:
                        ctx.nack(ctx.ident[member], member, f.job, f.psn, f.msg,
                                 NackCode.OVERFLOW, ev.reason)
            # DuplicateIgnored, Stale: counted by the engine; nothing to send
        counted = completed or not events
        if counted:
            self._ask_missing(f, chunk)
        if pending is not None and not counted and not had_ref:
            # refused, stale or answered from the kept result: forget the address
            pending.pop(f.src, None)
            if not pending:
                self._refs.pop((f.job, chunk), None)
        if data is not None and counted:
            ctx.counters.payload_copies += 1

    def _ask_missing(self, f: fr.Frame, chunk: int) -> None:
        """A member's chunk ``chunk`` came, skipping chunks still waiting for it: those
        were lost on its link. Ask that member alone, once per chunk (the others'
        contributions are in: they need not resend, as they would on a timeout)."""
        key = (f.job, f.src)
        high = self._high.get(key)
        self._high[key] = chunk if high is None else max(high, chunk)
        if high is not None and chunk > high:
            # every chunk below this one still waiting for this member (from the
            # oldest incomplete one): lost on its link, or not sent yet (its slot's
            # result came late; the member then ignores the ask, see
            # fabric.core.programs.InaAllreduce). A chunk asked before is asked again
            # with this newer proof (the ask or the resend may be lost too), a few
            # times at most.
            lo = max(self._done_below.get(f.job, 0), chunk - MISSING_SCAN)
            for c in range(lo, chunk):
                if self.engine.pending(f.job, c, f.src):
                    self._ask(f.job, c, f.src, f.msg, chunk)
        # this chunk now waits only for members that already sent later chunks:
        # their contribution to it was lost
        out = self.engine.missing(f.job, chunk)
        if 0 < len(out) <= MISSING_FEW:
            for m in out:
                proof = self._high.get((f.job, m), -1)
                if proof > chunk:
                    self._ask(f.job, chunk, m, f.msg, proof)

    def _ask(self, job: int, chunk: int, member: int, msg: int, proof: int) -> None:
        """NACK MISSING to ``member`` for ``chunk``; ``proof`` is a later chunk of its
        that arrived (the member resends only if it sent ``chunk`` before ``proof``)."""
        ctx = self.ctx
        # the member ignores an ask about a chunk it sent after the proof: a later
        # proof may ask again (a few times)
        ask = (job, chunk, member, proof)
        port = ctx.ident.get(member)
        times = self._asked_n.get((job, chunk, member), 0)
        if ask in self._asked or port is None or times >= MISSING_ASKS:
            return
        self._asked.add(ask)
        self._asked_n[(job, chunk, member)] = times + 1
        if len(self._asked) > ASKED_KEPT:  # old asks: their chunks are long complete
            self._asked.clear()
            self._asked_n.clear()
        ctx.counters.missing_asked += 1
        ctx.count_nack("MISSING")
        ctx.send(port, fr.encode_nack(src=ctx.id, dst=member, flow=0, psn=chunk & PSN_MASK,
                                      code=NackCode.MISSING, job=job, msg=msg,
                                      key=proof & PSN_MASK))

    def _reduce_regions(self, spec: JobSpec, chunk: int, count: int) -> str | None:
        """Memory plane: ld_reduce from every member's region, st into every one; why
        nothing was stored when an integer sum would wrap."""
        refs = self._refs.pop((spec.job, chunk))
        memory = self.regions.memory
        assert memory is not None  # a referenced job is refused without one
        wrap = memory.reduce(DTYPES[spec.dtype], spec.op.value,
                             [refs[m] for m in spec.members], count)
        if wrap is None:
            self.ctx.counters.mem_stores += len(refs)
            self.ctx.counters.payload_copies += len(refs)
        return wrap

    def _is_done(self, job: int, chunk: int) -> bool:
        return chunk < self._done_below.get(job, 0) or chunk in self._done_above.get(job, ())

    def _mark_done(self, job: int, chunk: int) -> None:
        """Chunk ``chunk`` of ``job`` is complete here: its results go out now."""
        low = self._done_below.get(job, 0)
        if chunk < low:
            return
        above = self._done_above.setdefault(job, set())
        above.add(chunk)
        while low in above:
            above.discard(low)
            low += 1
        self._done_below[job] = low

    def _mark_for(self, spec: JobSpec, member: int) -> int:
        """The completion mark a RESULT to ``member`` carries: every chunk below it is
        complete, or still lacks ``member``'s contribution (which was then lost, or
        is on its way). Either way a missing result below it calls for a resend,
        and one above it waits for another member. Per member, it passes the
        chunks that wait only for others, which a mark common to all cannot."""
        job = spec.job
        low = self._done_below.get(job, 0)
        top = min(self.table.last.get(job, -1) + 1, low + 2 * spec.slots)  # chunks held
        if low >= top:
            return low
        above = self._done_above.get(job, ())
        engine, awaiting = self.engine, self._awaiting
        for c in range(low, top):
            # member's contribution is in and the chunk waits for others: for
            # another member here, or (complete here) for the parent's result
            if c not in above and ((job, c) in awaiting or engine.contributed(job, c, member)):
                return c
        return top

    def _send_results(self, spec: JobSpec, chunk: int, recipients: tuple[int, ...],
                      result: np.ndarray | None, f: fr.Frame, marked: bool = False) -> None:
        ctx = self.ctx
        crc = ctx.crc  # whenever the fabric checks (SwitchContext)
        owner = f.key if spec.job in self.table.owned else None
        for member in recipients:
            port = ctx.ident[member]
            done = self._mark_for(spec, member) & PSN_MASK
            if owner is not None and member != owner and owner not in \
                    ctx.child_below.get(member, ()):
                # not the owner's side: a header-only completion (self-clocks its window)
                ctx.send(port, fr.encode_header(
                    Op.RESULT, src=ctx.id, dst=member, job=spec.job, psn=chunk & PSN_MASK,
                    dtype=f.dtype, msg=f.msg, key=owner, offset=done,
                    flags=_MARKED if marked else Flag.NONE, crc=crc))
                ctx.counters.results_sent += 1
                continue
            if result is None:
                header = fr.encode_header(Op.RESULT, src=ctx.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                          flags=_REF_MARKED if marked else Flag.REF,
                                          length=f.length, offset=done, crc=crc)
                ctx.send(port, header)
            else:
                body = byte_view(result)
                header = fr.encode_header(Op.RESULT, src=ctx.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                          payload=body, key=owner or 0, offset=done,
                                          flags=_MARKED if marked else Flag.NONE, crc=crc)
                ctx.send(port, header, body)
            ctx.counters.results_sent += 1

    def _on_parent_result(self, f: fr.Frame) -> None:
        """The final result of a chunk we sent up as a partial: keep it, pass it down."""
        ctx, table = self.ctx, self.table
        spec = table.specs.get(f.job)
        parent = table.parent.get(f.job)
        if spec is None or parent is None or f.src != parent:
            # only our parent switch sends us results
            ctx.counters.unauthorised += 1
            return
        chunk = unwrap_psn(f.psn, table.last.get(f.job, 0))
        if (f.job, chunk) not in self._awaiting:
            return  # a late copy: the chunk's result was already passed down
        data = np.frombuffer(f.payload, dtype=DTYPES[spec.dtype])
        owned = f.job in table.owned
        if owned and f.key != self._await_owner.get((f.job, chunk)):
            ctx.counters.malformed += 1
            return
        if owned and f.length == 0:
            pass  # the owner is elsewhere: completions only (our partial stays kept)
        elif not self.engine.install_result(f.job, chunk, data):
            ctx.counters.malformed += 1
            return
        self._awaiting.discard((f.job, chunk))
        self._await_owner.pop((f.job, chunk), None)
        self._mark_done(f.job, chunk)
        self._send_results(spec, chunk, spec.members, data, f,
                           marked=int(f.flags) & _ECN != 0)

    def _on_parent_overflow(self, f: fr.Frame) -> None:
        """Our parent says a chunk we sent up ends in an overflow (the sum wrapped
        above us, or below another child): tell our members and children."""
        ctx, table = self.ctx, self.table
        spec = table.specs.get(f.job)
        if spec is None or table.parent.get(f.job) != f.src:
            ctx.counters.unauthorised += 1
            return
        chunk = unwrap_psn(f.psn, table.last.get(f.job, 0))
        if (f.job, chunk) not in self._awaiting:
            return  # a late copy: passed down already
        self._awaiting.discard((f.job, chunk))
        self._await_owner.pop((f.job, chunk), None)
        self._overflow_up.pop((f.job, chunk), None)
        self.engine.overflow(f.job, chunk, f"{spec.dtype} sum of chunk {chunk} would wrap")
        self._mark_done(f.job, chunk)
        for member in spec.members:
            if member in ctx.ident:
                ctx.nack(ctx.ident[member], member, f.job, chunk & PSN_MASK, f.msg,
                         NackCode.OVERFLOW, "the sum would wrap")

    def _send_overflow_up(self, spec: JobSpec, chunk: int, f: fr.Frame, retx: bool) -> None:
        """Our contribution to the parent for a chunk whose sum wrapped here: its
        length in zeros, marked ``OVERFLOWED_BELOW`` (not a sum)."""
        ctx = self.ctx
        parent = self.table.parent[spec.job]
        n = self._overflow_up[(spec.job, chunk)]
        body = byte_view(np.zeros(n, DTYPES[spec.dtype]))
        header = fr.encode_header(Op.REDUCE, src=ctx.id, dst=parent, job=spec.job,
                                  psn=chunk & PSN_MASK, dtype=fr.dtype_from_name(spec.dtype),
                                  msg=f.msg, key=f.key if spec.job in self.table.owned else 0,
                                  offset=OVERFLOWED_BELOW, payload=body,
                                  flags=Flag.RETX if retx else Flag.NONE, crc=ctx.crc)
        ctx.send(ctx.next_hop[parent], header, body)

    def _resend_partial(self, f: fr.Frame) -> None:
        """Our parent lost our partial of a chunk: send it again (we keep it)."""
        spec = self.table.specs.get(f.job)
        if spec is None or self.table.parent.get(f.job) != f.src:
            return
        chunk = unwrap_psn(f.psn, self.table.last.get(f.job, 0))
        if (f.job, chunk) in self._overflow_up and (f.job, chunk) in self._awaiting:
            self._send_overflow_up(spec, chunk, f, retx=True)
            return
        partial = self.engine.kept_result(f.job, chunk)
        if (f.job, chunk) in self._awaiting and partial is not None:
            self._send_up(spec, chunk, partial, f.replace(dtype=fr.dtype_from_name(
                spec.dtype), key=self._await_owner.get((f.job, chunk), 0)),
                retx=True)

    def _send_up(self, spec: JobSpec, chunk: int, partial: np.ndarray | None,
                 f: fr.Frame, retx: bool, marked: bool = False) -> None:
        """Our subtree's partial sum of ``chunk``, as our contribution to the parent."""
        ctx = self.ctx
        parent = self.table.parent[spec.job]
        assert partial is not None
        body = byte_view(partial)
        header = fr.encode_header(Op.REDUCE, src=ctx.id, dst=parent, job=spec.job,
                                  psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                  key=f.key if spec.job in self.table.owned else 0,
                                  payload=body, flags=Flag.RETX if retx else (
                                      _MARKED if marked else Flag.NONE),
                                  crc=ctx.crc)
        ctx.send(ctx.next_hop[parent], header, body)
