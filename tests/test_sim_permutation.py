"""`semfab sim permutation` (fabric/sim/permutation.py): every host to another on a
leaf/spine, ECMP or per-frame spraying, data exact, never better than the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.cli import main
from fabric.sim.permutation import PermutationSettings, run_permutation


@pytest.mark.parametrize("spray", [False, True])
@pytest.mark.parametrize("ratio,spines", [(1.0, 4), (4.0, 2)])
def test_permutation_is_exact_and_obeys_the_busiest_link(spray: bool, ratio: float,
                                                         spines: int) -> None:
    s = PermutationSettings(leaves=4, per_leaf=4, spines=spines, size=200_000,
                            oversubscription=ratio, spray=spray, trim=True, seed=5)
    r = run_permutation(s)
    assert r["finished"] and r["wrong"] == 0
    assert r["completion_s"] >= r["ideal_s"] * (1 - 1e-12)
    assert r["settings"]["uplink_gbps"] == pytest.approx(4 * 100 / (ratio * spines))
    assert r["retransmits"] <= r["trims"] + r["timeouts"]


def test_spraying_avoids_the_collisions_of_ecmp() -> None:
    """16 flows over 4 uplinks per leaf: hashing puts several on one uplink (for this
    seed, and for most), spraying spreads every frame."""
    ecmp, spray = (run_permutation(PermutationSettings(
        leaves=4, per_leaf=4, spines=4, size=500_000, spray=sp, trim=True, seed=0))
        for sp in (False, True))
    assert ecmp["wrong"] == spray["wrong"] == 0
    assert spray["completion_s"] < ecmp["completion_s"]
    assert spray["fct_slowdown"]["p99"] < ecmp["fct_slowdown"]["p99"]


def test_command_json_and_one_line_refusals(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["sim", "permutation", "--leaves", "2", "--per-leaf", "2", "--spines", "2",
                 "--size", "50000", "--spray", "--trim", "--cc", "eqds", "--json",
                 str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["wrong"] == 0 and row["settings"]["spray"] and row["settings"]["cc"] == "eqds"
    capsys.readouterr()
    for argv, word in ((["--leaves", "1", "--per-leaf", "1"], "2..65535"),
                       (["--oversubscription", "0.5"], "--oversubscription"),
                       (["--cc", "reno"], "unknown congestion control"),
                       (["--buffer", "10"], "holds no frame")):
        opts = {"--leaves": "2", "--per-leaf": "2", "--spines": "2", "--size": "1000",
                **dict(zip(argv[::2], argv[1::2], strict=True))}
        assert main(["sim", "permutation", *[x for kv in opts.items() for x in kv]]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1, err
        assert word in err, err


def test_the_fullest_leaf_spine_queues_are_recorded_and_drawn(tmp_path: Path) -> None:
    record: dict = {}
    s = PermutationSettings(leaves=4, per_leaf=4, spines=4, size=200_000)
    r = run_permutation(s, record)
    queues = record["queues"]
    assert 0 < len(queues) <= 4 and r["wrong"] == 0
    peak = max(max(b for _t, b in series) for series in queues.values())
    assert peak == r["peak_queue_bytes"]  # ECMP's collisions queue between leaves and spines
    png, trace = tmp_path / "q.png", tmp_path / "q.json"
    assert main(["sim", "permutation", "--leaves", "4", "--per-leaf", "4", "--spines", "4",
                 "--size", "200K", "--plot", str(png), "--trace", str(trace)]) == 0
    assert png.stat().st_size > 0
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "C" for e in events)
