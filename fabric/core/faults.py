"""Seeded, reproducible link fault models: loss, bursts, duplication, reordering, corruption, delay.

Pure (no clock, no sockets): :class:`FaultInjector` takes a frame's bytes and
the time it leaves, and returns what arrives and when. It drives the in-memory
test link (:mod:`fabric.testing`) and is meant for the switch daemon's egress
as well. Parameters, their meaning and the sources of the models are in
``docs/RELIABILITY.md`` ("Fault models").

Text form, as on a command line (items in any order, each at most once)::

    loss=0.01,ge=0.01:0.3:0.5,dup=0.001,reorder=0.05:3,corrupt=1e-4,delay=50us:10us

* ``loss=P``            independent (Bernoulli) loss with probability P per frame
* ``ge=PGB:PBG[:LB[:LG]]`` Gilbert-Elliott bursts: good->bad PGB, bad->good PBG per
  frame, loss LB in the bad state (default 1), LG in the good state (default 0)
* ``dup=P``             the frame also arrives a second time, right after itself
* ``reorder=P:K[:T]``   the frame is held back until 1..K later frames passed it
  (uniform), or at most T (default 100us) after it would have arrived; at most
  K frames sent after it arrive before it
* ``corrupt=P[:BITS]``  BITS random bits (default 1) of the frame are flipped
* ``delay=D[:J]``       constant delay D plus uniform jitter in [-J, +J];
  jitter never reorders (arrivals are kept in send order; use ``reorder``)

Times take a unit: ``ns``, ``us``, ``ms`` or ``s`` (a bare number is
microseconds). Probabilities may be written as percentages (``1%``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields

__all__ = [
    "FaultSpecError",
    "GilbertElliott",
    "FaultSpec",
    "FaultStats",
    "FaultInjector",
    "parse_faults",
    "NO_FAULTS",
]


#: Longest delay a fault may add (one hour): beyond it no run could finish, and
#: a time that large no longer adds to a clock reading.
MAX_DELAY_US = 3.6e9


class FaultSpecError(ValueError):
    """A fault specification is invalid; the message names the item and the fix."""


def _check_probability(name: str, p: float) -> None:
    if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise FaultSpecError(f"{name} must be a probability in [0, 1], got {p!r}")


@dataclass(frozen=True, slots=True)
class GilbertElliott:
    """Two-state Markov loss model (Gilbert 1960, Elliott 1963).

    Each frame, the chain first moves (good->bad with ``p_good_to_bad``,
    bad->good with ``p_bad_to_good``), then the frame is lost with the loss
    probability of the state it is in. Mean burst (bad-state) length is
    ``1 / p_bad_to_good`` frames; the stationary bad fraction is
    ``pgb / (pgb + pbg)``.
    """

    p_good_to_bad: float
    p_bad_to_good: float
    loss_in_bad: float = 1.0
    loss_in_good: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_probability(f"ge {f.name}", getattr(self, f.name))
        if self.p_bad_to_good == 0 and self.p_good_to_bad > 0:
            raise FaultSpecError("ge p_bad_to_good must be > 0, or the link stays bad forever")

    @property
    def mean_loss(self) -> float:
        """Long-run loss probability of the chain."""
        total = self.p_good_to_bad + self.p_bad_to_good
        bad = self.p_good_to_bad / total if total else 0.0
        return bad * self.loss_in_bad + (1 - bad) * self.loss_in_good


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What can go wrong on one link direction. All probabilities are per frame."""

    loss: float = 0.0
    gilbert_elliott: GilbertElliott | None = None
    duplicate: float = 0.0
    reorder: float = 0.0
    #: Most later frames that may overtake a reordered one (displacement K).
    reorder_max: int = 0
    #: A held frame is released at the latest this long after it would have
    #: arrived, so the last frames of a burst are not held forever. Keep it
    #: below the receiver's RTO, or a held tail frame looks lost.
    reorder_timeout_us: float = 100.0
    corrupt: float = 0.0
    corrupt_bits: int = 1
    delay_us: float = 0.0
    jitter_us: float = 0.0

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate", "reorder", "corrupt"):
            _check_probability(name, getattr(self, name))
        if self.reorder > 0 and self.reorder_max < 1:
            raise FaultSpecError(
                "reorder needs a max displacement >= 1: write reorder=P:K, e.g. reorder=0.05:3"
            )
        if self.reorder_max < 0:
            raise FaultSpecError(f"reorder displacement must be >= 0, got {self.reorder_max}")
        if self.corrupt_bits < 1:
            raise FaultSpecError(f"corrupt bits must be >= 1, got {self.corrupt_bits}")
        for name in ("delay_us", "jitter_us", "reorder_timeout_us"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= MAX_DELAY_US):
                raise FaultSpecError(f"{name} must be a time in 0..{MAX_DELAY_US:g} us (one "
                                     f"hour), got {v!r}")

    @property
    def clean(self) -> bool:
        """True when the spec injects nothing (no fault, no delay)."""
        return self == NO_FAULTS

    def __str__(self) -> str:
        """The canonical text form; ``parse_faults(str(spec)) == spec``."""
        parts: list[str] = []
        if self.loss:
            parts.append(f"loss={self.loss!r}")
        ge = self.gilbert_elliott
        if ge is not None:
            parts.append(
                f"ge={ge.p_good_to_bad!r}:{ge.p_bad_to_good!r}:{ge.loss_in_bad!r}:{ge.loss_in_good!r}"
            )
        if self.duplicate:
            parts.append(f"dup={self.duplicate!r}")
        if self.reorder or self.reorder_max:
            parts.append(
                f"reorder={self.reorder!r}:{self.reorder_max}:{self.reorder_timeout_us!r}us"
            )
        if self.corrupt:
            parts.append(f"corrupt={self.corrupt!r}:{self.corrupt_bits}")
        if self.delay_us or self.jitter_us:
            parts.append(f"delay={self.delay_us!r}us:{self.jitter_us!r}us")
        return ",".join(parts) if parts else "none"


