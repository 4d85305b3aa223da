"""Group calls: one member's failure ends the call on every member, and the next
call is exact.

A collective needs every member. When one member cannot take part (its
arguments are wrong, a peer refused its data, the switch refused its chunk),
the others would wait for it until their timeout, and the group's ids would no
longer agree (that member never took the call's message or job ids), so the
next call could mix two calls' data. Instead:

- every member numbers its group calls alike (:meth:`Group.begin_call`); a
  call's message and barrier ids come from its number, so they agree on the
  next call whatever happened to this one;
- the member that fails *abandons* the call: it tells every peer (an
  ``abort`` control message, resent until answered) and raises its own error;
- a peer learns it while running the call (the notice wakes the call through
  its timer), or before starting it (the call fails at once): it raises
  :class:`fabric.errors.CallAborted` naming the member and its reason; a peer
  that had already finished its part (a bystander of a mismatch between two
  others) learns it in its next call, which then ends on every member too
  (``CallAborted.earlier``), and realigns as the others did;
- every member then forgets the group's in-network jobs (their switch slots may
  hold partial sums; they are released when the communicator closes) and skips
  the job ids the call may have registered (:meth:`Group.abandon`).

Errors every member raises alike (an integer overflow), timeouts (the peer
may be gone) and notices themselves are not passed on.

This module holds the pieces both drivers use: :class:`CallScope` is one call
on one member; :class:`GroupCall` wraps a call's program in one (the
simulator runs it as is), and the emulator opens one around each blocking call
(``Endpoint.group_call``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Final

from fabric.core import frame as fr
from fabric.core.programs import (
    ABORT,
    ABORT_ACK,
    CALLS_KEPT,
    Chain,
    Group,
    NodeState,
    Parallel,
    Program,
    Request,
    Send,
)
from fabric.errors import CallAborted, FabricTimeout, SemfabError, SumOverflowError

__all__ = ["ENDED_EVERYWHERE", "NOTIFY_TIMEOUT_S", "CallScope", "GroupCall", "abandoned_call",
           "aborted", "ended_everywhere", "interruptible", "notify_program", "shared_error"]

#: Longest a failing member tries to reach its peers (resending with backoff):
#: a peer that is gone must not hold up the member's own error for a full timeout.
NOTIFY_TIMEOUT_S: Final = 5.0


def shared_error(exc: Exception) -> bool:
    """True when a member that raised ``exc`` in a call must tell its peers (they
    are still waiting for it): not for errors every member raises alike, not
    for timeouts, not for a peer's notice about this call (but yes for one about
    an earlier call, which this member finished: the others run this one)."""
    if isinstance(exc, CallAborted):
        return exc.earlier
    return not isinstance(exc, (FabricTimeout, SumOverflowError))


#: Set on an error that ended a group call on every member (the peers were told,
#: the group realigned): the communicator stays usable after it.
ENDED_EVERYWHERE: Final = "semfab_call_ended_everywhere"


def ended_everywhere(exc: BaseException) -> bool:
    """True when ``exc`` ended its group call on every member (this member told
    the others, or a member told this one): the next call is exact."""
    return isinstance(exc, CallAborted) or bool(getattr(exc, ENDED_EVERYWHERE, False))


def abandoned_call(st: NodeState, g: Group, call: int) -> int | None:
    """The earliest call of ``g`` up to ``call`` that a member abandoned and this
    member has not realigned for (None: there is none)."""
    if not st.aborts:
        return None
    if g.notice_gen != st.abort_gen:
        g.notice_gen = st.abort_gen
        oldest = g.calls - CALLS_KEPT
        g.noticed = sorted({c for (gid, inc, c, src) in st.aborts
                            if gid == g.gid and inc == g.inc and src in g.ids  # members only
                            and c > oldest and c not in g.realigned})
    for c in g.noticed:
        if c > call:
            return None
        if c not in g.realigned:
            return c
    return None


def aborted(st: NodeState, g: Group, call: int) -> CallAborted | None:
    """The error that ends call ``call`` of ``g`` on this member when a member
    abandoned it, or abandoned an earlier call that this member finished
    (``earlier``: :meth:`CallScope.fail` then realigns as the others did)."""
    c = abandoned_call(st, g, call)
    if c is None:
        return None
    src, rank, why = next((s, *st.aborts[(g.gid, g.inc, c, s)]) for s in g.ids
                          if (g.gid, g.inc, c, s) in st.aborts)
    group = f"group {g.gid}" if g.gid else "the world group"
    who = f"group rank {rank} ({st.topo.by_id(src).name})"
    if c == call:
        return CallAborted(f"{st.name}: call {call} of {group} ended: {who} failed: {why}",
                           rank=rank, why=why, call=c)
    return CallAborted(f"{st.name}: call {c} of {group}, which finished here, ended on the "
                       f"others ({who} failed: {why}); call {call} ends with it",
                       rank=rank, why=why, call=c, earlier=True)


def interruptible(prog: Program) -> bool:
    """False while ``prog`` runs a node's own request to a switch (a region's or a
    doorbell's registration): a peer's failure ends the call once it is answered,
    so no half-made state is left behind."""
    leaf = prog.leaf() if isinstance(prog, Chain) else prog
    return not (isinstance(leaf, Request) and not leaf.waits)


def notify_program(st: NodeState, g: Group, call: int, exc: Exception) -> Program:
    """Tell every other member that this member abandoned call ``call`` (why: ``exc``)."""
    why = f"{type(exc).__name__}: {exc}"
    timeout = min(st.timeout_s, NOTIFY_TIMEOUT_S)
    gid = g.gid

    def ours(m: dict[str, Any]) -> bool:
        return m.get("call") == call and m.get("gid") == gid

    return Parallel([Request(st, ABORT, ABORT_ACK, dst=nid, timeout_s=timeout, match=ours,
                             gid=gid, inc=g.inc, call=call, rank=g.rank, why=why)
                     for nid in g.ids if nid != st.node_id])


class CallScope:
    """One group call on one member: its number, and what its end takes.

    The simulator's :class:`GroupCall` holds one; the emulator opens one around
    a blocking call (which may run several programs) and asks :meth:`peer_failed`
    as notices arrive.
    """

    def __init__(self, st: NodeState, g: Group) -> None:
        self.st, self.g = st, g
        self.call = g.begin_call()
        self.failed: Exception | None = None

    def peer_failed(self) -> CallAborted | None:
        """A peer's notice that it abandoned this call, as this member's error."""
        return None if self.failed is not None else aborted(self.st, self.g, self.call)

    def fail(self, exc: Exception) -> Program | None:
        """``exc`` ended the call here: realign the group; the program that tells
        the peers, or None when they need not be told."""
        self.failed = exc
        if isinstance(exc, CallAborted) and exc.earlier:
            self.g.abandon_late(exc.call)
        self.g.abandon()
        if not shared_error(exc) or self.g.size < 2:
            return None
        try:
            setattr(exc, ENDED_EVERYWHERE, True)
        except AttributeError:  # an exception type without a __dict__
            pass
        return notify_program(self.st, self.g, self.call, exc)


class GroupCall(Chain):
    """One group call as a program: ``build`` makes its program (and checks the
    arguments); a failure on this member is sent to its peers before it is
    raised, and a peer's failure ends it here with :class:`fabric.errors.CallAborted`."""

    def __init__(self, st: NodeState, g: Group, build: Callable[[], Program]) -> None:
        self.scope = CallScope(st, g)
        self._refused: SemfabError | None = None
        inner: Program | None = None
        try:
            inner = build()
        except SemfabError as refused:
            self._refused = refused
        super().__init__(_only(inner))

    def _fail(self, exc: SemfabError, now: float) -> list[Send]:
        failed = self.scope.failed
        if failed is not None:  # telling the peers failed (one is gone): our own error
            raise failed
        notify = self.scope.fail(exc)
        if notify is None:
            raise exc
        self.steps = _then_raise(notify, exc)
        self.current = None
        return self._advance(None, now)

    def start(self, now: float) -> list[Send]:
        try:
            if self._refused is not None:
                raise self._refused
            told = self.scope.peer_failed()  # a peer ahead of us abandoned it already
            if told is not None:
                raise told
            return super().start(now)
        except SemfabError as exc:
            return self._fail(exc, now)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        try:
            return super().handle_frame(f, now)
        except SemfabError as exc:
            return self._fail(exc, now)

    def poke(self, now: float) -> list[Send]:
        try:
            return super().poke(now)
        except SemfabError as exc:
            return self._fail(exc, now)

    def _told(self) -> CallAborted | None:
        if not self.scope.st.aborts or not interruptible(self):
            return None
        return self.scope.peer_failed()

    def get_timer(self) -> float | None:
        if self._told() is not None:
            return 0.0  # a peer's notice came: wake now
        return super().get_timer()

    def handle_timer(self, now: float) -> list[Send]:
        try:
            out: list[Send] = []
            due = super().get_timer()
            if due is not None and due <= now:
                # first what is due here: this member's own error (a refusal it sent
                # a peer a moment ago) comes before that peer's notice about it
                out = super().handle_timer(now)
            told = self._told()
            if told is not None:
                raise told
            return out
        except SemfabError as exc:
            return self._fail(exc, now)


def _only(inner: Program | None) -> Generator[Program, Any, Any]:
    if inner is None:
        return None
    return (yield inner)


def _then_raise(prog: Program, exc: SemfabError) -> Generator[Program, Any, Any]:
    yield prog
    raise exc
