"""The topology file's ``[congestion]`` table (fabric/core/congestion/settings.py,
fabric/core/topology.py): read, checked, written back, generated."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fabric.cli import main
from fabric.core.congestion.settings import CongestionSettings
from fabric.core.topology import TopologyError, load, loads, star

BODY = """
[[node]]
name = "w0"
kind = "worker"

[[node]]
name = "sw0"
kind = "switch"

[[link]]
a = "w0"
b = "sw0"
class = "scaleup"
"""


def test_a_topology_without_the_table_has_the_defaults() -> None:
    t = loads(BODY)
    assert t.congestion == CongestionSettings() and t.congestion.is_default
    assert "[congestion]" not in t.to_toml()


def test_settings_are_read_checked_and_round_trip() -> None:
    t = loads(BODY + """
[congestion]
buffer_bytes = 150000
buffer_alpha = 0.5
trim = true
ecn_kmin_bytes = 30000
ecn_kmax_bytes = 120000
ecn_pmax = 1
cc = "eqds"
""")
    c = t.congestion
    assert (c.buffer_bytes, c.buffer_alpha, c.trim, c.pfc, c.cc) == (150000, 0.5, True, False,
                                                                     "eqds")
    assert c.ecn_pmax == 1.0 and isinstance(c.ecn_pmax, float)
    again = loads(t.to_toml())
    assert again == t and again.congestion == c
    assert t != loads(BODY)  # the settings are part of the fabric's identity
    assert "congestion: buffer_bytes 150000" in t.summary()


@pytest.mark.parametrize("table,words", [
    ('cc = "reno"', ["cc 'reno' is not a known policy"]),
    ("ecn_kmin_bytes = 5\necn_kmax_bytes = 2", ["Kmin must be <= Kmax"]),
    ("buffer_bytes = -1", ["buffer_bytes", "below"]),
    ("buffer_bytes = 1e3", ["whole number of bytes"]),
    ("pfc = true\ntrim = true", ["never trimmed"]),
    ("credit = true\npfc = true", ["lossless by themselves"]),
    ("base_rtt_us = 0", ["base_rtt_us must be a positive number"]),
    ('credit = 1', ["true or false"]),
    ("ecn_pmax = 2.0", ["ecn_pmax"]),
    ('trim = "yes"', ["true or false"]),
    ("buffer_alpha = 0", ["buffer_alpha"]),
    ("colour = 1", ["unknown key 'colour'"]),
])
def test_impossible_settings_are_one_line_topology_errors(table: str, words: list[str]) -> None:
    with pytest.raises(TopologyError) as err:
        loads(BODY + "\n[congestion]\n" + table + "\n", "f.toml")
    msg = str(err.value)
    assert msg.startswith("f.toml: [congestion]: ") and "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_with_congestion_keeps_everything_else() -> None:
    t = star(3, bandwidth_gbps=100)
    c = CongestionSettings(pfc=True, buffer_bytes=32_000_000, cc="dcqcn")
    u = t.with_congestion(c)
    assert u.congestion == c and u.links == t.links and u.nodes == t.nodes
    assert u.with_congestion(CongestionSettings()) == t
    assert math.isinf(CongestionSettings().buffer_alpha)


def test_topo_gen_writes_the_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.toml"
    assert main(["topo", "gen", "--leaves", "2", "--per-leaf", "2", "--spines", "2",
                 "--bandwidth-gbps", "100", "--trim", "--buffer-bytes", "150000", "--cc", "nscc",
                 "--ecn-kmin-bytes", "30000", "--ecn-kmax-bytes", "120000", "-o",
                 str(out)]) == 0
    c = load(out).congestion
    assert (c.trim, c.buffer_bytes, c.ecn_kmin_bytes, c.ecn_kmax_bytes) == (True, 150000,
                                                                            30000, 120000)
    assert main(["topo", "gen", "--workers", "2", "--cc", "cubic"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("semfab: error: ") and "cubic" in err and len(err.splitlines()) == 1


def test_rto_ceiling_follows_bounded_buffers() -> None:
    """Streams back off to 1 s on unbounded queues; behind bounded buffers to two
    windows at the bottleneck rate; to ``rto_max_us`` when it is given. A short
    ceiling gives up only after 10 s too; jitter only behind bounded buffers. The
    aggregation and MoE timers follow (two of their floors)."""
    from fabric.core.programs import (
        STREAM_GIVE_UP_S,
        STREAM_RTO_MAX_S,
        NodeState,
    )

    base = star(3, bandwidth_gbps=2.0)
    window = 16 * 65536
    wire = window * 8 / 2e9  # one window at 2 Gb/s: 4.19 ms
    for cong, ceiling in [(CongestionSettings(), STREAM_RTO_MAX_S),
                          (CongestionSettings(buffer_bytes=400_000), 2 * 0.005),
                          (CongestionSettings(buffer_bytes=400_000, rto_max_us=30_000.0), 0.03),
                          (CongestionSettings(rto_max_us=30_000.0), 0.03)]:
        st = NodeState(base.with_congestion(cong), "w0")
        first, floor, top = st.stream_rto(window, st.worker_ids[1])
        assert top == pytest.approx(ceiling)
        assert floor == pytest.approx(min(max(0.005, wire), ceiling))
        assert floor <= first <= top
        tx = st.stream_sender(16, st.worker_ids[1], policy="selective", window_frames=16,
                              frame_bytes=65536, operation="WRITE stream", key=1)
        assert tx.rto_max == pytest.approx(ceiling)
        bounded = cong.buffer_bytes is not None
        short = ceiling < STREAM_RTO_MAX_S
        assert tx.give_up_s == (STREAM_GIVE_UP_S if short else 0.0)
        assert tx._rtt.ceiling_srtts == (2.0 if short else 0.0)
        assert tx._rtt.jitter == (0.5 if bounded else 0.0)  # jitter behind buffers only
        est = st.estimator("moe_home", 0.05)
        assert est.rto_max == pytest.approx(ceiling if cong.rto_max_us else
                                            0.1 if bounded else 2.0)


def test_rto_max_us_is_checked_and_written_by_topo_gen(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="rto_max_us must be a positive number"):
        loads(BODY + "\n[congestion]\nrto_max_us = -3\n", "f.toml")
    out = tmp_path / "t.toml"
    assert main(["topo", "gen", "--workers", "2", "--bandwidth-gbps", "1", "--buffer-bytes",
                 "200000", "--rto-max-us", "20000", "-o", str(out)]) == 0
    assert load(out).congestion.rto_max_us == 20000.0


THREE_NETWORKS = """
[congestion]
cc = "nscc"