NO_FAULTS = FaultSpec()

_UNITS = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6}
_TIME_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*(ns|us|µs|ms|s)?\s*$")
_KEYS = {
    "loss": "loss",
    "ge": "ge",
    "gilbert": "ge",
    "dup": "dup",
    "duplicate": "dup",
    "reorder": "reorder",
    "corrupt": "corrupt",
    "delay": "delay",
}


def _num(text: str, what: str) -> float:
    s = text.strip()
    scale = 1.0
    if s.endswith("%"):
        s, scale = s[:-1], 0.01
    try:
        v = float(s) * scale
    except ValueError:
        raise FaultSpecError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise FaultSpecError(f"{what}: {text!r} is not a finite number")
    return v


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise FaultSpecError(f"{what}: {text!r} is not a whole number") from None


def _time_us(text: str, what: str) -> float:
    m = _TIME_RE.match(text)
    if not m:
        raise FaultSpecError(f"{what}: {text!r} is not a time; write e.g. 50us, 1.5ms, 200ns")
    try:
        v = float(m.group(1))
    except ValueError:
        raise FaultSpecError(f"{what}: {text!r} is not a time; write e.g. 50us, 1.5ms") from None
    return v * _UNITS[m.group(2) or "us"]


def _arity(parts: list[str], lo: int, hi: int, item: str, form: str) -> None:
    if not lo <= len(parts) <= hi or any(not p.strip() for p in parts):
        raise FaultSpecError(f"{item!r}: expected {form}")


