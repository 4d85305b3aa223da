"""Tests for fabric.core.topology: builders, loading, validation errors, queries, CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core.topology import (
    BUILTIN_DEFAULTS,
    DEFAULT_BASE_PORT,
    LinkParams,
    Topology,
    TopologyError,
    check_main,
    cluster,
    gen_main,
    leaf_spine,
    load,
    loads,
    star,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "topologies"

# A small valid file that error cases below break one thing at a time.
BASE = """
[[node]]
name = "w0"
kind = "worker"
[[node]]
name = "w1"
kind = "worker"
[[node]]
name = "sw0"
kind = "switch"
[[link]]
a = "w0"
b = "sw0"
class = "scaleup"
[[link]]
a = "w1"
b = "sw0"
class = "scaleup"
"""


def node(name: str, kind: str) -> str:
    return f'\n[[node]]\nname = "{name}"\nkind = "{kind}"\n'


def link(a: str, b: str, cls: str = "scaleup", **extra: object) -> str:
    lines = [f'\n[[link]]\na = "{a}"\nb = "{b}"\nclass = "{cls}"']
    lines += [f"{k} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# builders and queries
# ---------------------------------------------------------------------------


def test_star_shape_ids_and_queries() -> None:
    t = star(4)
    assert [n.name for n in t.workers] == ["w0", "w1", "w2", "w3"]
    assert [n.name for n in t.hosts] == ["host0"]
    assert [n.name for n in t.switches] == ["sw0"]
    assert [(n.name, n.id) for n in t.nodes] == [
        ("w0", 0),
        ("w1", 1),
        ("w2", 2),
        ("w3", 3),
        ("host0", 4),
        ("sw0", 5),
    ]
    assert t.rank("w2") == 2
    assert t.by_id(4).name == "host0"
    assert t.node("sw0").is_switch
    assert t.switch_of("w3") == "sw0" and t.switch_of("host0") == "sw0"
    assert t.members_of("sw0") == ["w0", "w1", "w2", "w3"]
    assert t.attached("sw0") == ["w0", "w1", "w2", "w3", "host0"]
    assert t.aggregation_tree() == {"sw0": None}
    assert t.tree_root() == "sw0"
    assert t.subtree_workers("sw0") == ["w0", "w1", "w2", "w3"]
    assert t.oversubscription("sw0") == 1.0
    assert t.route("w0", "w1") == ["sw0"]
    assert t.route("w0", "w0") == []
    assert t.route("w0", "sw0") == ["sw0"]
    assert [(x.a, x.b) for x in t.path_links("w0", "host0")] == [("w0", "sw0"), ("host0", "sw0")]
    lk = t.link_between("sw0", "w1")
    assert lk is not None and lk.cls == "scaleup" and lk.other("sw0") == "w1"
    assert t.link_between("w0", "w1") is None
    # Built-in defaults: unshaped, so a default emulation measures the host.
    assert lk.params == BUILTIN_DEFAULTS["scaleup"]
    assert lk.params.bandwidth_gbps == 0 and not lk.params.shaped
    assert lk.params.mtu == 256 * 1024
    assert t.defaults["frontend"].mtu == 64 * 1024


def test_star_link_params_and_options() -> None:
    t = star(2, hosts=0, cls="frontend", latency_us=5, bandwidth_gbps=100.0, loss=0.01, mtu=1500)
    assert t.hosts == []
    p = t.links[0].params
    assert (p.latency_us, p.bandwidth_gbps, p.loss, p.mtu) == (5.0, 100.0, 0.01, 1500)
    assert t.links[0].cls == "frontend"
    with pytest.raises(TopologyError, match="latncy_us.*did you mean 'latency_us'"):
        star(2, latncy_us=1)
    with pytest.raises(TopologyError, match="unknown class 'nvlink'.*scaleup, scaleout, frontend"):
        star(2, cls="nvlink")
    with pytest.raises(TopologyError, match="workers must be an integer >= 1"):
        star(0)


def test_leaf_spine_2x2_os2() -> None:
    t = leaf_spine(2, 2, oversubscription=2, leaf_bandwidth_gbps=8)
    assert [n.name for n in t.workers] == ["w0", "w1", "w2", "w3"]
    assert t.switch_of("w1") == "leaf0" and t.switch_of("w2") == "leaf1"
    assert t.switch_of("host0") == "spine0"
    assert t.route("w0", "w1") == ["leaf0"]
    assert t.route("w0", "w3") == ["leaf0", "spine0", "leaf1"]
    assert t.route("w3", "host0") == ["leaf1", "spine0"]
    assert [x.cls for x in t.path_links("w0", "w3")] == [
        "scaleup",
        "scaleout",
        "scaleout",
        "scaleup",
    ]
    assert t.aggregation_tree() == {"spine0": None, "leaf0": "spine0", "leaf1": "spine0"}
    assert t.tree_children("spine0") == ["leaf0", "leaf1"]
    assert t.subtree_workers("leaf1") == ["w2", "w3"]
    assert t.subtree_workers("spine0") == ["w0", "w1", "w2", "w3"]
    assert t.members_of("spine0") == []
    assert t.updown_bandwidth("leaf0") == (16.0, 8.0)
    assert t.oversubscription("leaf0") == 2.0
    assert t.oversubscription("spine0") == 1.0
    # The host link gets a worker link's bandwidth by default.
    host_link = t.link_between("host0", "spine0")
    assert host_link is not None and host_link.params.bandwidth_gbps == 8.0


@pytest.mark.parametrize("ratio", [1.0, 2.0, 4.0, 1.5])
@pytest.mark.parametrize("spines", [1, 2, 3])
def test_leaf_spine_ratio(ratio: float, spines: int) -> None:
    t = leaf_spine(3, 4, spines=spines, oversubscription=ratio, leaf_bandwidth_gbps=100)
    for leaf in ("leaf0", "leaf1", "leaf2"):
        assert t.oversubscription(leaf) == pytest.approx(ratio)
        assert len(t.uplinks(leaf)) == spines
    for sp in range(spines):
        assert t.oversubscription(f"spine{sp}") == 1.0


def test_leaf_spine_multi_spine_tree_prunes_extra_spines() -> None:
    t = leaf_spine(2, 2, spines=2)
    # Both spines are one hop from every leaf; the first wins, the other only forwards.
    assert t.aggregation_tree() == {"spine0": None, "leaf0": "spine0", "leaf1": "spine0"}
    assert t.subtree_workers("spine1") == []
    assert "spine1  (not in the tree: forwards only)" in t.summary()
    # No ECMP: ties go to the lowest switch id.
    assert t.route("w0", "w2") == ["leaf0", "spine0", "leaf1"]


def test_leaf_spine_single_leaf_roots_at_leaf() -> None:
    t = leaf_spine(1, 3)
    assert t.aggregation_tree() == {"leaf0": None}
    assert t.route("w0", "host0") == ["leaf0", "spine0"]


def test_leaf_spine_unshaped_defaults_and_errors() -> None:
    t = leaf_spine(2, 2)
    assert all(not lk.params.shaped for lk in t.links)
    assert t.oversubscription("leaf0") == 1.0  # unshaped both sides
    with pytest.raises(TopologyError, match="needs shaped links; set leaf_bandwidth_gbps"):
        leaf_spine(2, 2, oversubscription=2)
    with pytest.raises(TopologyError, match="oversubscription must be a number > 0"):
        leaf_spine(2, 2, oversubscription=0, leaf_bandwidth_gbps=1)
    with pytest.raises(TopologyError, match="leaves must be an integer >= 1"):
        leaf_spine(0, 2)


def test_oversubscription_with_unshaped_sides() -> None:
    doc = (
        node("w0", "worker")
        + node("w1", "worker")
        + node("leaf", "switch")
        + node("spine", "switch")
        + link("w0", "leaf", bandwidth_gbps=10)
        + link("w1", "leaf", bandwidth_gbps=10)
        + link("leaf", "spine", "scaleout")
    )
    assert loads(doc).oversubscription("leaf") == 0.0  # unshaped uplink never converges
    doc2 = doc.replace('class = "scaleout"', 'class = "scaleout"\nbandwidth_gbps = 10')
    assert loads(doc2).oversubscription("leaf") == 2.0
    doc3 = doc2.replace("bandwidth_gbps = 10\n", "", 1)  # one down-link unshaped
    assert math.isinf(loads(doc3).oversubscription("leaf"))
    with pytest.raises(TopologyError, match="not a switch"):
        loads(doc).oversubscription("w0")


def test_ids_follow_kind_then_file_order() -> None:
    doc = (
        node("sw", "switch")
        + node("h", "host")
        + node("b", "worker")
        + node("a", "worker")
        + link("b", "sw")
        + link("h", "sw", "frontend")
        + link("a", "sw")
    )
    t = loads(doc)
    assert [(n.name, n.id) for n in t.nodes] == [("b", 0), ("a", 1), ("h", 2), ("sw", 3)]
    assert [w.name for w in t.workers] == ["b", "a"]
    assert t.rank("a") == 1
    with pytest.raises(TopologyError, match="'h' is a host; only workers have a rank"):
        t.rank("h")
    with pytest.raises(TopologyError, match="no node has id 9"):
        t.by_id(9)
    with pytest.raises(TopologyError, match="'zz' is not in the topology"):
        t.node("zz")
    with pytest.raises(TopologyError, match="is a switch; switch_of takes"):
        t.switch_of("sw")


def test_defaults_and_per_link_overrides() -> None:
    doc = "[defaults.scaleup]\nlatency_us = 2\nbandwidth_gbps = 50\n" + BASE.replace(
        'class = "scaleup"\n', 'class = "scaleup"\nloss = 0.5\nmtu = 4096\n', 1
    )
    t = loads(doc)
    p0, p1 = t.links[0].params, t.links[1].params
    assert p0 == LinkParams(2.0, 50.0, 0.5, 4096)
    assert p1 == LinkParams(2.0, 50.0, 0.0, 256 * 1024)
    assert loads(t.to_toml()) == t


def test_addresses_ipc_and_tcp() -> None:
    t = star(2)
    assert t.endpoint_address("w1", "/tmp/run") == "ipc:///tmp/run/w1.sock"
    assert t.bind_address("w1", "/tmp/run") == "ipc:///tmp/run/w1.sock"
    with pytest.raises(TopologyError, match="over the 107-byte Unix limit"):
        t.endpoint_address("w1", "/tmp/" + "x" * 120)
    doc = (
        '[fabric]\ntransport = "tcp"\nbase_port = 30000\n'
        '[fabric.host_addresses]\nw1 = "node-b.cluster"\nsw0 = "fd00::1"\n' + BASE
    )
    t2 = loads(doc)
    assert t2.endpoint_address("w0", "/unused") == "tcp://127.0.0.1:30000"
    assert t2.endpoint_address("w1", "/unused") == "tcp://node-b.cluster:30001"
    assert t2.endpoint_address("sw0", "/unused") == "tcp://[fd00::1]:30002"
    assert t2.bind_address("w0", "/unused") == "tcp://127.0.0.1:30000"
    assert t2.bind_address("w1", "/unused") == "tcp://*:30001"
    assert t2.host_address("w1") == "node-b.cluster"
    assert loads(t2.to_toml()) == t2


def test_link_params_value_object() -> None:
    p = LinkParams(latency_us=1, bandwidth_gbps=8, loss=0, mtu=1500)
    assert p.latency_us == 1.0 and isinstance(p.latency_us, float)
    assert p.serialization_us(1000) == pytest.approx(1.0)  # 8000 bits at 8 Gbit/s
    assert LinkParams().serialization_us(10**9) == 0.0
    assert p.replace(loss=0.1).loss == 0.1
    with pytest.raises(TopologyError, match="loss"):
        LinkParams(loss=1.0)
    with pytest.raises(TopologyError, match="mtu"):
        LinkParams(mtu=100)


def test_topology_equality_ignores_source() -> None:
    a = loads(BASE, "a.toml")
    b = loads(BASE, "b.toml")
    assert a == b and hash(a) == hash(b)
    assert a != star(2, hosts=0)  # different names
    assert a.source == "a.toml"
    assert Topology.from_dict(a.to_dict()) == a


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
# 0 (unshaped) or inside the bounds the validator accepts
bandwidth = st.just(0.0) | st.floats(min_value=1e-6, max_value=1e6)


@settings(max_examples=40, deadline=None)
@given(
    workers=st.integers(1, 24),
    hosts=st.integers(0, 3),
    cls=st.sampled_from(["scaleup", "scaleout", "frontend"]),
    latency=finite,
    bw=bandwidth,
    loss=st.floats(min_value=0, max_value=0.999),
    mtu=st.integers(256, 16 * 1024 * 1024),
    transport=st.sampled_from(["ipc", "tcp"]),
)
def test_round_trip_star(
    workers: int,
    hosts: int,
    cls: str,
    latency: float,
    bw: float,
    loss: float,
    mtu: int,
    transport: str,
) -> None:
    t = star(
        workers,
        hosts,
        cls,
        transport=transport,
        latency_us=latency,
        bandwidth_gbps=bw,
        loss=loss,
        mtu=mtu,
    )
    assert loads(t.to_toml()) == t


@settings(max_examples=40, deadline=None)
@given(
    leaves=st.integers(1, 5),
    per_leaf=st.integers(1, 5),
    spines=st.integers(1, 3),
    hosts=st.integers(0, 2),
    ratio=st.sampled_from([1.0, 2.0, 4.0]) | st.floats(0.1, 16),
    bw=st.floats(min_value=0.001, max_value=1e4),
    spine_latency=finite,
    host_bw=st.none() | bandwidth,
)
def test_round_trip_leaf_spine(
    leaves: int,
    per_leaf: int,
    spines: int,
    hosts: int,
    ratio: float,
    bw: float,
    spine_latency: float,
    host_bw: float | None,
) -> None:
    t = leaf_spine(
        leaves,
        per_leaf,
        spines,
        ratio,
        bw,
        hosts=hosts,
        spine_latency_us=spine_latency,
        host_bandwidth_gbps=host_bw,
    )
    assert loads(t.to_toml()) == t
    assert t.oversubscription("leaf0") == pytest.approx(ratio)
    assert len(t.workers) == leaves * per_leaf


def test_to_toml_escapes_strings() -> None:
    t = loads('[fabric]\nname = "a \\"q\\" \\\\ \\u0001 é"\n' + BASE)
    assert loads(t.to_toml()) == t
    assert t.name == 'a "q" \\ \x01 é'


# ---------------------------------------------------------------------------
# errors: each names the file, the item and the fix
# ---------------------------------------------------------------------------

ERRORS = [
    # (file text, substrings the one-line message must contain)
    ("[[node]\nname = 1", ["t.toml: TOML syntax error", "line 1"]),
    (
        BASE + link("w9", "sw0"),
        ["link 3:", "node 'w9' is not declared", "declare it in a [[node]] table"],
    ),
    (BASE + node("w1", "worker"), ["node 'w1'", "declared twice"]),
    (BASE + node("g0", "gpu"), ["node 'g0'", "unknown kind 'gpu'", "worker, host, switch"]),
    (
        BASE + link("w0", "sw0", "nvlink").replace('"w0"', '"w2"') + node("w2", "worker"),
        ["link 3 (w2 -- sw0)", "unknown class 'nvlink'", "scaleup, scaleout, frontend"],
    ),
    (BASE + node("w3", "worker"), ["node 'w3'", "not connected to any switch"]),
    (BASE + node("h0", "host"), ["node 'h0'", "host is not connected to any switch"]),
    (
        BASE + node("sw1", "switch") + link("w0", "sw1") + link("sw0", "sw1", "scaleout"),
        ["node 'w0'", "linked to 2 switches (sw0, sw1)", "exactly one switch"],
    ),
    (BASE + link("w0", "w1"), ["link 3 (w0 -- w1)", "directly to worker 'w1'"]),
    (BASE + node("h", "host") + link("h", "w0"), ["link 3 (h -- w0)", "needs a switch"]),
    (BASE + link("sw0", "sw0", "scaleout"), ["link 3 (sw0 -- sw0)", "itself"]),
    (BASE + link("sw0", "w0"), ["link 3 (sw0 -- w0)", "duplicates link 1"]),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nlatency_us = -1', 1),
        ["link 1 (w0 -- sw0)", "latency_us must be >= 0", "-1"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nloss = 1.0', 1),
        ["link 1 (w0 -- sw0)", "0 <= loss < 1"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nmtu = 100', 1),
        ["link 1", "mtu must be in 256..16777216"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nmtu = 99999999', 1),
        ["link 1", "mtu must be in"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nmtu = 1500.0', 1),
        ["link 1", "mtu must be an integer"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nbandwidth_gbps = "fast"', 1),
        ["link 1", "bandwidth_gbps must be a number", "'fast'"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nlatency_us = nan', 1),
        ["link 1", "latency_us must be finite"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nlatency_us = true', 1),
        ["link 1", "latency_us must be a number"],
    ),
    # absurd values that would only fail later are refused with the valid range
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nbandwidth_gbps = 1e-300', 1),
        ["link 1 (w0 -- sw0)", "bandwidth_gbps", "between 1e-06 and 1e+06 Gbit/s", "1e-300"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nbandwidth_gbps = 1e300', 1),
        ["link 1 (w0 -- sw0)", "between 1e-06 and 1e+06 Gbit/s"],
    ),
    (
        "[defaults.scaleup]\nlatency_us = 1e308\n" + BASE,
        ["[defaults.scaleup]", "latency_us must be in 0..10000000 microseconds", "10 s"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nlatency_us = 1' + "0" * 40, 1),
        ["link 1", "latency_us must be finite", "41 digits"],
    ),
    (
        BASE + node("w" * 300, "worker"),
        ["node 4", "300 characters long", "at most 64"],
    ),
    (
        BASE.replace('"w0"', '"' + "a" * 65 + '"'),
        ["node 1", "65 characters long"],
    ),
    ('[fabric]\nname = "' + "f" * 300 + '"\n' + BASE, ["[fabric]", "300 characters", "at most 64"]),
    (
        '[fabric]\ntransport = "tcp"\n[fabric.host_addresses]\nw0 = "' + "h" * 300 + '"\n' + BASE,
        ["[fabric.host_addresses] 'w0'", "300 characters long", "at most 253"],
    ),
    (
        BASE.replace('class = "scaleup"', 'class = "scaleup"\nlatncy_us = 1', 1),
        ["link 1", "unknown key 'latncy_us'", "did you mean 'latency_us'", "valid keys: a, b"],
    ),
    (
        BASE + node("sw1", "switch") + node("w2", "worker") + link("w2", "sw1"),
        ["switch 'sw1'", "not connected to switch 'sw0'"],
    ),
    (node("sw0", "switch") + node("h", "host") + link("h", "sw0"), ["no worker declared"]),
    ("", ["no worker declared"]),
    (BASE + '\n[[node]]\nname = "w 5"\nkind = "worker"\n', ["node 4", "'w 5'", "letters"]),
    (BASE + '\n[[node]]\nkind = "worker"\n', ["node 4", "missing key 'name'"]),
    (BASE + '\n[[link]]\na = "w0"\nb = "sw0"\n', ["link 3", "missing key 'class'"]),
    ('[node]\nname = "w0"\n', ["'node'", "[[node]]"]),
    ("[nodes]\n" + BASE, ["top level", "unknown key 'nodes'", "did you mean 'node'"]),
    ('[fabric]\ntransprt = "tcp"\n' + BASE, ["[fabric]", "unknown key 'transprt'"]),
    ('[fabric]\ntransport = "rdma"\n' + BASE, ["[fabric]", "'rdma'", "ipc, tcp"]),
    ("[fabric]\nbase_port = 0\n" + BASE, ["[fabric]", "base_port must be an integer 1..65535"]),
    ('[fabric]\ntransport = "tcp"\nbase_port = 65534\n' + BASE, ["[fabric]", "exceeds port"]),
    ("[defaults.scaleup]\nloss = 2\n" + BASE, ["[defaults.scaleup]", "loss"]),
    ("[defaults.scaleup]\nlatency = 2\n" + BASE, ["[defaults.scaleup]", "unknown key 'latency'"]),
    ("[defaults.nvlink]\nloss = 0\n" + BASE, ["[defaults]", "unknown key 'nvlink'"]),
    (
        '[fabric.host_addresses]\nw7 = "10.0.0.7"\n' + BASE,
        ["[fabric.host_addresses] 'w7'", "names no declared node"],
    ),
    (
        '[fabric.host_addresses]\nw0 = "10.0.0.7"\n' + BASE,
        ["transport 'ipc' works on one host only", "'w0'", 'transport = "tcp"'],
    ),
    (
        '[fabric]\ntransport = "tcp"\n[fabric.host_addresses]\nw0 = "a b"\n' + BASE,
        ["[fabric.host_addresses] 'w0'", "hostname or IP"],
    ),
]


@pytest.mark.parametrize(("text", "expected"), ERRORS)
def test_errors_name_the_item(text: str, expected: list[str]) -> None:
    with pytest.raises(TopologyError) as info:
        loads(text, "t.toml")
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith("t.toml: "), msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert isinstance(info.value, ValueError)


def test_base_file_is_valid() -> None:
    assert len(loads(BASE).workers) == 2


def test_bounds_are_inclusive() -> None:
    edge = 'class = "scaleup"\nbandwidth_gbps = 1e-6\nlatency_us = 1e7'
    t = loads(BASE.replace('class = "scaleup"', edge, 1))
    assert t.links[0].params.bandwidth_gbps == 1e-6
    assert t.links[0].params.latency_us == 1e7
    assert loads(BASE.replace('"w0"', '"' + "a" * 64 + '"')).workers[0].name == "a" * 64
    assert LinkParams(bandwidth_gbps=1e6).shaped
    with pytest.raises(TopologyError, match="between"):
        LinkParams(bandwidth_gbps=1e-7)
    with pytest.raises(TopologyError, match="leaf_bandwidth_gbps"):
        leaf_spine(2, 2, leaf_bandwidth_gbps=1e7)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read the file"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(TopologyError, match="not UTF-8"):
        load(bad)


# ---------------------------------------------------------------------------
# examples and CLI
# ---------------------------------------------------------------------------


def test_examples_match_builders() -> None:
    assert load(EXAMPLES / "star4.toml") == star(4)
    os2 = load(EXAMPLES / "leaf_spine_2x2_os2.toml")
    assert os2 == leaf_spine(2, 2, oversubscription=2, leaf_bandwidth_gbps=8)
    assert os2.base_port == DEFAULT_BASE_PORT


@pytest.mark.parametrize("name", ["star4.toml", "leaf_spine_2x2_os2.toml"])
def test_check_main_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_main([str(EXAMPLES / name)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "switch tree" in out and "4 workers" in out


def test_check_main_output_leaf_spine(capsys: pytest.CaptureFixture[str]) -> None:
    check_main([str(EXAMPLES / "leaf_spine_2x2_os2.toml")])
    out = capsys.readouterr().out
    assert "links: 7 = 4 scaleup, 3 scaleout" in out
    assert "spine0  [root]" in out
    assert "leaf0  workers: w0 w1  oversubscription 2:1 (down 16 Gbps / up 8 Gbps)" in out


def test_check_main_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(BASE + link("w9", "sw0"))
    assert check_main([str(f)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip()
    assert "\n" not in err
    assert str(f) in err and "'w9' is not declared" in err
    assert check_main([]) == 2  # usage error
    assert check_main(["--help"]) == 0


def test_gen_main_star_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert gen_main(["--workers", "3", "--bandwidth-gbps", "25", "--latency-us", "1.5"]) == 0
    t = loads(capsys.readouterr().out)
    assert t == star(3, latency_us=1.5, bandwidth_gbps=25.0)


def test_gen_main_leaf_spine_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ls.toml"
    argv = ["--leaves", "2", "--per-leaf", "2", "--oversubscription", "2"]
    assert gen_main([*argv, "--bandwidth-gbps", "8", "-o", str(out)]) == 0
    assert load(out) == load(EXAMPLES / "leaf_spine_2x2_os2.toml")
    assert check_main([str(out)]) == 0
    capsys.readouterr()
    # A ratio on unshaped links is refused with a hint.
    assert gen_main(argv) == 2
    assert "leaf_bandwidth_gbps" in capsys.readouterr().err
    assert gen_main(["--leaves", "2"]) == 2
    assert "--per-leaf" in capsys.readouterr().err
    assert gen_main(["--workers", "2", "--leaves", "2"]) == 2  # mutually exclusive
    assert gen_main(["--workers", "2", "-o", str(tmp_path / "no" / "dir.toml")]) == 2


def test_cluster_has_three_networks_with_their_figures() -> None:
    """4 domains of 8 GPUs, 2 per leaf, 2:1: GPUs on scale-up switches, each domain's
    uplink its GPUs' NICs together, the leaves' uplinks at half their down rate,
    host0 on the front-end."""
    from fabric.core.topology import CLUSTER_DEFAULTS, cluster

    t = cluster(4, 8, domains_per_leaf=2, oversubscription=2)
    assert len(t.workers) == 32 and {s.name for s in t.switches} == {
        "spine0", "leaf0", "leaf1", "su0", "su1", "su2", "su3"}
    assert t.switch_of("w9") == "su1"
    up = t.link_between("w0", "su0").params
    assert (up.bandwidth_gbps, up.mtu) == (CLUSTER_DEFAULTS["scaleup"]["bandwidth_gbps"], 4096)
    assert t.link_between("su1", "leaf0").params.bandwidth_gbps == 8 * 400
    assert t.link_between("leaf1", "spine0").params.bandwidth_gbps == 2 * 8 * 400 / 2
    assert t.link_between("host0", "spine0").cls == "frontend"
    assert t.route("w0", "w9") == ["su0", "leaf0", "su1"]
    assert loads(t.to_toml()) == t
    faster = cluster(2, 2, scaleout={"bandwidth_gbps": 800.0})
    assert faster.link_between("su0", "leaf0").params.bandwidth_gbps == 1600
    for kw, words in [({"domains_per_leaf": 3}, "do not fill leaves of 3"),
                      ({"oversubscription": 0.5}, "oversubscription must be"),
                      ({"scaleup": {"colour": 1.0}}, "colour")]:
        with pytest.raises(TopologyError, match=words):
            cluster(4, 2, **kw)


def test_link_level_retry_is_a_link_parameter() -> None:
    """``llr``: false by default, per class or per link, round-trips, and a
    cluster's scale-up links have it (UALink and NVLink retry at the link)."""
    t = star(2, loss=0.01, llr=True)
    assert all(lk.params.llr for lk in t.links)
    assert loads(t.to_toml()) == t
    assert not LinkParams().llr
    c = cluster(2, 2)
    assert {lk.cls: lk.params.llr for lk in c.links} == {
        "scaleup": True, "scaleout": False, "frontend": False}
    with pytest.raises(TopologyError, match="llr must be true or false"):
        loads(t.to_toml().replace("llr = true", "llr = 1"))


