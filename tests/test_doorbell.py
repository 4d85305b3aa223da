"""Shared-memory doorbells (fabric.emulation.doorbell): the rings as a state machine, the
pipes across processes, the switch core's authorisation, and the memory plane
over real processes with doorbells on and off."""

from __future__ import annotations

import os
import select
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, Op
from fabric.core.topology import star
from fabric.emulation import doorbell as db
from fabric.emulation.launcher import launch
from fabric.emulation.shm import SHM_DIR
from switchd.core import DOORBELL_SUFFIX, SwitchCore

pytestmark = pytest.mark.skipif(not db.available(), reason="doorbells need x86-64 ordering")


@pytest.fixture
def bell():
    b = db.Doorbell.create(f"semfab-test-{os.getpid()}-{time.monotonic_ns()}{DOORBELL_SUFFIX}0")
    try:
        yield b
    finally:
        b.close()


def _descriptor(psn: int, op: Op = Op.REDUCE, crc: bool = False) -> bytes:
    return fr.encode_header(op, src=1, dst=0, job=3, psn=psn, dtype=fr.DType.F32, key=7,
                            offset=64 * psn, length=4096, flags=Flag.REF, crc=crc)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.binary(min_size=0, max_size=70), st.none()), max_size=700))
def test_ring_is_a_fifo_of_bounded_size(steps) -> None:
    # post (bytes) and take (None) in any order, against a deque model
    b = db.Doorbell.create(f"semfab-test-{os.getpid()}-{time.monotonic_ns()}{DOORBELL_SUFFIX}0")
    peer = db.Doorbell.attach(b.path)
    model: deque[bytes] = deque()
    try:
        for step in steps:
            if step is None:
                assert peer.recv() == (model.popleft() if model else None)
            else:
                fits = len(step) < db.SLOT and len(model) < db.SLOTS
                assert b.send(step) is fits
                if fits:
                    model.append(step)
            assert peer.pending() is bool(model)
            assert b.backlog() == len(model)  # what the writer sees of the reader
        while model:
            assert peer.recv() == model.popleft()
        assert peer.recv() is None
    finally:
        peer.close()
        b.close()


def test_full_ring_refuses_and_counts(bell) -> None:
    peer = db.Doorbell.attach(bell.path)
    try:
        for i in range(db.SLOTS):
            assert bell.send(_descriptor(i))
        assert not bell.send(_descriptor(db.SLOTS))
        assert bell.outbox.full == 1
        assert fr.decode(peer.recv()).psn == 0  # room again, order kept
        assert bell.send(_descriptor(db.SLOTS))
    finally:
        peer.close()


def test_a_spinning_reader_is_never_rung_a_sleeping_one_is(bell) -> None:
    peer = db.Doorbell.attach(bell.path)
    try:
        bell.send(_descriptor(1))
        assert bell.rings == 0  # nobody said it sleeps: no system call
        assert peer.recv() is not None
        assert not peer.sleep()  # about to block, nothing pending
        bell.send(_descriptor(2))
        assert bell.rings == 1
        assert select.select([peer.fileno()], [], [], 1.0)[0]  # the pipe woke it
        peer.wake()
        assert not select.select([peer.fileno()], [], [], 0)[0]  # emptied
        assert fr.decode(peer.recv()).psn == 2
        bell.send(_descriptor(3))
        assert bell.rings == 1  # awake again: no more rings
    finally:
        peer.close()


def test_handoff_yields_only_after_ringing_a_sleeping_reader(bell, monkeypatch) -> None:
    yields = []
    monkeypatch.setattr(db.os, "sched_yield", lambda: yields.append(1))
    peer = db.Doorbell.attach(bell.path)
    try:
        bell.send(_descriptor(1), handoff=True)
        assert yields == []  # the reader spins: nothing rung, nothing handed over
        assert peer.recv() is not None
        assert not peer.sleep()
        bell.send(_descriptor(2))
        assert (bell.rings, yields) == (1, [])  # rung, but no handoff asked
        peer.wake()
        assert peer.recv() is not None
        assert not peer.sleep()
        bell.send(_descriptor(3), handoff=True)
        assert (bell.rings, yields) == (2, [1])
    finally:
        peer.close()