def parse_faults(text: str | FaultSpec | None) -> FaultSpec:
    """Parse ``"loss=0.01,reorder=0.05:3,dup=0.001,corrupt=1e-4,delay=50us:10us,ge=0.01:0.3:0.5"``.

    ``""``, ``"none"`` and None give no faults; a :class:`FaultSpec` is returned
    as is. Raises :class:`FaultSpecError` (a ValueError) naming the bad item.
    """
    if text is None:
        return NO_FAULTS
    if isinstance(text, FaultSpec):
        return text
    s = text.strip()
    if s in ("", "none", "off"):
        return NO_FAULTS
    kw: dict[str, object] = {}
    seen: set[str] = set()
    for raw in s.split(","):
        item = raw.strip()
        if not item:
            raise FaultSpecError(f"bad fault spec {text!r}: empty item (stray comma?)")
        if "=" not in item:
            raise FaultSpecError(
                f"bad fault spec {text!r}: item {item!r} needs KEY=VALUE; "
                f"keys: {', '.join(sorted(set(_KEYS.values())))}"
            )
        key, _, value = item.partition("=")
        key = key.strip().lower()
        if key not in _KEYS:
            raise FaultSpecError(
                f"bad fault spec {text!r}: unknown fault {key!r}; "
                f"valid: {', '.join(sorted(set(_KEYS.values())))}"
            )
        canon = _KEYS[key]
        if canon in seen:
            raise FaultSpecError(f"bad fault spec {text!r}: {canon!r} given twice")
        seen.add(canon)
        parts = value.split(":")
        try:
            if canon == "loss":
                _arity(parts, 1, 1, item, "loss=P")
                kw["loss"] = _num(parts[0], "loss")
            elif canon == "dup":
                _arity(parts, 1, 1, item, "dup=P")
                kw["duplicate"] = _num(parts[0], "dup")
            elif canon == "ge":
                _arity(parts, 2, 4, item, "ge=P_GOOD_TO_BAD:P_BAD_TO_GOOD[:LOSS_BAD[:LOSS_GOOD]]")
                nums = [_num(p, "ge") for p in parts]
                kw["gilbert_elliott"] = GilbertElliott(*nums)
            elif canon == "reorder":
                _arity(parts, 2, 3, item, "reorder=P:K[:TIMEOUT], e.g. reorder=0.05:3")
                kw["reorder"] = _num(parts[0], "reorder")
                kw["reorder_max"] = _int(parts[1], "reorder displacement")
                if len(parts) == 3:
                    kw["reorder_timeout_us"] = _time_us(parts[2], "reorder timeout")
            elif canon == "corrupt":
                _arity(parts, 1, 2, item, "corrupt=P[:BITS]")
                kw["corrupt"] = _num(parts[0], "corrupt")
                if len(parts) == 2:
                    kw["corrupt_bits"] = _int(parts[1], "corrupt bits")
            else:  # delay
                _arity(parts, 1, 2, item, "delay=D[:JITTER], e.g. delay=50us:10us")
                kw["delay_us"] = _time_us(parts[0], "delay")
                if len(parts) == 2:
                    kw["jitter_us"] = _time_us(parts[1], "delay jitter")
        except FaultSpecError as exc:
            raise FaultSpecError(f"bad fault spec {text!r}: {exc}") from None
    try:
        spec = FaultSpec(**kw)  # type: ignore[arg-type]
    except FaultSpecError as exc:
        raise FaultSpecError(f"bad fault spec {text!r}: {exc}") from None
    # A link that drops every frame can never deliver: every transfer over it
    # would retransmit until its timeout. (FaultSpec itself still takes it, for tests.)
    if spec.loss >= 1:
        raise FaultSpecError(f"bad fault spec {text!r}: loss must be below 1 (loss=1 drops "
                             "every frame, so nothing is ever delivered), e.g. loss=0.05")
    ge = spec.gilbert_elliott
    if ge is not None and ge.mean_loss >= 1:
        raise FaultSpecError(f"bad fault spec {text!r}: ge loses every frame (mean loss 1), "
                             "so nothing is ever delivered; lower LOSS_GOOD or LOSS_BAD")
    return spec


@dataclass(frozen=True, slots=True)
class FaultStats:
    """What an injector did so far (frames counted once each, duplicates excluded)."""

    frames: int
    lost: int
    lost_in_burst: int
    duplicated: int
    reordered: int
    corrupted: int
    held: int


@dataclass(slots=True)
class _Held:
    remaining: int  # later frames still to pass it
    deadline: float  # release at the latest at this time
    natural_at: float  # when it would have arrived
    copies: list[bytes] = field(default_factory=list)


