"""Aggregation engine: exactly-once slot/version reduction, numerics, bad input, budget.

The engine is sans-IO, so every test drives it directly with simulated workers
that follow the self-clocking rule (send chunk c+S only after the result of
chunk c) over an in-memory "network" with seeded loss, duplication, reordering
and late retransmissions. Inputs are chosen so the exact result is known: ints,
and dyadic rationals small enough that every partial float sum is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchd.core.engine import AggregationEngine
from switchd.core.events import (
    DTYPES,
    MAX_MEMBERS,
    AggOp,
    Completed,
    DuplicateIgnored,
    Granted,
    JobSpec,
    Overflowed,
    Refused,
    Rejected,
    ResendResult,
    Stale,
)

ALL_DTYPES = list(DTYPES)
ALL_OPS = list(AggOp)
SEEDED = settings(derandomize=True, deadline=None, database=None, max_examples=150)


# ----------------------------------------------------------------- helpers


def make_inputs(
    rng: np.random.Generator, dtype: str, n_members: int, length: int
) -> list[np.ndarray]:
    """Non-zero inputs whose sums are exact in `dtype` (any order, any prefix)."""
    dt = DTYPES[dtype]
    if dtype == "int32":
        k = rng.integers(1, 1000, size=(n_members, length))
        vals: np.ndarray = k * rng.choice([-1, 1], size=k.shape)
    elif dtype == "int64":
        k = rng.integers(1, 2**40, size=(n_members, length))
        vals = k * rng.choice([-1, 1], size=k.shape)
    else:
        # Multiples of 1/4 with |sum of 8| < 2**(significand bits) quarters:
        # float16 has 11 bits (60*8 < 2048), bfloat16 8 bits (31*8 < 256).
        kmax = {"float32": 2**20, "float16": 60, "bfloat16": 31}[dtype]
        k = rng.integers(1, kmax + 1, size=(n_members, length))
        vals = (k * rng.choice([-1, 1], size=k.shape)) / 4.0
    return [np.ascontiguousarray(v).astype(dt) for v in vals]


def reference(inputs: list[np.ndarray], op: AggOp) -> np.ndarray:
    """Exact NumPy reference (computed wide, then cast: exact for our inputs)."""
    dt = inputs[0].dtype
    wide = np.stack([x.astype(np.int64 if dt.kind == "i" else np.float64) for x in inputs])
    red = {AggOp.SUM: wide.sum(axis=0), AggOp.MAX: wide.max(axis=0), AggOp.MIN: wide.min(axis=0)}
    return red[op].astype(dt)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def snapshot(engine: AggregationEngine, job: int) -> tuple:
    """Everything a contribution could change (internals: this is the engine's own test)."""
    j = engine._jobs[job]
    mem = None if j.mem is None else j.mem.tobytes()
    stats = engine.statistics()
    counters = (stats.contributions, stats.completions, stats.duplicates, stats.resends)
    return (list(j.held), list(j.bitmap), list(j.length), list(j.bound), mem, counters)


@dataclass
class Worker:
    member: int
    data: np.ndarray  # this worker's whole tensor
    first: int  # job-wide number of this collective's first chunk
    nchunks: int
    elems: int
    slots: int
    sent: set[int] = field(default_factory=set)  # chunks sent at least once
    results: dict[int, np.ndarray] = field(default_factory=dict)

    def piece(self, chunk: int) -> np.ndarray:
        i = chunk - self.first
        return self.data[i * self.elems : (i + 1) * self.elems]

    def outstanding(self) -> list[int]:
        return sorted(self.sent.difference(self.results))

    @property
    def done(self) -> bool:
        return len(self.results) == self.nchunks


@dataclass
class Sim:
    """Self-clocking workers around one engine over a lossy, reordering network."""

    engine: AggregationEngine
    spec: JobSpec
    rng: random.Random
    p_loss_up: float = 0.0
    p_loss_down: float = 0.0
    p_dup: float = 0.0
    p_spurious: float = 0.0
    bad_input_rate: float = 0.0
    pool: list[tuple] = field(default_factory=list)
    completions: dict[int, int] = field(default_factory=dict)
    expected: dict[int, np.ndarray] = field(default_factory=dict)
    seen: dict[str, int] = field(
        default_factory=lambda: {"dup": 0, "stale": 0, "resend": 0, "bad": 0}
    )
    next_chunk: int = 0  # job-wide chunk numbering continues across collectives

    def send_up(self, w: Worker, chunk: int) -> None:
        w.sent.add(chunk)
        self.pool.append(("up", w.member, chunk, w.piece(chunk)))

    def deliver_up(self, member: int, chunk: int, piece: np.ndarray) -> None:
        if self.spec.referenced:
            events = self.engine.contribute(self.spec.job, chunk, member, None, length=len(piece))
        else:
            events = self.engine.contribute(self.spec.job, chunk, member, piece)
        for ev in events:
            if isinstance(ev, Completed):
                assert ev.chunk == chunk and ev.slot == chunk % self.spec.slots
                self.completions[chunk] = self.completions.get(chunk, 0) + 1
                assert self.completions[chunk] == 1, f"chunk {chunk} completed twice"
                assert ev.recipients == self.spec.members
                res = self.check_result(chunk, ev.result)
                for r in ev.recipients:
                    self.pool.append(("down", r, chunk, res))
            elif isinstance(ev, ResendResult):
                assert ev.member == member and self.completions.get(chunk) == 1
                self.seen["resend"] += 1
                self.pool.append(("down", member, chunk, self.check_result(chunk, ev.result)))
            elif isinstance(ev, DuplicateIgnored):
                assert chunk not in self.completions
                self.seen["dup"] += 1
            elif isinstance(ev, Stale):
                assert self.completions.get(chunk) == 1
                self.seen["stale"] += 1
            else:
                raise AssertionError(f"unexpected event {ev}")

    def check_result(self, chunk: int, result: np.ndarray | None) -> np.ndarray:
        exp = self.expected[chunk]
        if self.spec.referenced:
            assert result is None
            return exp  # the daemon reduces from shared memory; stand in with the truth
        assert result is not None and not result.flags.writeable
        assert same_bits(result, exp), (chunk, result, exp)
        return result.copy()  # the daemon serialises it at once

    def inject_bad(self, workers: list[Worker]) -> None:
        """A contribution the engine must refuse without touching any slot."""
        job, s, e = self.spec.job, self.spec.slots, self.spec.slot_elems
        w = self.rng.choice(workers)
        chunk = w.first + self.rng.randrange(w.nchunks)
        dt = DTYPES[self.spec.dtype]
        good = None if self.spec.referenced else np.ones(1, dtype=dt)
        ahead = self.next_chunk + 2 * s + self.rng.randrange(3 * s)
        cases: list[tuple[int, int, int, object, int | None, str]] = [
            (job + 1, chunk, w.member, good, 1, "UNKNOWN_JOB"),
            (job, chunk, 1000, good, 1, "PERMISSION"),
            (job, ahead, w.member, good, 1, "OUT_OF_WINDOW"),
            (job, -1 - chunk, w.member, good, 1, "INVALID"),
        ]
        if self.spec.referenced:
            cases += [
                (job, chunk, w.member, np.ones(1, dt), 1, "INVALID"),  # inline data, REF job
                (job, chunk, w.member, None, e + 1, "INVALID"),
                (job, chunk, w.member, None, 0, "INVALID"),
                (job, chunk, w.member, None, None, "INVALID"),
            ]
        else:
            other = np.float64 if dt != np.float64 else np.float32
            cases += [
                (job, chunk, w.member, np.ones(e + 1, dtype=dt), None, "INVALID"),
                (job, chunk, w.member, np.ones(0, dtype=dt), None, "INVALID"),
                (job, chunk, w.member, np.ones(1, dtype=other), None, "INVALID"),
                (job, chunk, w.member, np.ones((1, 1), dtype=dt), None, "INVALID"),
                (job, chunk, w.member, w.piece(chunk).tobytes(), None, "INVALID"),
                (job, chunk, w.member, None, 1, "INVALID"),
            ]
        bjob, bchunk, bmember, bdata, blen, code = self.rng.choice(cases)
        before = snapshot(self.engine, job)
        events = self.engine.contribute(bjob, bchunk, bmember, bdata, length=blen)  # type: ignore[arg-type]
        assert len(events) == 1 and isinstance(events[0], Rejected), events
        assert events[0].code == code, (events[0], code)
        assert snapshot(self.engine, job) == before
        self.seen["bad"] += 1

    def collective(self, inputs: list[np.ndarray], max_steps: int = 200_000) -> list[np.ndarray]:
        """One allreduce of `inputs` (one tensor per member); returns each worker's result."""
        spec = self.spec
        e, s = spec.slot_elems, spec.slots
        length = len(inputs[0])
        nchunks = -(-length // e)
        first = self.next_chunk
        self.next_chunk += nchunks
        ref = reference(inputs, spec.op)
        for i in range(nchunks):
            self.expected[first + i] = ref[i * e : (i + 1) * e]
        workers = [
            Worker(m, x, first, nchunks, e, s) for m, x in zip(spec.members, inputs, strict=True)
        ]
        by_member = {w.member: w for w in workers}
        for w in workers:
            for c in range(first, first + min(s, nchunks)):
                self.send_up(w, c)
        steps = 0
        while not all(w.done for w in workers):
            steps += 1
            assert steps < max_steps, "simulation did not converge"
            if self.bad_input_rate and self.rng.random() < self.bad_input_rate:
                self.inject_bad(workers)
            if not self.pool or self.rng.random() < self.p_spurious:
                # Timeout (real when the network is empty, spurious otherwise):
                # retransmit everything sent whose result has not come back.
                pending = workers if not self.pool else [self.rng.choice(workers)]
                for w in pending:
                    for c in w.outstanding():
                        self.send_up(w, c)
                continue
            # Uniformly random pick = arbitrary reordering; old messages can
            # linger for a long time and arrive very late.
            i = self.rng.randrange(len(self.pool))
            self.pool[i], self.pool[-1] = self.pool[-1], self.pool[i]
            msg = self.pool.pop()
            direction, member, chunk, payload = msg
            loss = self.p_loss_up if direction == "up" else self.p_loss_down
            if self.rng.random() < loss:
                continue
            if self.rng.random() < self.p_dup:
                self.pool.append(msg)
            if direction == "up":
                self.deliver_up(member, chunk, payload)
            else:
                w = by_member[member]
                if chunk in w.results or not w.first <= chunk < w.first + nchunks:
                    continue  # duplicate result, or a late one from an earlier collective
                w.results[chunk] = payload
                nxt = chunk + s  # self-clocking: this result opens chunk + S
                if nxt < first + nchunks:
                    assert nxt not in w.sent
                    self.send_up(w, nxt)
        return [
            np.concatenate([w.results[c] for c in range(first, first + nchunks)]) for w in workers
        ]

    def drain(self) -> None:
        """Deliver every message still in flight (late retransmissions)."""
        while self.pool:
            direction, member, chunk, payload = self.pool.pop(0)
            if direction == "up":
                self.deliver_up(member, chunk, payload)


def run_job(
    dtype: str,
    op: AggOp,
    n_members: int,
    slots: int,
    elems: int,
    lengths: list[int],
    seed: int,
    referenced: bool = False,
    **net: float,
) -> Sim:
    rng = np.random.default_rng(seed)
    engine = AggregationEngine()
    members = tuple(int(m) for m in rng.choice(1000, size=n_members, replace=False))
    spec = JobSpec(7, members, dtype, op, slots, elems, referenced)
    assert engine.register(spec) == Granted(7, slots, elems)
    sim = Sim(engine, spec, random.Random(seed), **net)  # type: ignore[arg-type]
    total = 0
    for length in lengths:
        inputs = make_inputs(rng, dtype, n_members, length)
        results = sim.collective(inputs)
        exp = reference(inputs, op)
        for r in results:
            assert same_bits(r, exp)
        total += -(-length // elems)
    sim.drain()
    # Exactly once: every chunk completed once, each member counted once per chunk.
    assert sorted(sim.completions) == list(range(total))
    assert set(sim.completions.values()) == {1}
    st_ = engine.statistics()
    assert st_.completions == total
    assert st_.contributions == total * n_members
    assert st_.duplicates == sim.seen["dup"]
    assert st_.stale == sim.seen["stale"]
    assert st_.resends == sim.seen["resend"]
    assert st_.rejected == sim.seen["bad"]
    return sim


# ------------------------------------------------------------ correctness


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("op", ALL_OPS)
def test_clean_network_exact_for_every_dtype_and_op(dtype: str, op: AggOp) -> None:
    seed = ALL_DTYPES.index(dtype) * 10 + ALL_OPS.index(op)
    r = random.Random(seed)
    elems = r.randint(3, 40)
    lengths = [elems * r.randint(1, 12) + r.randint(1, elems - 1) for _ in range(2)]
    sim = run_job(dtype, op, r.randint(2, 8), r.randint(1, 6), elems, lengths, seed)
    assert sim.seen == {"dup": 0, "stale": 0, "resend": 0, "bad": 0}


@SEEDED
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    op=st.sampled_from(ALL_OPS),
    n_members=st.integers(2, 8),
    slots=st.integers(1, 5),
    elems=st.integers(1, 24),
    lengths=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    loss=st.sampled_from([0.0, 0.05, 0.2, 0.4]),
    p_dup=st.sampled_from([0.0, 0.1, 0.3]),
    p_spurious=st.sampled_from([0.0, 0.02, 0.1]),
    referenced=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_adversarial_schedules_exactly_once(
    dtype: str,
    op: AggOp,
    n_members: int,
    slots: int,
    elems: int,
    lengths: list[int],
    loss: float,
    p_dup: float,
    p_spurious: float,
    referenced: bool,
    seed: int,
) -> None:
    run_job(
        dtype,
        op,
        n_members,
        slots,
        elems,
        lengths,
        seed,
        referenced,
        p_loss_up=loss,
        p_loss_down=loss,
        p_dup=p_dup,
        p_spurious=p_spurious,
    )


def test_heavy_loss_exercises_every_retransmit_path() -> None:
    """One long lossy run must hit duplicates, kept-result resends and stale late copies."""
    sim = run_job(
        "int32",
        AggOp.SUM,
        5,
        3,
        4,
        [400, 37],
        seed=11,
        p_loss_up=0.3,
        p_loss_down=0.3,
        p_dup=0.3,
        p_spurious=0.05,
    )
    assert sim.seen["dup"] > 0 and sim.seen["resend"] > 0 and sim.seen["stale"] > 0


@SEEDED
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    op=st.sampled_from(ALL_OPS),
    n_members=st.integers(2, 6),
    slots=st.integers(1, 4),
    referenced=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_bad_input_interleaved_never_corrupts(
    dtype: str, op: AggOp, n_members: int, slots: int, referenced: bool, seed: int
) -> None:
    sim = run_job(
        dtype,
        op,
        n_members,
        slots,
        7,
        [60, 23],
        seed,
        referenced,
        p_loss_up=0.1,
        p_loss_down=0.1,
        p_dup=0.1,
        bad_input_rate=0.2,
    )
    assert sim.seen["bad"] > 0


def test_float_sum_is_arrival_order_fold() -> None:
    """Non-dyadic float32: result equals the left fold in arrival order, bit for bit."""
    rng = np.random.default_rng(3)
    xs = [
        rng.standard_normal(33).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4))
        for _ in range(6)
    ]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4]):
        eng = AggregationEngine()
        eng.register(JobSpec(1, tuple(range(6)), "float32", AggOp.SUM, 1, 33))
        for m in order[:-1]:
            assert eng.contribute(1, 0, m, xs[m]) == []
        (done,) = eng.contribute(1, 0, order[-1], xs[order[-1]])
        acc = xs[order[0]].copy()
        for m in order[1:]:
            acc = acc + xs[m]
        assert isinstance(done, Completed) and done.result is not None
        assert same_bits(done.result, acc)