def test_gen_main_turns_link_level_retry_on_and_off(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert gen_main(["--leaves", "2", "--per-leaf", "2", "--llr", "--loss", "0.01"]) == 0
    ls = loads(capsys.readouterr().out)
    assert all(lk.params.llr for lk in ls.links if lk.cls != "frontend")
    assert gen_main(["--cluster", "2", "--gpus-per-domain", "2", "--no-llr"]) == 0
    assert not any(lk.params.llr for lk in loads(capsys.readouterr().out).links)


def test_credit_flow_control_is_a_link_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    """``credit``: false by default, per class or per link, round-trips; a cluster's
    scale-up links have it unless ``--no-credit``; ``--credit`` puts it on every
    link ([congestion] credit)."""
    assert not LinkParams().credit
    c = cluster(2, 2)
    assert {lk.cls: lk.params.credit for lk in c.links} == {
        "scaleup": True, "scaleout": False, "frontend": False}
    assert loads(c.to_toml()) == c
    with pytest.raises(TopologyError, match="credit must be true or false"):
        loads(c.to_toml().replace("credit = true", "credit = \"yes\""))
    assert gen_main(["--cluster", "2", "--gpus-per-domain", "2", "--no-credit"]) == 0
    assert not any(lk.params.credit for lk in loads(capsys.readouterr().out).links)
    assert gen_main(["--workers", "2", "--bandwidth-gbps", "10", "--credit"]) == 0
    assert loads(capsys.readouterr().out).congestion.credit
