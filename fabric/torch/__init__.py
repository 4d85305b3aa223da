"""PyTorch programs over the fabric: the ``torch.distributed`` backend ``"semfab"``.

Importing this package registers the backend::

    import torch.distributed as dist
    import fabric.torch                       # registers "semfab"

    dist.init_process_group("semfab")         # under torchrun: rank 0 starts the fabric
    model = DDP(model)                        # gradients reduced in the switch

``SEMFAB_PATH`` (``ina``, ``ina-mem``, ``host-ring``, ``auto``) picks the
fabric path of every operation, ``SEMFAB_NUMERICS=fixed`` makes float sums
reproducible (fixed point), ``SEMFAB_TIMEOUT`` bounds every wait on a peer.
See docs/TORCH.md.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fabric.torch.comm import FabricWork
from fabric.torch.errors import TorchCommError, TorchOpError
from fabric.torch.group import BACKEND, SemfabProcessGroup
from fabric.torch.options import Options, timeout_from_env
from fabric.torch.runtime import current, from_endpoint, from_store
from fabric.torch.trace import record

__all__ = ["BACKEND", "FabricWork", "Options", "SemfabProcessGroup", "TorchCommError",
           "TorchOpError", "allreduce_hook", "fallbacks", "init", "record", "shutdown",
           "store_of", "switch_stats"]


def _create(dist_opts: Any, backend_options: Any = None) -> SemfabProcessGroup:
    """The backend's creator (torch's extended API): one group per call."""
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    ranks = [int(r) for r in (dist_opts.global_ranks_in_group or [])] or list(range(size))
    options = backend_options if isinstance(backend_options, Options) else Options()
    options = options.resolved()  # a bad SEMFAB_PATH fails here, on every rank
    rt = current()
    timeout = dist_opts.timeout
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else None
    if rt is None:
        world = dist.get_world_size() if dist.is_initialized() else size
        if size != world:
            raise TorchOpError(rank, "new_group", "the first semfab group must hold every "
                               f"rank ({size} of {world}): create it over the whole world")
        rt = from_store(dist_opts.store, rank, size, timeout_from_env(timeout_s))
    if ranks == list(range(rt.world)) and not rt.world_group_made:
        rt.world_group_made = True  # a later group of every rank gets its own communicator
        return SemfabProcessGroup(rt, rank, size, ranks, None, options)
    comm = rt.comm.call(lambda: rt.ep.group(ranks), f"new_group {ranks}")
    return SemfabProcessGroup(rt, rank, size, ranks, comm, options)


def init(ep: Any = None, **kwargs: Any) -> None:
    """``dist.init_process_group("semfab")``, from torchrun's environment or, with a
    worker's endpoint ``ep`` (``semfab launch --run train.py:main``, ``semfab run
    --workload train.py:main``), over that fabric (see :func:`store_of`)."""
    if ep is None:
        dist.init_process_group(BACKEND, **kwargs)
        return
    rt = from_endpoint(ep)
    try:
        dist.init_process_group(BACKEND, store=store_of(ep), rank=rt.rank,
                                world_size=rt.world, **kwargs)
    except BaseException:
        rt.close()
        raise


def store_of(ep: Any) -> Any:
    """Torch's store for the workers of ``ep``'s fabric: ``SEMFAB_TORCH_STORE=HOST:PORT``
    (a TCPStore that worker 0 serves); else, when the workers run on several hosts,
    a TCPStore on worker 0's host at the port after the fabric's block (base_port +
    nodes); else a file in this host's temporary folder, named by the run."""
    topo, world = ep.topo, ep.world
    spec = os.environ.get("SEMFAB_TORCH_STORE", "")
    if not spec and len({topo.host_address(w.name) for w in topo.workers}) > 1:
        spec = f"{topo.host_address(topo.workers[0].name)}:{topo.base_port + len(topo.nodes)}"
    if not spec:
        path = os.path.join(tempfile.gettempdir(), f"semfab-torch-store-{ep.run_id}")
        return dist.FileStore(path, world)
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise TorchOpError(ep.rank, "init", f"SEMFAB_TORCH_STORE={spec}: give HOST:PORT")
    return dist.TCPStore(host.strip("[]"), int(port), world, is_master=ep.rank == 0,
                         timeout=timedelta(seconds=max(ep.timeout_s, 60.0)))


def shutdown() -> None:
    """``dist.destroy_process_group()`` and leave the fabric (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    rt = current()
    if rt is not None:
        rt.close()


def switch_stats() -> dict[str, Any]:
    """The counters of this rank's switch (what ``semfab stats`` shows): the proof
    that reductions ran in the switch (``reduce_frames``, the engine's
    ``completions``)."""
    rt = current()
    if rt is None:
        raise TorchOpError(-1, "switch_stats", "no semfab process group in this process")
    stats: dict[str, Any] = rt.comm.call(rt.ep.switch_stats, "switch_stats")
    return stats


def fallbacks() -> list[str]:
    """Operations the fabric ran on another path than asked (a switch refused a job,
    the memory plane was out of reach), as notes: never silent."""
    rt = current()
    if rt is None:
        return []
    notes: list[str] = rt.comm.call(lambda: list(rt.ep.fallbacks), "fallbacks")
    return notes


def allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each gradient bucket on the fabric,
    for programs that keep another backend (gloo) for everything else::

        sem = dist.new_group(backend="semfab")
        ddp.register_comm_hook(sem, fabric.torch.allreduce_hook)

    ``state``: a semfab process group (None: the default group, if semfab)."""
    pg = state if state is not None else dist.group.WORLD
    if not isinstance(pg, SemfabProcessGroup):
        raise TorchOpError(-1, "allreduce_hook", "the hook's state must be a semfab process "
                           "group: dist.new_group(backend='semfab')")
    tensor = bucket.buffer()
    tensor.div_(pg.size())
    fut = pg.allreduce([tensor]).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP checks a hook's annotations against the classes themselves, and this module's
# annotations are strings (postponed evaluation)
allreduce_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