def test_fixed_point_sum_is_order_independent() -> None:
    rng = np.random.default_rng(4)
    xs = [rng.integers(-(2**27), 2**27, size=50).astype(np.int32) for _ in range(8)]
    out = []
    for seed in range(5):
        order = random.Random(seed).sample(range(8), 8)
        eng = AggregationEngine()
        eng.register(JobSpec(1, tuple(range(8)), "int32", AggOp.SUM, 2, 50))
        events = [ev for m in order for ev in eng.contribute(1, 0, m, xs[m])]
        assert isinstance(events[-1], Completed) and events[-1].result is not None
        out.append(events[-1].result.tobytes())
    assert len(set(out)) == 1
    assert out[0] == np.sum(xs, axis=0, dtype=np.int64).astype(np.int32).tobytes()


def test_int_sum_never_wraps_silently() -> None:
    imax = np.iinfo(np.int32).max
    eng = AggregationEngine()
    eng.register(JobSpec(1, (1, 2, 3), "int32", AggOp.SUM, 1, 3))
    # The cheap bound fails but the exact check passes (cancellation): accepted.
    assert eng.contribute(1, 0, 1, np.array([imax, 5, -imax], np.int32)) == []
    assert eng.contribute(1, 0, 2, np.array([-imax, 1, -1], np.int32)) == []
    (done,) = eng.contribute(1, 0, 3, np.array([7, 1, 7], np.int32))
    assert isinstance(done, Completed) and done.result is not None
    assert done.result.tolist() == [7, 7, 6 - imax]
    # Chunk 1 would wrap at element 0: it ends for every member, told once each ...
    assert eng.contribute(1, 1, 1, np.array([imax, 5, 0], np.int32)) == []
    (ev,) = eng.contribute(1, 1, 2, np.array([1, 1, 1], np.int32))
    assert isinstance(ev, Overflowed) and ev.recipients == (1, 2, 3) and "wrap" in ev.reason
    # ... a member that sends to it later (or again) is told again, never given a sum
    (again,) = eng.contribute(1, 1, 3, np.array([1, 1, 1], np.int32))
    assert isinstance(again, Overflowed) and again.recipients == (3,)
    assert eng.kept_result(1, 1) is None
    # ... and the next chunk reuses the slot, exact.
    for m in (1, 2):
        assert eng.contribute(1, 2, m, np.array([m, -m, 3], np.int32)) == []
    (done,) = eng.contribute(1, 2, 3, np.array([3, -3, 3], np.int32))
    assert isinstance(done, Completed) and done.result is not None
    assert done.result.tolist() == [6, -6, 9]
    # int64 likewise, at its own limit.
    imax64 = np.iinfo(np.int64).max
    eng.register(JobSpec(2, (1, 2), "int64", AggOp.SUM, 1, 1))
    eng.contribute(2, 0, 1, np.array([imax64 - 3], np.int64))
    (ev,) = eng.contribute(2, 0, 2, np.array([4], np.int64))
    assert isinstance(ev, Overflowed)
    eng.contribute(2, 1, 1, np.array([imax64 - 3], np.int64))
    (done,) = eng.contribute(2, 1, 2, np.array([3], np.int64))
    assert isinstance(done, Completed) and done.result is not None
    assert int(done.result[0]) == imax64


