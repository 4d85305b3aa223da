"""Placed runs (`semfab run`): the pure placement rules, then real processes
started as mpirun starts them, on loopback and across three network
namespaces joined by a bridge (addresses from 198.18.0.0/15, RFC 2544)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.core.placement import (
    Member,
    PlacementError,
    assign,
    best_offset,
    clock_sample,
    launcher_rank,
)
from fabric.core.topology import loads, star
from fabric.emulation.transport import free_tcp_port
from tests.processes import kill_groups

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "fabric_tasks.py"


# ------------------------------------------------------------------ pure rules


def test_launcher_rank_from_each_launchers_variables() -> None:
    assert launcher_rank({}) is None
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "5"}) == (2, 5)
    assert launcher_rank({"PMI_RANK": "0", "PMI_SIZE": "3"}) == (0, 3)
    assert launcher_rank({"SLURM_PROCID": "4", "SLURM_NTASKS": "6"}) == (4, 6)
    # Open MPI's own variables win over a stale torchrun RANK in the environment
    assert launcher_rank({"RANK": "9", "WORLD_SIZE": "10", "OMPI_COMM_WORLD_RANK": "1",
                          "OMPI_COMM_WORLD_SIZE": "2"}) == (1, 2)
    with pytest.raises(PlacementError, match="not in 0"):
        launcher_rank({"SLURM_PROCID": "6", "SLURM_NTASKS": "6"})
    with pytest.raises(PlacementError, match="not integers"):
        launcher_rank({"PMI_RANK": "x", "PMI_SIZE": "2"})


def placed_toml(addrs: dict[str, str], base_port: int = 26100) -> str:
    """A 2-worker star over tcp whose nodes are placed on the given hosts."""
    text = star(2, transport="tcp", base_port=base_port).to_toml()
    return text + "\n[fabric.host_addresses]\n" + "".join(
        f'{name} = "{addr}"\n' for name, addr in addrs.items())


PLACED = {"sw0": "198.18.0.1", "host0": "198.18.0.1", "w0": "198.18.0.2", "w1": "198.18.0.3"}


def _placed_topo():
    return loads(placed_toml(PLACED))


def test_assign_follows_the_host_addresses() -> None:
    topo = _placed_topo()
    a, b, c = frozenset({"198.18.0.1"}), frozenset({"198.18.0.2"}), frozenset({"198.18.0.3"})
    # ranks in any order across hosts: switches first, then hosts, then workers
    got = assign(topo, [Member(0, "c", c), Member(1, "a", a), Member(2, "b", b),
                        Member(3, "a", a)])
    assert got == {0: "w1", 1: "sw0", 2: "w0", 3: "host0"}
    # an explicit --name is honoured, the rest fill in around it
    got = assign(topo, [Member(0, "a", a, "host0"), Member(1, "a", a), Member(2, "b", b),
                        Member(3, "c", c)])
    assert got == {0: "host0", 1: "sw0", 2: "w0", 3: "w1"}


def test_assign_says_what_to_change() -> None:
    topo = _placed_topo()
    a, b = frozenset({"198.18.0.1"}), frozenset({"198.18.0.2"})
    with pytest.raises(PlacementError, match="start exactly 4"):
        assign(topo, [Member(0, "a", a)])
    with pytest.raises(PlacementError, match="no node is left"):
        assign(topo, [Member(0, "a", a), Member(1, "a", a), Member(2, "a", a),
                      Member(3, "b", b)])
    with pytest.raises(PlacementError, match="is not on that host"):
        assign(topo, [Member(0, "b", b, "sw0"), Member(1, "a", a), Member(2, "a", a),
                      Member(3, "b", b)])
    with pytest.raises(PlacementError, match="not in the topology"):
        assign(topo, [Member(0, "a", a, "nope"), Member(1, "a", a), Member(2, "a", a),
                      Member(3, "b", b)])


def test_clock_offset_and_its_bound() -> None:
    # the peer's clock runs 5 ms ahead; 2 ms out, 4 ms back, 1 ms in the peer
    t0 = 100.0
    t1 = t0 + 0.002 + 0.005
    t2 = t1 + 0.001
    t3 = t2 - 0.005 + 0.004
    s = clock_sample(t0, t1, t2, t3)
    assert abs(s.rtt_s - 0.006) < 1e-9 and abs(s.error_s - 0.003) < 1e-9
    assert abs(s.offset_s - 0.005) <= s.error_s  # the truth is within the bound
    assert abs(s.offset_s - 0.004) < 1e-9  # asymmetric paths bias it by half the difference
    tight = clock_sample(t0, t0 + 0.0051, t0 + 0.0051, t0 + 0.0002)
    assert best_offset([s, tight]) is tight


# ------------------------------------------------------------------ processes


def _mpirun() -> str | None:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


_kill = kill_groups


@pytest.mark.timeout(120)
def test_mpirun_places_a_fabric_on_loopback(tmp_path: Path) -> None:
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun: pip install 'semfab[peers]' puts Open MPI's beside Python")
    base = free_tcp_port()
    topo = tmp_path / "star2.toml"
    topo.write_text(star(2, transport="tcp", base_port=base + 1).to_toml())
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONPATH": str(ROOT)}
    cmd = [mpirun, "-np", "4", "--oversubscribe", "--bind-to", "none", sys.executable, "-m",
           "fabric", "run", "--topology", str(topo), "--workload",
           f"{TASKS}:placed_collectives", "--rendezvous", f"127.0.0.1:{base}",
           "--timeout", "20", "--json", str(tmp_path / "report.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp_path, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        _kill([proc])
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["node"] for p in report["processes"]] == ["sw0", "host0", "w0", "w1"]
    for res in report["results"].values():
        assert res["wrong"] == {k: 0 for k in res["wrong"]}, res
        assert not res["fallbacks"]  # one host: the memory plane is there
    assert report["switches"]["sw0"]["reduce_frames"] > 0


# ------------------------------------------------------------------ namespaces


class Namespaces:
    """Three "hosts" (network namespaces) on one bridge, in a fourth namespace;
    every address is from 198.18.0.0/15 and no traffic leaves them."""

    def __init__(self, tag: str, n: int = 3) -> None:
        self.tag = tag
        self.bridge_ns = f"sfb{tag}"
        self.hosts = [f"sfh{tag}{i}" for i in range(n)]
        self.addrs = [f"198.18.0.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)

    def create(self) -> None:
        self._ip("netns", "add", self.bridge_ns)
        self._ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        self._ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addrs, strict=True)):
            self._ip("netns", "add", ns)
            self._ip("link", "set", "lo", "up", ns=ns)
            self._ip("link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", ns=ns)
            self._ip("link", "set", f"v{i}", "netns", self.bridge_ns, ns=ns)
            self._ip("link", "set", f"v{i}", "master", "br0", ns=self.bridge_ns)
            self._ip("link", "set", f"v{i}", "up", ns=self.bridge_ns)
            self._ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            self._ip("link", "set", "eth0", "up", ns=ns)

    def start(self, host: int, cmd: list[str], env: dict[str, str],
              cwd: Path) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *cmd], env=env, cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def cut(self, host: int) -> None:
        self._ip("link", "set", "eth0", "down", ns=self.hosts[host])

    def delete(self) -> None:
        _kill(self.procs)
        for ns in [*self.hosts, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    spaces = Namespaces(f"{os.getpid() % 10000}")
    try:
        try:
            spaces.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"the kernel refused namespaces: {exc.stderr.decode().strip()}")
        yield spaces
    finally:
        spaces.delete()  # processes first, then every namespace, even on failure
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert spaces.bridge_ns not in leftover


def _placed_run(netns: Namespaces, tmp_path: Path, func: str, args: str = "[]",
                timeout: float = 20) -> list[subprocess.Popen[bytes]]:
    path = tmp_path / "placed.toml"
    path.write_text(placed_toml({"sw0": netns.addrs[0], "host0": netns.addrs[0],
                                 "w0": netns.addrs[1], "w1": netns.addrs[2]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fabric", "run", "--topology", str(path), "--workload",
           f"{TASKS}:{func}", "--args", args, "--rendezvous", f"{netns.addrs[0]}:26099",
           "--timeout", str(timeout), "--join-timeout", "40",
           "--json", str(tmp_path / "report.json")]
    # as mpirun --host A:2,B:1,C:1 would: ranks 0-1 on A, 2 on B, 3 on C
    return [netns.start(host, cmd, {**env, "OMPI_COMM_WORLD_RANK": str(rank),
                                    "OMPI_COMM_WORLD_SIZE": "4"}, tmp_path)
            for rank, host in enumerate((0, 0, 1, 2))]


@pytest.mark.timeout(150)
def test_exact_across_three_namespaces_and_same_counts_as_one_host(netns: Namespaces,
                                                                  tmp_path: Path) -> None:
    import json

    procs = _placed_run(netns, tmp_path, "placed_collectives")
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(outs)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(p["node"], p["address"]) for p in report["processes"]] == [
        ("sw0", "198.18.0.1"), ("host0", "198.18.0.1"), ("w0", "198.18.0.2"),
        ("w1", "198.18.0.3")]
    for res in report["results"].values():
        assert res["wrong"] == {k: 0 for k in res["wrong"]}, res
        # the memory plane cannot span hosts: a note, and the frame plane did it
        assert any("another host" in note for note in res["fallbacks"]), res
    for p in report["processes"]:
        # one kernel's clocks here: the true offsets are 0, so each estimate is within
        # its own bound (half the round trip; 1 ms slack for scheduling between stamps)
        assert p["error_s"] >= 0 and abs(p["offset_s"]) <= p["error_s"] + 1e-3
        assert abs(p["mono_offset_s"]) <= p["mono_error_s"] + 1e-3
    # the same workload and topology shape on one host through the local launcher:
    # the frame plane's counters (taken before the memory-plane part) are the same
    from fabric.emulation.launcher import launch

    with launch(topology=star(2), timeout_s=20, run_dir=tmp_path / "local") as fab:
        local = fab.run(placed_collectives_task)
    assert all(r["wrong"] == {k: 0 for k in r["wrong"]} for r in local)
    assert not any(r["fallbacks"] for r in local)
    retx = sum(r["retransmits"] for r in [*report["results"].values(), *local])
    placed, alone = report["results"]["w0"]["counters"], local[0]["counters"]
    if retx == 0:  # a retransmission (a slow machine) would add frames on one side
        for key in ("reduce_frames", "results_sent", "forwarded"):
            assert placed[key] == alone[key], (key, placed, alone)
        # data frames alike; control frames may differ by a retried hello (tcp
        # connects asynchronously) and carry random keys whose encodings vary
        data = [c["frames_in"] - c["ctrl_frames"] for c in (placed, alone)]
        assert data[0] == data[1], (placed, alone)
        assert abs(placed["bytes_in"] - alone["bytes_in"]) <= 0.01 * alone["bytes_in"]


def placed_collectives_task(ep):
    from tests.fabric_tasks import placed_collectives

    return placed_collectives(ep)


@pytest.mark.timeout(150)
def test_a_cut_link_ends_the_run_on_every_host(netns: Namespaces, tmp_path: Path) -> None:
    procs = _placed_run(netns, tmp_path, "placed_loop", "[600]", timeout=4)
    time.sleep(8)  # up and running its loop of allreduces
    assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
    t_cut = time.monotonic()
    netns.cut(2)  # w1's host loses its link
    outs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
    took = time.monotonic() - t_cut
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert took < 45, took
    # rank 0 names what went missing
    assert "w1" in outs[0] or "198.18.0.3" in outs[0], outs[0]
    assert "error" in outs[3]  # and the cut-off host knows why it stopped


@pytest.mark.timeout(240)
def test_a_token_stream_across_three_namespaces(netns: Namespaces, tmp_path: Path) -> None:
    """The token chain placed on three hosts: the client and the switch on the
    first, the generator on the second, the token host and its HTTP server on
    the third. Every token arrives and reads the same as the generated text,
    and each layer's time, from stamps taken on three hosts' clocks corrected
    to rank 0's, is a sane positive figure."""
    import json

    from fabric.core.topology import star as make_star

    text = make_star(1, hosts=1, transport="tcp", base_port=26300).to_toml()
    placed = {"sw0": netns.addrs[0], "w0": netns.addrs[1], "host0": netns.addrs[2]}
    path = tmp_path / "tokens.toml"
    path.write_text(text + "\n[fabric.host_addresses]\n" + "".join(
        f'{n} = "{a}"\n' for n, a in placed.items()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out_json = tmp_path / "tokens.json"
    cmd = [sys.executable, "-m", "fabric", "run", "--topology", str(path), "--bench-tokens",
           f"--concurrency 1,4 --num-prompts 8 --tokens 16 --json {out_json}",
           "--serve-port", "26380", "--rendezvous", f"{netns.addrs[0]}:26299",
           "--timeout", "20", "--join-timeout", "40", "--json", str(tmp_path / "report.json")]
    procs = [netns.start(host, cmd, {**env, "OMPI_COMM_WORLD_RANK": str(rank),
                                     "OMPI_COMM_WORLD_SIZE": "3"}, tmp_path)
             for rank, host in enumerate((0, 1, 2))]
    outs = [p.communicate(timeout=200)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outs)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(p["node"], p["address"]) for p in report["processes"]] == [
        ("sw0", "198.18.0.1"), ("w0", "198.18.0.2"), ("host0", "198.18.0.3")]
    for p in report["processes"]:
        assert abs(p["mono_offset_s"]) <= p["mono_error_s"] + 1e-3  # one kernel: 0
    rows = json.loads(out_json.read_text())["results"]
    assert len(rows) == 4  # direct+immediate and direct+batched at c=1 and c=4
    # transport (w0 -> host0) and presentation (host0 -> the client, on sw0's host)
    # subtract stamps of two hosts' clocks: each correction is known to within its
    # error bound, which may exceed a layer of a tenth of a millisecond
    err_ms = 2e3 * max(p["mono_error_s"] for p in report["processes"])
    for row in rows:
        assert row["lost_tokens"] == 0 and row["text_mismatches"] == 0, row
        assert row["tokens_generated"] > 0
        for layer in ("generation", "transport", "interpretation", "presentation"):
            p50 = row["layers_ms"][layer]["p50"]
            least = -err_ms if layer in ("transport", "presentation") else 0.0
            assert least < p50 < 1000, (layer, p50, err_ms)
    assert "semfab run: star1" in outs[0] and "Client metrics" in outs[0]


@pytest.mark.timeout(90)
def test_a_node_that_cannot_start_ends_the_run_at_once(tmp_path: Path) -> None:
    # the switch's port is taken: its process says so, and every process ends
    # quickly with rank 0 naming it (not after the join timeout)
    import socket

    base = free_tcp_port()
    topo = star(2, transport="tcp", base_port=base + 1)
    (tmp_path / "t.toml").write_text(topo.to_toml())
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", base + 1 + topo.node("sw0").id))
    blocker.listen()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fabric", "run", "--topology", str(tmp_path / "t.toml"),
           "--workload", f"{TASKS}:placed_collectives", "--rendezvous", f"127.0.0.1:{base}",
           "--timeout", "30", "--join-timeout", "60"]
    procs = [subprocess.Popen(cmd, env={**env, "OMPI_COMM_WORLD_RANK": str(r),
                                        "OMPI_COMM_WORLD_SIZE": "4"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                              start_new_session=True) for r in range(4)]
    try:
        t0 = time.monotonic()
        outs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
        # well before the others' own 30 s wait for the switch: told to stop
        assert time.monotonic() - t0 < 20
    finally:
        _kill(procs)
        blocker.close()
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "sw0" in outs[0] and "could not start" in outs[0] and "in use" in outs[0], outs[0]
    for out in outs[1:]:  # each of the others says why it stopped
        assert "stopped before this node started" in out and "sw0" in out, out