[congestion.scaleout]
buffer_bytes = 2000000
pfc = true

[congestion.frontend]
buffer_bytes = 300000
cc = "dctcp"
"""


def _cluster_with_classes() -> object:
    from fabric.core.topology import cluster

    base = cluster(2, 2, hosts=1, scaleout={"bandwidth_gbps": 10.0},
                   frontend={"bandwidth_gbps": 10.0})
    return loads(base.to_toml() + THREE_NETWORKS)


def test_a_network_class_overrides_the_fabric_table_and_round_trips() -> None:
    from fabric.core.congestion.settings import NETWORK_CLASSES
    from fabric.core.topology import LINK_CLASSES

    assert NETWORK_CLASSES == LINK_CLASSES  # one list of classes, in two layers
    t = _cluster_with_classes()
    c = t.congestion  # type: ignore[attr-defined]
    assert c.cc == "nscc" and c.buffer_bytes is None and len(c.classes) == 2
    out, front = c.for_class("scaleout"), c.for_class("frontend")
    assert (out.cc, out.pfc, out.buffer_bytes) == ("nscc", True, 2_000_000)
    assert (front.cc, front.pfc, front.buffer_bytes) == ("dctcp", False, 300_000)
    assert c.for_class("scaleup") == CongestionSettings(cc="nscc")
    again = loads(t.to_toml())  # type: ignore[attr-defined]
    assert again == t and "[congestion.frontend]" in t.to_toml()  # type: ignore[attr-defined]
    assert "frontend: buffer_bytes 300000, cc dctcp" in t.summary()  # type: ignore[attr-defined]


def test_a_stream_follows_its_routes_outermost_class() -> None:
    """Within a scale-up domain the fabric's table; across domains scale-out's;
    to a host the front-end's (its policy, and whether its switches drop)."""
    from fabric.core.congestion.dctcp import Dctcp
    from fabric.core.congestion.nscc import Nscc
    from fabric.core.programs import NodeState

    t = _cluster_with_classes()
    st = NodeState(t, "w0")  # type: ignore[arg-type]
    ids = {n: t.node(n).id for n in ("w1", "w2", "host0")}  # type: ignore[attr-defined]
    assert isinstance(st.stream_cc(ids["w1"], 4096), Nscc)  # same domain: [congestion]
    assert isinstance(st.stream_cc(ids["w2"], 4096), Nscc)  # across: scale-out's
    assert isinstance(st.stream_cc(ids["host0"], 4096), Dctcp)  # to a host: front-end's
    assert not st.overflow_drops(ids["w2"])  # lossless (PFC)
    assert st.overflow_drops(ids["host0"]) and st.overflow_drops()  # tail drop somewhere
    assert st.stream_rto(64 * 4096, ids["host0"])[2] < st.stream_rto(64 * 4096, ids["w2"])[2]