def test_low_precision_float_error_bound() -> None:
    """float16/bfloat16 accumulate in their own dtype: |error| <= gamma_(n-1) * sum|x|."""
    rng = np.random.default_rng(5)
    n = 8
    for dtype, u in (("float16", 2.0**-11), ("bfloat16", 2.0**-8)):
        xs = [rng.standard_normal(200).astype(DTYPES[dtype]) for _ in range(n)]
        eng = AggregationEngine()
        eng.register(JobSpec(1, tuple(range(n)), dtype, AggOp.SUM, 1, 200))
        events = [ev for m in range(n) for ev in eng.contribute(1, 0, m, xs[m])]
        assert isinstance(events[-1], Completed) and events[-1].result is not None
        got = events[-1].result.astype(np.float64)
        wide = np.stack([x.astype(np.float64) for x in xs])
        gamma = (n - 1) * u / (1 - (n - 1) * u)  # recursive summation (Higham, ch. 4)
        bound = gamma * np.abs(wide).sum(axis=0)
        assert np.all(np.abs(got - wide.sum(axis=0)) <= bound)


# ------------------------------------------------------ retransmit paths


def spec3(referenced: bool = False, slots: int = 2) -> JobSpec:
    return JobSpec(5, (10, 20, 30), "float32", AggOp.SUM, slots, 4, referenced)


