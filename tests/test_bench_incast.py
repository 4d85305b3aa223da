"""`semfab bench incast`: the same incast on real processes and in virtual time,
exact in both; its workload through a congested switch in the simulator; bad
flags refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.incast import Settings, congestion, incast_work, links_rtt_s
from fabric.cli import main
from fabric.core.topology import star
from fabric.sim import Simulation


def _settings(**kw: object) -> Settings:
    base = dict(senders=3, size=300_001, link_gbps=1.0, latency_us=20.0, mtu=8192,
                policies=("nscc",), buffer=None, trim=False, kmin=None, kmax=None, pmax=None,
                warmup=0, iters=2, seed=5, sim=True)
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("cc,trim", [("none", False), ("nscc", True), ("dcqcn", False)])
def test_the_incast_workload_is_exact_through_a_congested_switch(cc: str, trim: bool) -> None:
    s = _settings(trim=trim, buffer=3 * 8300)  # room for three frames: it overflows
    topo = star(s.senders + 1, bandwidth_gbps=s.link_gbps, latency_us=s.latency_us,
                mtu=s.mtu, hosts=0).with_congestion(congestion(s, cc, links_rtt_s(s)))
    res = Simulation(topo, seed=s.seed, timeout_s=30).run(incast_work, s.senders, s.size,
                                                          s.iters, s.seed)
    assert [r["wrong"] for r in res.results[s.senders]] == [0, 0]  # every byte, each time
    assert res.ecn_marks > 0
    if trim:
        assert res.trims > 0 and res.overflow_drops == 0
    else:
        assert res.overflow_drops > 0
    assert res.retransmits > 0


@pytest.mark.timeout(240)
def test_bench_incast_emulated_and_simulated(tmp_path: Path) -> None:
    out = tmp_path / "incast.json"
    rc = main(["bench", "incast", "--senders", "2", "--size", "200K", "--mtu", "8192",
               "--link-gbps", "0.2", "--cc", "nscc", "--trim", "-w", "0", "-n", "1",
               "--packet-level",
               "--run-dir", str(tmp_path / "runs"), "--json", str(out),
               "--plot", str(tmp_path / "q.png"), "--trace", str(tmp_path / "q.json")])
    assert rc == 0
    assert (tmp_path / "q-nscc.png").stat().st_size > 0
    trace = json.loads((tmp_path / "q.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["name"] for e in events if e.get("ph") == "C"}
    assert any("emulation" in n for n in names) and any("simulation" in n for n in names)
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["world"], r["cc"]) for r in rows] == [("emulation", "nscc"),
                                                     ("simulation", "nscc"),
                                                     ("packet-level", "nscc")]
    for r in rows:
        assert set(r) >= {"completion_s", "ideal_s", "fct_slowdown", "goodput_gbps", "jain",
                          "drops", "trims", "ecn_marks", "pauses", "paused_s", "retransmits",
                          "wrong"}
        assert r["wrong"] == 0 and r["completion_s"] >= 0.99 * r["ideal_s"]
    assert rows[0]["vs_sim"] > 0 and rows[2]["vs_sim"] > 0
    st = doc["settings"]
    assert st["base_rtt_s"] >= st["links_rtt_s"] > 0 and st["trim"] is True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pfc", "credit"])
def test_bench_incast_lossless_in_both_worlds(mode: str, tmp_path: Path) -> None:
    """--pfc: a lossless buffer in the switch daemon and in the simulator alike, the
    senders' links paused instead of frames dropped; --credit: the links wait for
    credit instead. Every byte exact, nothing dropped."""
    out = tmp_path / f"{mode}.json"
    flags = ["--pfc", "--buffer", "40K"] if mode == "pfc" else ["--credit"]
    rc = main(["bench", "incast", "--senders", "3", "--size", "300K", "--mtu", "8192",
               "--link-gbps", "0.2", "--cc", "none", *flags, "-w", "0",
               "-n", "1", "--run-dir", str(tmp_path / "runs"), "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["world"] for r in rows] == ["emulation", "simulation"]
    for r in rows:
        assert r["wrong"] == 0 and r["drops"] == 0 and r["trims"] == 0
        if mode == "pfc":
            assert r["pauses"] > 0 and r["paused_s"] > 0, r["world"]
        else:
            assert r["pauses"] == 0 and r["credit_stalls"] > 0, r["world"]
    assert json.loads(out.read_text())["settings"][mode] is True


@pytest.mark.parametrize("trim", [False, True])
def test_receiver_credit_keeps_the_incast_queue_to_the_first_bytes(trim: bool) -> None:
    """eqds on streams: each sender sends one BDP unsolicited, then what the
    receiver's pacer grants at its link rate. Behind a buffer of 5 BDP (1 with
    trimming, which the first bytes of 3 senders overflow: those are granted again)
    nothing is dropped, the queue holds about the senders' first bytes, and the
    incast completes within 3% of ideal; every byte exact."""
    s = _settings(trim=trim, size=600_001)
    rtt = links_rtt_s(s)
    topo = star(s.senders + 1, bandwidth_gbps=s.link_gbps, latency_us=s.latency_us,
                mtu=s.mtu, hosts=0).with_congestion(congestion(s, "eqds", rtt))
    res = Simulation(topo, seed=s.seed, timeout_s=30).run(incast_work, s.senders, s.size,
                                                          s.iters, s.seed)
    per = res.results[s.senders]
    assert [r["wrong"] for r in per] == [0, 0] and res.overflow_drops == 0
    bdp = s.link_gbps * 1e9 / 8 * rtt
    ideal = s.senders * s.size * 8 / (s.link_gbps * 1e9)
    assert max(r["seconds"] for r in per) < 1.03 * ideal + 2 * rtt
    peak = max(res.queue_peaks.values())
    if trim:
        assert res.trims > 0 and peak <= 1.1 * bdp
    else:
        assert res.trims == 0 and bdp < peak <= (s.senders + 0.5) * bdp


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_receiver_credit_reaches_a_stream_whose_first_frames_were_all_cut(frames: int) -> None:
    """Four senders behind a trimming buffer of one to three frames: some streams'
    unsolicited frames are all trimmed, so nothing of them comes whole. Their
    headers make them known to the receiver, which grants them; before, those
    senders waited for credit for ever."""
    import dataclasses

    s = _settings(trim=True, size=300_001, senders=4)
    cong = dataclasses.replace(congestion(s, "eqds", links_rtt_s(s)), buffer_bytes=8300 * frames)
    topo = star(s.senders + 1, bandwidth_gbps=s.link_gbps, latency_us=s.latency_us,
                mtu=s.mtu, hosts=0).with_congestion(cong)
    res = Simulation(topo, seed=s.seed, timeout_s=5).run(incast_work, s.senders, s.size,
                                                         s.iters, s.seed)
    assert [r["wrong"] for r in res.results[s.senders]] == [0, 0] and res.trims > 0


@pytest.mark.timeout(240)
def test_bench_incast_receiver_credit_in_both_worlds(tmp_path: Path) -> None:
    """--cc eqds on real processes too: the receiver's endpoint grants its senders
    credit by CREDIT frames through the switch daemon; every byte exact."""
    out = tmp_path / "eqds.json"
    rc = main(["bench", "incast", "--senders", "3", "--size", "300K", "--mtu", "8192",
               "--link-gbps", "0.2", "--cc", "eqds", "--trim", "-w", "0", "-n", "1",
               "--run-dir", str(tmp_path / "runs"), "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["world"], r["cc"]) for r in rows] == [("emulation", "eqds"),
                                                     ("simulation", "eqds")]
    for r in rows:
        assert r["wrong"] == 0 and r["drops"] == 0
        assert r["completion_s"] >= 0.99 * r["ideal_s"]


@pytest.mark.parametrize("argv,message", [
    (["--pfc", "--trim"], "never trimmed"),
    (["--credit", "--pfc"], "lossless by themselves"),
    (["--senders", "9"], "must be 1..5"),
    (["--cc", "reno"], "unknown policy"),
    (["--kmin", "9000", "--kmax", "100"], "Kmin must be <= Kmax"),
    (["--buffer", "100"], "at least"),
    (["--spray"], "no second path"),
])
def test_bench_incast_refuses_bad_flags(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "incast", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