def test_each_class_gets_its_own_buffer_at_a_switch() -> None:
    """spine0 holds scale-out ports (lossless, 2 MB) and a front-end port (tail drop
    and marking, 300 kB); a domain's switch queues nothing on its scale-up ports."""
    from fabric.core.congestion.switchq import switch_queues

    q = switch_queues(_cluster_with_classes())  # type: ignore[arg-type]
    out, front = q[("spine0", "scaleout")], q[("spine0", "frontend")]
    assert out is not front and out.lossless and not front.lossless
    assert out.buffer.buffer.size == 2_000_000 and front.buffer.buffer.size == 300_000
    assert front.marker is not None  # a policy named: it marks
    assert ("su0", "scaleup") not in q and q[("su0", "scaleout")].lossless


@pytest.mark.parametrize("table,words", [
    ("[congestion.frontend]\ncolour = 1", ["[congestion.frontend]", "unknown key 'colour'"]),
    ("[congestion]\ntrim = true\n[congestion.scaleout]\npfc = true",
     ["[congestion.scaleout]", "never trimmed"]),
    ("[congestion]\nfrontend = 3", ["must be a table"]),
    ("[congestion.backbone]\ncc = \"nscc\"", ["unknown key 'backbone'", "[congestion.scaleup"]),
])
def test_impossible_class_tables_are_one_line_errors(table: str, words: list[str]) -> None:
    with pytest.raises(TopologyError) as err:
        loads(BODY + "\n" + table + "\n", "f.toml")
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_topo_gen_writes_a_class_table(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.toml"
    assert main(["topo", "gen", "--cluster", "2", "--gpus-per-domain", "2", "--hosts", "1",
                 "--cc", "nscc", "--class-congestion", "frontend:cc=dctcp,buffer_bytes=1000000",
                 "--class-congestion", "scaleout:pfc=true,buffer_bytes=4000000",
                 "-o", str(out)]) == 0
    c = load(out).congestion
    assert c.for_class("frontend").cc == "dctcp" and c.for_class("scaleout").pfc
    assert c.for_class("scaleup").buffer_bytes is None
    for bad, words in ((["backbone:cc=nscc"], "CLASS one of"), (["frontend:cc"], "KEY=VALUE"),
                       (["frontend:pfc=yes"], "true or false")):
        assert main(["topo", "gen", "--workers", "2", "--class-congestion", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