def chunk_data(c: int, m: int, n: int = 4) -> np.ndarray:
    return np.full(n, (c + 1) * 1000 + m, dtype=np.float32)


def test_duplicate_resend_and_stale_paths() -> None:
    eng = AggregationEngine()
    eng.register(spec3())
    assert eng.contribute(5, 0, 10, chunk_data(0, 10)) == []
    assert eng.contribute(5, 0, 10, chunk_data(0, 10)) == [DuplicateIgnored(5, 0, 10)]
    assert eng.contribute(5, 0, 20, chunk_data(0, 20)) == []
    (done,) = eng.contribute(5, 0, 30, chunk_data(0, 30))
    assert isinstance(done, Completed) and done.recipients == (10, 20, 30)
    assert done.result is not None
    assert done.result.tolist() == [3060.0] * 4
    # Member 20 lost the result and retransmits: the kept result, to it alone.
    (again,) = eng.contribute(5, 0, 20, chunk_data(0, 20))
    assert isinstance(again, ResendResult) and again.member == 20
    assert again.result is not None and same_bits(again.result, done.result)
    # Chunks 1..3 complete; chunk 4 then reuses slot 0 version 0.
    for c in (1, 2, 3, 4):
        for m in (10, 20, 30):
            eng.contribute(5, c, m, chunk_data(c, m))
    # A late copy of chunk 0 is now stale, and the old view shows chunk 4.
    assert eng.contribute(5, 0, 30, chunk_data(0, 30)) == [Stale(5, 0, 30)]
    assert done.result.tolist() == [15060.0] * 4
    with pytest.raises(ValueError):
        done.result[0] = 1.0  # read-only: the daemon cannot scribble on slot memory
    s = eng.statistics()
    assert (s.contributions, s.completions, s.duplicates, s.resends, s.stale) == (15, 5, 1, 1, 1)


