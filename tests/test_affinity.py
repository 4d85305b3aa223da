"""fabric.affinity and the launcher's CPU plan: switches on cores of their own."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from fabric import affinity
from fabric.launcher import Fabric, launch
from fabric.topology import star
from tests import fabric_tasks as tasks

CPUS = sorted(os.sched_getaffinity(0))


def _in_thread(fn):  # pinning applies to the calling thread: keep it off the test's own
    out: list = []
    t = threading.Thread(target=lambda: out.append((fn(), os.sched_getaffinity(0))))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("_before", None), ("_plan", None), ("_held", False)):
        monkeypatch.setattr(affinity, name, value)


def test_setup_pins_or_holds(fresh: None) -> None:
    one = {affinity.ENV: str(CPUS[-1])}
    assert _in_thread(lambda: affinity.setup_from_env({}, pin=True))[0] is None
    got, mask = _in_thread(lambda: affinity.setup_from_env(one, pin=True))
    assert got == (CPUS[-1],) and mask == {CPUS[-1]}
    assert affinity._before == frozenset(CPUS)

    def held() -> list[set[int]]:
        affinity.setup_from_env(one, pin=False)
        seen = [os.sched_getaffinity(0)]
        for narrow in (True, True, False):
            affinity.hold(narrow)
            seen.append(os.sched_getaffinity(0))
        return seen

    assert _in_thread(held)[0] == [set(CPUS), {CPUS[-1]}, {CPUS[-1]}, set(CPUS)]


@pytest.mark.parametrize("bad", ["x", "0,,1", "99999"])
def test_a_bad_plan_is_refused_and_the_process_runs_unpinned(
        bad: str, fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="semfab.affinity"):
        got, mask = _in_thread(lambda: affinity.setup_from_env({affinity.ENV: bad}, pin=True))
    assert got is None and mask == set(CPUS)
    assert "not applied" in caplog.text
    affinity.hold(True)  # no plan: nothing to hold to
    assert os.sched_getaffinity(0) == set(CPUS)
    assert affinity.widen_other_threads() == 0


def test_enabled_and_encode() -> None:
    assert affinity.enabled({}) and not affinity.enabled({affinity.PIN_ENV: "0"})
    assert affinity.encode([3, 1, 2]) == "1,2,3"


def _mask(pid: int, tid: int | None = None) -> set[int]:
    path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
    text = Path(path).read_text().split("Cpus_allowed_list:")[1].split()[0]
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@pytest.mark.skipif(len(CPUS) < 2, reason="a CPU plan needs two cores")
def test_launched_fabric_follows_the_plan(tmp_path: Path) -> None:
    with launch(workers=2, run_dir=tmp_path, timeout_s=30) as fab:
        assert fab.cpu_plan == {"sw0": (CPUS[-1],), "w0": tuple(CPUS[:-1]),
                                "w1": tuple(CPUS[:-1])}
        pids = {name: p.popen.pid for name, p in fab.procs.items()}
        assert _mask(pids["host0"]) == set(CPUS)
        sw, w0 = pids["sw0"], pids["w0"]
        assert _mask(sw) == {CPUS[-1]}
        assert _mask(w0) == set(CPUS)  # a worker keeps to its CPUs only while it spins
        for r in fab.run(tasks.allreduce_check, "ina-mem", 1001, "float32", "sum", 4 << 20,
                         steps=1):
            assert r["wrong"] == 0
        assert _mask(w0) == _mask(pids["w1"]) == set(CPUS[:-1])
        # beyond the spin limit nobody spins: the switch reduces on every core
        # (its kernel's pool included) and the workers wait unpinned
        big = (1 << 19) + 7  # float32: 2 MiB in one chunk
        for r in fab.run(tasks.allreduce_check, "ina-mem", big, "float32", "sum", 4 << 20,
                         steps=1):
            assert r["wrong"] == 0
        threads = [int(t) for t in os.listdir(f"/proc/{sw}/task")]
        assert len(threads) > 1 and all(_mask(sw, t) == set(CPUS) for t in threads)
        assert _mask(w0) == set(CPUS)
        # a small reduction puts the switch back on its own core (its pool stays
        # wide); the frame plane, where workers block, frees them again
        for path, n in (("ina-mem", 1001), ("ina", 1001)):
            for r in fab.run(tasks.allreduce_check, path, n, "float32", "sum", 4 << 20,
                             steps=1):
                assert r["wrong"] == 0
        assert _mask(sw) == {CPUS[-1]}
        assert all(_mask(sw, t) == set(CPUS) for t in threads if t != sw)
        assert _mask(w0) == set(CPUS)


def test_pin_off_leaves_every_process_free(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the plan is made when the Fabric is made; nothing starts before start()
    monkeypatch.setenv(affinity.PIN_ENV, "0")
    assert Fabric(star(2), tmp_path).cpu_plan == {}
    monkeypatch.delenv(affinity.PIN_ENV)
    assert Fabric(star(2), tmp_path).cpu_plan == ({} if len(CPUS) < 2 else
                                                  {"sw0": (CPUS[-1],), "w0": tuple(CPUS[:-1]),
                                                   "w1": tuple(CPUS[:-1])})
    with launch(workers=1, run_dir=tmp_path / "run", timeout_s=30, pin=False) as f:
        assert f.cpu_plan == {}
        assert all(_mask(p.popen.pid) == set(CPUS) for p in f.procs.values())