def test_sleep_sees_a_frame_posted_just_before(bell) -> None:
    peer = db.Doorbell.attach(bell.path)
    try:
        bell.send(_descriptor(1))
        assert peer.sleep()  # must not block: a frame is there
        peer.wake()
    finally:
        peer.close()


def test_wakes_a_reader_blocked_in_another_process(bell) -> None:
    # the worker's side forks a "switch" that blocks, then echoes what it gets
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            sw = db.Doorbell.attach(bell.path)
            for _ in range(50):
                while not sw.pending():
                    if not sw.sleep():
                        select.select([sw.fileno()], [], [], 5.0)
                    sw.wake()
                sw.send(sw.recv())
            code = 0
        finally:
            os._exit(code)
    try:
        for i in range(50):
            frame = _descriptor(i, Op.RESULT, crc=bool(i % 2))
            assert bell.send(frame)
            deadline = time.monotonic() + 5
            while (got := bell.recv()) is None:
                assert time.monotonic() < deadline, "echo never came"
                if i % 3:
                    if not bell.sleep():
                        select.select([bell.fileno()], [], [], 1.0)
                    bell.wake()
            assert got == frame
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_only_descriptors_ride_the_doorbell() -> None:
    assert db.carries(_descriptor(1)) and db.carries(_descriptor(1, Op.RESULT, crc=True))
    assert not db.carries(fr.encode_header(Op.REDUCE, src=1, dst=0, job=3, psn=0,
                                           dtype=fr.DType.F32, payload=b"\0" * 8))
    assert not db.carries(fr.encode_header(Op.ACK, src=1, dst=0, psn=4))
    assert not db.carries(fr.encode(Op.CTRL, src=1, dst=0, payload=control.pack("hello")))


def test_attach_refuses_what_is_not_a_doorbell(tmp_path: Path, bell) -> None:
    with pytest.raises(ValueError, match="not a semfab file"):
        db.Doorbell.attach(tmp_path / "semfab-x")
    plain = SHM_DIR / f"semfab-test-{os.getpid()}-plain"
    plain.write_bytes(b"\0" * db.FILE_BYTES)
    try:
        with pytest.raises(ValueError, match="not a doorbell file"):
            db.Doorbell.attach(plain)
    finally:
        plain.unlink()
    with pytest.raises(OSError):
        db.Doorbell.attach(SHM_DIR / "semfab-test-no-such-file")


def test_close_removes_the_files() -> None:
    b = db.Doorbell.create(f"semfab-test-{os.getpid()}-gone{DOORBELL_SUFFIX}0")
    paths = [b.path, Path(f"{b.path}.up"), Path(f"{b.path}.down")]
    assert all(p.exists() for p in paths)
    b.close()
    assert not any(p.exists() for p in paths)


# ---------------------------------------------------------------- switch core


def _offer(core: SwitchCore, node: str, path: str, src: int | None = None) -> dict:
    n = core.topo.node(node)
    outs = core.handle(node.encode(), fr.encode(
        Op.CTRL, src=n.id if src is None else src, dst=core.id,
        payload=control.pack("doorbell", path=path)), None, 0.0)
    return control.parse(fr.decode(outs[-1][1], outs[-1][2]).payload)


def test_core_attaches_only_a_nodes_own_doorbell() -> None:
    topo = star(2)
    attached: list[tuple[bytes, str]] = []
    core = SwitchCore(topo, "sw0", attach_doorbell=lambda port, path: attached.append(
        (port, path)))
    core.handle_timer(0.0)
    w0, w1 = topo.node("w0"), topo.node("w1")
    own = f"/dev/shm/semfab-r-w0{DOORBELL_SUFFIX}{w0.id}"
    assert _offer(core, "w0", own)["ok"]
    assert attached == [(b"w0", own)]
    # naming another node's file is refused, and nothing is attached
    other = _offer(core, "w0", f"/dev/shm/semfab-r-w1{DOORBELL_SUFFIX}{w1.id}")
    assert not other["ok"] and "must end in" in other["reason"]
    assert len(attached) == 1
    # the driver's own refusal (a file it cannot map) comes back as the reason
    core2 = SwitchCore(topo, "sw0", attach_doorbell=lambda port, path: (_ for _ in ()).throw(
        ValueError("not a doorbell file")))
    core2.handle_timer(0.0)
    assert _offer(core2, "w1", f"/x{DOORBELL_SUFFIX}{w1.id}")["reason"] == "not a doorbell file"
    # a switch without the hook (simulation) says so
    plain = SwitchCore(topo, "sw0")
    plain.handle_timer(0.0)
    assert "no doorbells" in _offer(plain, "w0", own)["reason"]


