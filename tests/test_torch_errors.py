"""Bad input to the semfab backend: typed errors naming the rank and the
operation, nothing waiting past the timeout, no process left after a rank dies
(tests/torch_bad_input.py is the job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torch_jobs import leftovers, torchrun

pytest.importorskip("torch")

TIMEOUT_S = 3.0
JOB = "tests/torch_bad_input.py"


def test_refusals_are_typed_and_a_dead_rank_0_leaves_no_process(tmp_path: Path) -> None:
    res = torchrun(JOB, 2, tmp_path, "refusals", str(tmp_path), SEMFAB_TIMEOUT=str(TIMEOUT_S),
                   timeout_s=90)
    # the job ends with rank 0 SIGKILLed: torchrun fails it
    assert res.returncode != 0, res.stdout[-2000:]
    by_rank = {d["rank"]: d for d in (json.loads(p.read_text())
                                      for p in sorted(tmp_path.glob("rank*.json")))}
    assert sorted(by_rank) == [0, 1]
    for r, seen in by_rank.items():
        for case, op, words in [("product", "allreduce", "PRODUCT"),
                                ("float64", "allreduce", "float64"),
                                ("meta", "allreduce", "device meta"),
                                ("anysource", "recv (any source)", "any source"),
                                ("uneven_split", "all_to_all_single", "split sizes"),
                                ("checked_mismatch", "allreduce", f"group ranks [{1 - r}]")]:
            got = seen[case]
            assert got["error"] == "TorchOpError", (r, case, got)
            assert got["rank"] == r and got["op"] == op, (r, case, got)
            assert got["message"].startswith(f"semfab rank {r}: {op}: "), got
            assert words in got["message"], got
        # a checked refusal leaves the group usable; the sum is right
        assert seen["checked_after"]["error"] is None
        assert seen["checked_value"] == [3.0] * 5
        # one rank refuses its argument: the other learns it at once, by name
        got = seen["one_refuses"]
        if r == 1:
            assert got["error"] == "TorchOpError" and "float64" in got["message"], got
        else:
            assert got["error"] == "TorchCommError" and "group rank 1" in got["message"], got
            assert "float64" in got["message"] and got["s"] < TIMEOUT_S, got
        assert seen["one_after"]["error"] is None and seen["one_after_value"] == [3.0] * 3
        # unchecked sizes that differ: the switch refuses one rank's chunk, the call
        # ends on both (typed, within the timeout), and the next call is exact
        got = seen["mismatch"]
        assert got["error"] == "TorchCommError" and got["rank"] == r, got
        assert got["op"] == "allreduce" and got["s"] < 2 * TIMEOUT_S, got
        assert seen["after"]["error"] is None, seen["after"]
        assert seen["after_value"] == [3.0] * 4
    # rank 0 started the switch and the host: they notice their parent is gone,
    # and torchrun ends rank 1
    assert leftovers(tmp_path, wait_s=10) == [], res.stderr[-3000:]