def test_single_member_job_completes_at_once() -> None:
    eng = AggregationEngine()
    eng.register(JobSpec(1, (4,), "bfloat16", AggOp.MAX, 1, 3))
    x = np.array([1.5, -2, 3], dtype=ml_dtypes.bfloat16)
    (done,) = eng.contribute(1, 0, 4, x)
    assert isinstance(done, Completed) and done.result is not None and same_bits(done.result, x)
    (done,) = eng.contribute(1, 1, 4, x[:2])
    assert isinstance(done, Completed) and done.result is not None and len(done.result) == 2


def test_referenced_mode_tracks_bitmaps_only() -> None:
    eng = AggregationEngine()
    g = eng.register(spec3(referenced=True))
    assert isinstance(g, Granted)
    assert eng.statistics().bytes_reserved == 0 and eng.statistics().slots_in_use == 2
    assert eng.contribute(5, 0, 10, None, length=3) == []
    (ev,) = eng.contribute(5, 0, 20, None, length=4)  # disagrees on the chunk's length
    assert isinstance(ev, Rejected) and ev.code == "INVALID"
    assert eng.contribute(5, 0, 20, None, length=3) == []
    (done,) = eng.contribute(5, 0, 30, None, length=3)
    assert done == Completed(5, 0, 0, None, (10, 20, 30))
    assert eng.contribute(5, 0, 30, None, length=3) == [ResendResult(5, 0, 30, None)]