# ---------------------------------------------------------------- real processes


def _mem_allreduce(ep, count: int, iters: int) -> dict:
    x = ep.alloc(count, "float32")
    wrong = 0
    for it in range(iters):
        inputs = [np.random.default_rng([it, r]).standard_normal(count).astype(np.float32)
                  for r in range(ep.world)]
        x[:] = inputs[ep.rank]
        out = ep.alloc(count, "float32") if it == 0 else None
        if out is not None:  # out of place into registered memory, the first time
            ep.allreduce(x, path="ina-mem", out=out)
            got = out
        else:
            ep.allreduce(x, path="ina-mem", out=x)
            got = x
        expect = inputs[0].copy()
        for a in inputs[1:]:
            expect = expect + a
        wrong += int((got != expect).sum())
        if out is not None:
            ep.free(out)
    stats = ep.switch_stats() if ep.rank == 0 else {}
    return {"wrong": wrong, "bell": ep.bell is not None,
            "bell_in": stats.get("doorbell_frames_in", 0)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on", [True, False])
def test_memory_plane_exact_with_and_without_doorbells(tmp_path: Path, monkeypatch,
                                                       on: bool) -> None:
    monkeypatch.setenv("SEMFAB_DOORBELLS", "1" if on else "0")
    with launch(workers=3, run_dir=tmp_path, timeout_s=20) as fab:
        res = fab.run(_mem_allreduce, 3001, 6)
    assert [r["wrong"] for r in res] == [0, 0, 0]
    assert all(r["bell"] is on for r in res)
    # every descriptor of 3 members x 6 calls went through the rings, or none did
    assert (res[0]["bell_in"] >= 18) if on else res[0]["bell_in"] == 0


@pytest.mark.timeout(120)
def test_doorbell_descriptors_recover_from_loss(tmp_path: Path) -> None:
    # the rings feed the same link pipeline as the socket: faults apply, RTOs recover
    with launch(workers=2, run_dir=tmp_path, timeout_s=20, faults="loss=0.1", seed=3) as fab:
        res = fab.run(_mem_allreduce, 1001, 8)
    assert [r["wrong"] for r in res] == [0, 0]
    assert res[0]["bell_in"] > 0


def test_a_peer_that_scribbles_on_the_indices_cannot_make_this_side_raise(bell) -> None:
    # the other side can write anything into the shared file: every index is wrapped
    peer = db.Doorbell.attach(bell.path)
    try:
        ctrl = bell.outbox._idx
        ctrl[8] = (1 << 64) - 1  # our own tail, overwritten by the peer, about to wrap
        ctrl[0] = (1 << 64) - 2
        assert bell.send(_descriptor(1))  # posted, the tail wrapped to 0 (no OverflowError)
        assert ctrl[8] == 0
        assert isinstance(peer.recv(), bytes)  # slot 254, never written: garbage, not a raise
        peer.inbox._idx[0] = (1 << 64) - 1
        for _ in range(3):
            peer.recv()  # garbage or nothing, never an exception
    finally:
        peer.close()


def test_only_semfab_files_in_the_shared_memory_folder_may_be_mapped() -> None:
    from fabric.emulation.shm import SHM_DIR, is_semfab_file

    assert is_semfab_file(SHM_DIR / "semfab-1-w0-tokens-2a")
    assert not is_semfab_file(SHM_DIR / "other-file")
    assert not is_semfab_file("/etc/semfab-passwd")
    assert not is_semfab_file(SHM_DIR / "sub" / "semfab-x")
