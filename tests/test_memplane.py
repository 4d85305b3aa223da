"""The switch's memory plane: regions mapped by key, chunks reduced in place."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fabric.emulation.shm import SharedRegion, region_name
from switchd.memplane import SharedMemoryPlane

RUN = f"t{os.getpid()}"


@pytest.fixture
def regions():
    made: list[SharedRegion] = []

    def make(tag: str, values: np.ndarray, key: int) -> SharedRegion:
        """Node ``tag``'s region ``key`` (the switch finds it by that handle)."""
        r = SharedRegion.create(region_name(RUN, tag, key), values.nbytes)
        r.array(values.dtype, values.size)[:] = values
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_reduce_in_place_into_every_member(regions) -> None:
    rng = np.random.default_rng(4)
    a, b = rng.random(1001, dtype=np.float32), rng.random(1001, dtype=np.float32)
    ra, rb = regions("a", a, 1), regions("b", b, 2)
    plane = SharedMemoryPlane()
    plane.attach(1, "a", RUN, ra.size)
    plane.attach(2, "b", RUN, rb.size)
    dt = np.dtype(np.float32)
    plane.reduce(dt, "max", [(1, 400), (2, 400)], 500)  # one chunk, in the middle
    want = np.maximum(a[100:600], b[100:600])
    for r, orig in ((ra, a), (rb, b)):
        got = r.array(dt, 1001)
        np.testing.assert_array_equal(got[100:600], want)
        np.testing.assert_array_equal(got[:100], orig[:100])  # outside the chunk: untouched
        np.testing.assert_array_equal(got[600:], orig[600:])
    plane.close()


def test_a_key_mapped_anew_reduces_the_new_memory(regions) -> None:
    # the plane keeps views of the chunks it reduced; a key unregistered and
    # registered again for another file (or mapped again) must not use the old ones
    rng = np.random.default_rng(5)
    dt = np.dtype(np.int32)
    vals = {t: rng.integers(-1000, 1000, 64, dtype=np.int32) for t in "abcd"}
    ra, rb, rc, rd = (regions(t, vals[t], k) for t, k in zip("abcd", (1, 2, 1, 2), strict=True))
    plane = SharedMemoryPlane()
    plane.attach(1, "a", RUN, ra.size)
    plane.attach(2, "b", RUN, rb.size)
    plane.reduce(dt, "sum", [(1, 0), (2, 0)], 64)
    plane.detach(1)
    plane.attach(1, "c", RUN, rc.size)  # after an unregister
    plane.attach(2, "d", RUN, rd.size)  # over a live key
    plane.reduce(dt, "sum", [(1, 0), (2, 0)], 64)
    want = vals["c"] + vals["d"]
    np.testing.assert_array_equal(rc.array(dt, 64), want)
    np.testing.assert_array_equal(rd.array(dt, 64), want)
    np.testing.assert_array_equal(ra.array(dt, 64), vals["a"] + vals["b"])  # done before
    plane.close()


@pytest.mark.parametrize("count", [(1 << 16) + 77, (1 << 17) - 3, (1 << 18) + 5])
def test_chunks_either_side_of_the_serial_limit(regions, count: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # up to SERIAL_MAX_BYTES on the calling thread, beyond it the kernel's pool:
    # exact either way, for sizes where the plain backend would take the pool
    from kernels import numba_cpu
    from kernels.backends import get_backend
    from switchd.memplane import SERIAL_MAX_BYTES

    kernel = get_backend("numba-cpu")
    monkeypatch.setattr(kernel, "serial_bytes", kernel.serial_bytes)  # restored after
    serial = []  # calls on the calling thread: the pair kernel (or the NumPy fold)
    native = numba_cpu.reference.multicast_reduce_native
    monkeypatch.setattr(numba_cpu.reference, "multicast_reduce_native",
                        lambda *a: (serial.append(1), native(*a)))
    pair = numba_cpu._pair_inplace
    monkeypatch.setattr(numba_cpu, "_pair_inplace", lambda *a: (serial.append(1), pair(*a)))
    rng = np.random.default_rng(count)
    a, b = rng.random(count, dtype=np.float32), rng.random(count, dtype=np.float32)
    ra, rb = regions(f"sa{count}", a, 1), regions(f"sb{count}", b, 2)
    plane = SharedMemoryPlane()
    plane.prepare("numba-cpu")
    assert kernel.serial_bytes == SERIAL_MAX_BYTES
    plane.attach(1, f"sa{count}", RUN, ra.size)
    plane.attach(2, f"sb{count}", RUN, rb.size)
    dt = np.dtype(np.float32)
    plane.reduce(dt, "sum", [(1, 0), (2, 0)], count)
    assert len(serial) == (count * 4 <= SERIAL_MAX_BYTES)
    want = a + b
    for r in (ra, rb):
        np.testing.assert_array_equal(r.array(dt, count), want)
    plane.close()