# ---------------------------------------------------------------- bad input


def bad_cases() -> list[tuple[str, tuple, dict, str]]:
    good = chunk_data(0, 10)
    return [
        ("unknown job", (6, 0, 10, good), {}, "UNKNOWN_JOB"),
        ("non-member", (5, 0, 11, good), {}, "PERMISSION"),
        ("too long", (5, 0, 10, chunk_data(0, 10, 5)), {}, "INVALID"),
        ("empty", (5, 0, 10, chunk_data(0, 10, 0)), {}, "INVALID"),
        ("wrong dtype", (5, 0, 10, good.astype(np.float64)), {}, "INVALID"),
        ("byte-swapped", (5, 0, 10, good.astype(">f4")), {}, "INVALID"),
        ("2-D", (5, 0, 10, good.reshape(2, 2)), {}, "INVALID"),
        ("bytes", (5, 0, 10, good.tobytes()), {}, "INVALID"),
        ("no data", (5, 0, 10, None), {"length": 4}, "INVALID"),
        ("length= disagrees", (5, 0, 10, good), {"length": 3}, "INVALID"),
        ("chunk length disagrees", (5, 0, 20, chunk_data(0, 20, 3)), {}, "INVALID"),
        ("negative chunk", (5, -1, 10, good), {}, "INVALID"),
        ("chunk not an int", (5, 0.5, 10, good), {}, "INVALID"),
        ("fresh version, >= 2S", (5, 7, 10, good), {}, "OUT_OF_WINDOW"),
        ("version holds incomplete chunk 0", (5, 4, 10, good), {}, "OUT_OF_WINDOW"),
        ("did not wait for chunk 0", (5, 2, 10, good), {}, "OUT_OF_WINDOW"),
        ("far ahead", (5, 9, 10, good), {}, "OUT_OF_WINDOW"),
    ]