class FaultInjector:
    """Apply a :class:`FaultSpec` to a stream of frames, reproducibly.

    ``apply(frame, now)`` returns ``[(deliver_at, bytes), ...]`` in arrival
    order: no item = lost (or held for reordering), two copies = duplicated,
    and it may also return earlier frames that were held back and are now
    released. Held frames also come out of :meth:`poll` once their timeout
    passes; :meth:`next_deadline` says when. Times are seconds.

    Each fault kind draws from its own random stream derived from ``seed`` (and
    ``stream``, to give two links of one run different faults), and every
    stream draws for every frame, so the same seed gives the same decisions
    and changing one fault's probability does not move another's pattern.
    """

    def __init__(
        self, spec: FaultSpec | str | None = None, seed: int = 0, *, stream: str = ""
    ) -> None:
        self.spec = parse_faults(spec)
        self.seed = seed

        def rng(kind: str) -> random.Random:
            return random.Random(f"semfab-faults:{seed}:{stream}:{kind}")

        self._r_loss = rng("loss")
        self._r_ge = rng("ge")
        self._r_dup = rng("dup")
        self._r_reorder = rng("reorder")
        self._r_corrupt = rng("corrupt")
        self._r_delay = rng("delay")
        self._bad = False  # Gilbert-Elliott state
        self._last_at = -math.inf  # FIFO: no arrival before the previous one
        self._held: list[_Held] = []
        self._frames = 0
        self._lost = 0
        self._lost_burst = 0
        self._dup = 0
        self._reordered = 0
        self._corrupted = 0

    def apply(self, frame: bytes | bytearray | memoryview, now: float) -> list[tuple[float, bytes]]:
        """Send one frame at ``now``; return the arrivals this causes."""
        spec = self.spec
        self._frames += 1
        # Every enabled fault kind draws for every frame, in a fixed order (see the
        # class doc); a kind that is off draws nothing (its stream is its own, so
        # the others' decisions are the same either way).
        lost = self._draw_loss()
        u_dup = self._r_dup.random() if spec.duplicate else 1.0
        u_reorder, u_disp = ((self._r_reorder.random(), self._r_reorder.random())
                             if spec.reorder else (1.0, 0.0))
        u_corrupt = self._r_corrupt.random() if spec.corrupt else 1.0
        u_jitter = self._r_delay.random() if spec.jitter_us else 0.5
        if lost:
            return []  # a lost frame overtakes nothing

        data = bytes(frame)
        if u_corrupt < spec.corrupt and data:
            buf = bytearray(data)
            nbits = len(buf) * 8
            for _ in range(spec.corrupt_bits):
                bit = self._r_corrupt.randrange(nbits)
                buf[bit >> 3] ^= 1 << (bit & 7)
            data = bytes(buf)
            self._corrupted += 1
        copies = [data, data] if u_dup < spec.duplicate else [data]
        if len(copies) == 2:
            self._dup += 1

        delay = spec.delay_us
        if spec.jitter_us:
            delay += (2 * u_jitter - 1) * spec.jitter_us
        natural = now + max(delay, 0.0) * 1e-6

        if u_reorder < spec.reorder and spec.reorder_max >= 1:
            k = 1 + min(int(u_disp * spec.reorder_max), spec.reorder_max - 1)
            self._held.append(_Held(k, natural + spec.reorder_timeout_us * 1e-6, natural, copies))
            self._reordered += 1
            return []

        out = self._emit(natural, copies)
        # This frame has passed every held one: count it.
        for h in self._held:
            h.remaining -= 1
        out.extend(self._release(lambda h: h.remaining <= 0, natural))
        return out

    def damaged(self) -> bool:
        """One frame across a link with link-level retry (``llr``): whether its
        receiver sees it lost or corrupted, and so asks for it again.

        Such a link delivers what it accepts once and in order, so only the loss
        (and Gilbert-Elliott) and corruption decisions apply, drawn from the same
        streams as :meth:`apply`; the frame itself is not touched, since the
        link replays a damaged frame rather than passing it on."""
        spec = self.spec
        self._frames += 1
        lost = self._draw_loss()
        u_corrupt = self._r_corrupt.random() if spec.corrupt else 1.0
        if lost:
            return True
        if u_corrupt < spec.corrupt:
            self._corrupted += 1
            return True
        return False

    def _draw_loss(self) -> bool:
        """Whether this frame is lost (Bernoulli, then the Gilbert-Elliott chain's
        move and loss), each from its own stream; counted."""
        spec = self.spec
        u_loss = self._r_loss.random() if spec.loss else 1.0
        ge = spec.gilbert_elliott
        lost = u_loss < spec.loss
        if ge is not None:
            u_move, u_lose = self._r_ge.random(), self._r_ge.random()
            if self._bad:
                self._bad = u_move >= ge.p_bad_to_good
            else:
                self._bad = u_move < ge.p_good_to_bad
            if u_lose < (ge.loss_in_bad if self._bad else ge.loss_in_good):
                if not lost:
                    self._lost_burst += 1
                lost = True
        if lost:
            self._lost += 1
        return lost

    def poll(self, now: float) -> list[tuple[float, bytes]]:
        """Release held frames whose timeout has passed."""
        return self._release(lambda h: h.deadline <= now, now)

    def next_deadline(self) -> float | None:
        """When :meth:`poll` next has something to release, or None."""
        if not self._held:  # the common case, asked once or twice per frame
            return None
        return min(h.deadline for h in self._held)

    @property
    def lost(self) -> int:
        """Frames lost so far (``statistics().lost`` without building the snapshot)."""
        return self._lost

    def flush(self, now: float) -> list[tuple[float, bytes]]:
        """Release every held frame now (end of a run)."""
        return self._release(lambda h: True, now)

    def statistics(self) -> FaultStats:
        """Counters so far."""
        return FaultStats(
            frames=self._frames,
            lost=self._lost,
            lost_in_burst=self._lost_burst,
            duplicated=self._dup,
            reordered=self._reordered,
            corrupted=self._corrupted,
            held=len(self._held),
        )

    def _emit(self, at: float, copies: list[bytes]) -> list[tuple[float, bytes]]:
        at = max(at, self._last_at)  # jitter never reorders
        self._last_at = at
        return [(at, c) for c in copies]

    def _release(self, due: Callable[[_Held], bool], at: float) -> list[tuple[float, bytes]]:
        # ``_held`` is in send order. Releasing a frame also releases every
        # older held frame first, so a held frame is never overtaken by a
        # younger held one: its displacement stays within its own count.
        last = -1
        for i, h in enumerate(self._held):
            if due(h):
                last = i
        if last < 0:
            return []
        out: list[tuple[float, bytes]] = []
        for h in self._held[: last + 1]:
            out.extend(self._emit(max(h.natural_at, at), h.copies))
        del self._held[: last + 1]
        return out
