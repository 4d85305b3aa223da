"""A torch process's attachment to the fabric: its endpoint, its communication
thread, and (on rank 0 under torchrun) the switch and host processes.

Two ways in:

* **torchrun** (``torchrun --standalone --nproc-per-node N train.py``, nothing
  else started): the first ``init_process_group("semfab")`` on rank 0 starts
  the switch and host processes of a star of N workers (or of the topology
  file ``SEMFAB_TOPOLOGY``) and publishes where they are in torch's store;
  every rank then attaches its own endpoint as worker ``rank``. When torchrun
  placed the ranks on several hosts (``--nnodes``), the star runs over tcp,
  its switch and host on rank 0's host. The fabric
  ends with rank 0: at ``destroy_process_group()``, at exit, on SIGTERM, and
  (its processes watch their parent) when rank 0 is killed.
* **semfab launch** (``semfab launch --workers N --run train.py:main``): the
  workers already hold an endpoint; ``fabric.torch.init(ep)`` wraps it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
from typing import Any

from fabric.core.topology import Topology, TopologyError, load, loads, star
from fabric.emulation.endpoint import Endpoint
from fabric.emulation.launcher import Fabric
from fabric.errors import SemfabError, UsageError
from fabric.torch.comm import CommThread

__all__ = ["Runtime", "current", "from_endpoint", "from_store"]

log = logging.getLogger("semfab.torch")

#: Where rank 0 publishes the fabric in torch's store.
STORE_KEY = "semfab/fabric"


class _ServiceFabric(Fabric):
    """A fabric whose workers are not started by it: the torch processes attach
    as the workers, so only switches and hosts are spawned."""

    def _spawn(self, name: str, kind: str, cmd: list[str]) -> None:
        if kind != "worker":
            super()._spawn(name, kind, cmd)


class Runtime:
    """This process's endpoint, communication thread and (rank 0) fabric."""

    def __init__(self, rank: int, world: int, comm: CommThread, ep: Endpoint,
                 fabric: Fabric | None, owns_ep: bool) -> None:
        self.rank = rank
        self.world = world
        self.comm = comm
        self.ep = ep
        self.fabric = fabric
        self.owns_ep = owns_ep
        self.closed = False
        self.world_group_made = False

    @property
    def memory_plane(self) -> bool:
        """Every worker shares its switch's host, so every rank can take the memory
        plane (ranks must agree on the path: one that cannot would run another)."""
        topo = self.ep.topo
        return all(topo.host_address(w.name) == topo.host_address(topo.switch_of(w.name))
                   for w in topo.workers)

    @property
    def timeout_s(self) -> float:
        """Seconds any wait on a peer may take."""
        return self.comm.timeout_s

    def close(self) -> None:
        """Leave the fabric: wait for every rank (so rank 0 does not stop the switch
        under a peer still using it), close the endpoint, stop the fabric on rank 0."""
        global _current
        if self.closed:
            return
        self.closed = True
        if _current is self:
            _current = None
        try:
            if self.comm.broken is None:
                self.comm.call(self.ep.barrier, "shutdown barrier")
        except SemfabError as exc:
            log.warning("rank %d: leaving without the closing barrier: %s", self.rank, exc)
        finally:
            if self.owns_ep:
                try:
                    self.comm.call(self.ep.close, "close endpoint")
                except SemfabError:
                    pass
            self.comm.stop()
            if self.fabric is not None:
                self.fabric.close()


_current: Runtime | None = None


def current() -> Runtime | None:
    """The open runtime of this process, if any."""
    return _current


def from_endpoint(ep: Endpoint) -> Runtime:
    """Wrap a launched worker's endpoint (``semfab launch``): the comm thread uses
    it while torch runs; :meth:`Runtime.close` hands it back."""
    global _current
    if _current is not None:
        return _current
    comm = CommThread(ep.rank, ep.timeout_s)
    _current = Runtime(ep.rank, ep.world, comm, ep, None, owns_ep=False)
    return _current


def _topology(world: int, addresses: list[str] | None) -> Topology:
    """SEMFAB_TOPOLOGY, or a star of ``world`` workers: over ipc on one host, over
    tcp when the ranks run on several (``addresses``: each rank's, rank 0's
    hosting the switch and the host node)."""
    path = os.environ.get("SEMFAB_TOPOLOGY")
    if not path:
        if addresses is None:
            return star(world)
        base = star(world, transport="tcp")
        sw = base.switches[0]
        hosts = {w.name: addresses[w.id] for w in base.workers}
        hosts.update({n.name: addresses[0] for n in (*base.hosts, *base.switches)})
        return Topology(base.nodes, base.links, name=base.name, transport="tcp",
                        base_port=_free_port() - sw.id, host_addresses=hosts,
                        defaults=base.defaults)
    try:
        topo = load(path)
    except (OSError, TopologyError) as exc:
        raise UsageError(f"SEMFAB_TOPOLOGY={path}: {exc}") from None
    if len(topo.workers) != world:
        raise UsageError(f"SEMFAB_TOPOLOGY={path} has {len(topo.workers)} workers but the "
                         f"job has {world} ranks; give a topology with one worker per rank")
    return topo


def _free_port() -> int:
    """A TCP port free on this host now (the switch binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _several_hosts(world: int) -> bool:
    """True when torchrun placed the ranks on more than one host (or SEMFAB_TRANSPORT=tcp)."""
    if os.environ.get("SEMFAB_TRANSPORT", "").lower() == "tcp":
        return True
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


def _my_address() -> str:
    """This host's address as the rendezvous host sees it: the source address of a
    route to MASTER_ADDR (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def from_store(store: Any, rank: int, world: int, timeout_s: float) -> Runtime:
    """Bring the fabric up through torch's ``store`` (rank 0 starts it) and attach
    this rank's endpoint."""
    global _current
    if _current is not None:
        return _current
    fabric: Fabric | None = None
    several = _several_hosts(world)
    if several:
        store.set(f"{STORE_KEY}/address/{rank}", _my_address())
    if rank == 0:
        try:
            addresses = [store.get(f"{STORE_KEY}/address/{r}").decode()
                         for r in range(world)] if several else None
            topo = _topology(world, addresses)
            fabric = _ServiceFabric(topo, timeout_s=timeout_s).start()
            assert fabric.sock_dir is not None
            # the topology travels as text: the other hosts cannot read rank 0's files
            info = {"topology": topo.to_toml(), "sock_dir": str(fabric.sock_dir),
                    "run_id": fabric.run_id}
        except Exception as exc:
            store.set(STORE_KEY, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(STORE_KEY, json.dumps(info))
    else:
        info = json.loads(store.get(STORE_KEY))
        if "error" in info:
            raise SemfabError(f"semfab rank {rank}: rank 0 could not start the fabric: "
                              f"{info['error']}")
    comm = CommThread(rank, timeout_s)
    try:
        topo = loads(info["topology"], "<rank 0's topology>")
        name = topo.workers[rank].name
        ep: Endpoint = comm.call(lambda: Endpoint(topo, name, info["sock_dir"],
                                                  run_id=info["run_id"], timeout_s=timeout_s),
                                 "attach to the fabric")
    except BaseException:
        comm.stop()
        if fabric is not None:
            fabric.close()
        raise
    _current = Runtime(rank, world, comm, ep, fabric, owns_ep=True)
    atexit.register(_current.close)
    return _current