@pytest.mark.parametrize(("name", "args", "kwargs", "code"), bad_cases(), ids=lambda x: x)
def test_bad_input_is_rejected_and_changes_nothing(
    name: str, args: tuple, kwargs: dict, code: str
) -> None:
    eng = AggregationEngine()
    eng.register(spec3())
    eng.contribute(5, 0, 10, chunk_data(0, 10))  # chunk 0 in progress, length 4
    eng.contribute(5, 1, 20, chunk_data(1, 20))
    before = snapshot(eng, 5)
    events = eng.contribute(*args, **kwargs)
    assert len(events) == 1 and isinstance(events[0], Rejected)
    assert events[0].code == code and events[0].reason
    assert snapshot(eng, 5) == before
    assert eng.statistics().rejected == 1
    # A correct run afterwards still gives the exact result.
    eng.contribute(5, 0, 20, chunk_data(0, 20))
    (done,) = eng.contribute(5, 0, 30, chunk_data(0, 30))
    assert isinstance(done, Completed) and done.result is not None
    assert done.result.tolist() == [3060.0] * 4


def test_out_of_window_when_slot_version_holds_incomplete_chunk() -> None:
    eng = AggregationEngine()
    eng.register(spec3(slots=1))
    for c in (0, 1):  # chunk 0 complete, chunk 1 (slot 0 version 1) incomplete
        for m in (10, 20, 30)[: 3 - c]:
            eng.contribute(5, c, m, chunk_data(c, m))
    before = snapshot(eng, 5)
    (ev,) = eng.contribute(5, 3, 30, chunk_data(3, 30))  # would reuse the version of chunk 1
    assert isinstance(ev, Rejected) and ev.code == "OUT_OF_WINDOW"
    (ev,) = eng.contribute(5, 2, 30, chunk_data(2, 30))  # chunk 1 has no result yet
    assert isinstance(ev, Rejected) and ev.code == "OUT_OF_WINDOW"
    assert snapshot(eng, 5) == before


# ------------------------------------------------------------ budget / control


def test_budget_refusal_reports_and_falls_back() -> None:
    eng = AggregationEngine(memory_budget_bytes=10_000)
    big = JobSpec(1, (1, 2), "float32", AggOp.SUM, 8, 256)  # 8*2*256*4 = 16384 B
    r = eng.register(big)
    assert isinstance(r, Refused)
    assert "16384 B" in r.reason and "10000 B" in r.reason  # how much asked, how much free
    assert r.slots_free == 10_000 // (2 * 256 * 4) == 4
    assert eng.statistics().jobs == 0 and eng.statistics().bytes_reserved == 0
    # Its contributions are told to use the host path, not "unknown job".
    (ev,) = eng.contribute(1, 0, 1, np.ones(256, np.float32))
    assert isinstance(ev, Rejected) and ev.code == "NO_RESOURCE"
    # Retrying with what fits succeeds.
    smaller = JobSpec(1, (1, 2), "float32", AggOp.SUM, r.slots_free, 256)
    assert eng.register(smaller) == Granted(1, 4, 256)
    assert eng.statistics().bytes_reserved == 8192
    full = eng.register(JobSpec(2, (1, 2), "int64", AggOp.SUM, 2, 256))
    assert isinstance(full, Refused) and full.slots_free == 0
    eng.release(1)
    assert eng.statistics().bytes_reserved == 0
    assert isinstance(eng.register(JobSpec(2, (1, 2), "int64", AggOp.SUM, 2, 256)), Granted)


def test_reregister_is_idempotent_and_conflicts_are_refused() -> None:
    eng = AggregationEngine()
    spec = JobSpec(3, (1, 2, 3), "float16", AggOp.MIN, 4, 100)
    assert eng.register(spec) == Granted(3, 4, 100)
    eng.contribute(3, 0, 1, np.ones(100, np.float16))
    before = (eng.statistics(), snapshot(eng, 3))
    # Same spec (also spelt with a list and a plain string op): Granted, nothing reset.
    same = JobSpec(3, [1, 2, 3], "float16", "min", 4, 100)  # type: ignore[arg-type]
    assert eng.register(same) == Granted(3, 4, 100)
    assert (eng.statistics(), snapshot(eng, 3)) == before
    r = eng.register(JobSpec(3, (1, 2, 3), "float16", AggOp.MIN, 8, 100))
    assert isinstance(r, Refused) and "different spec" in r.reason
    assert (eng.statistics(), snapshot(eng, 3)) == before
    eng.release(3)
    eng.release(3)  # idempotent
    (ev,) = eng.contribute(3, 0, 2, np.ones(100, np.float16))
    assert isinstance(ev, Rejected) and ev.code == "UNKNOWN_JOB"


def test_max_slots_counts_referenced_jobs() -> None:
    eng = AggregationEngine(memory_budget_bytes=0, max_slots=10)
    assert isinstance(eng.register(JobSpec(1, (1, 2), "float32", AggOp.SUM, 6, 9, True)), Granted)
    r = eng.register(JobSpec(2, (1, 2), "float32", AggOp.SUM, 6, 9, True))
    assert isinstance(r, Refused) and r.slots_free == 4 and "4 of 10 slots free" in r.reason
    frame = eng.register(JobSpec(3, (1, 2), "float32", AggOp.SUM, 1, 9))
    assert isinstance(frame, Refused) and frame.slots_free == 0
    s = eng.statistics()
    assert (s.jobs, s.slots_total, s.slots_in_use, s.budget_bytes) == (1, 10, 6, 0)


@pytest.mark.parametrize(
    "spec",
    [
        JobSpec(70000, (1,), "float32", AggOp.SUM, 1, 1),
        JobSpec(1, (), "float32", AggOp.SUM, 1, 1),
        JobSpec(1, tuple(range(MAX_MEMBERS + 1)), "float32", AggOp.SUM, 1, 1),
        JobSpec(1, (1, 1), "float32", AggOp.SUM, 1, 1),
        JobSpec(1, (-1,), "float32", AggOp.SUM, 1, 1),
        JobSpec(1, (1,), "float64", AggOp.SUM, 1, 1),
        JobSpec(1, (1,), "float32", "prod", 1, 1),  # type: ignore[arg-type]
        JobSpec(1, (1,), "float32", AggOp.SUM, 0, 1),
        JobSpec(1, (1,), "float32", AggOp.SUM, 1, 0),
        JobSpec(1, None, "float32", AggOp.SUM, 1, 1),  # type: ignore[arg-type]
    ],
)
def test_invalid_specs_are_refused(spec: JobSpec) -> None:
    eng = AggregationEngine()
    r = eng.register(spec)
    assert isinstance(r, Refused) and r.reason.startswith("invalid job spec")
    assert eng.statistics().jobs == 0


def test_sixty_four_members() -> None:
    sim = run_job("int64", AggOp.SUM, 64, 2, 5, [23], seed=9, p_loss_up=0.05, p_loss_down=0.05)
    assert sim.engine.statistics().contributions == 64 * 5


def test_install_result_replaces_a_completed_partial_for_resends() -> None:
    """Tree aggregation: a leaf keeps the parent's final result for retransmissions."""
    eng = AggregationEngine(1 << 20)
    eng.register(JobSpec(job=9, members=(0, 1), dtype="float32", op=AggOp.SUM, slots=2,
                         slot_elems=4))
    a = np.array([1, 2, 3, 4], np.float32)
    assert eng.contribute(9, 0, 0, a) == []
    assert not eng.install_result(9, 0, a)  # not complete yet: refused, nothing changes
    (done,) = eng.contribute(9, 0, 1, a)
    assert isinstance(done, Completed)
    final = np.array([10, 20, 30, 40], np.float32)
    assert not eng.install_result(9, 0, final[:3])  # wrong length
    assert not eng.install_result(9, 1, final)  # not the chunk held there
    assert eng.install_result(9, 0, final)
    (again,) = eng.contribute(9, 0, 0, a)
    assert isinstance(again, ResendResult)
    np.testing.assert_array_equal(again.result, final)
