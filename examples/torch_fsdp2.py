"""FSDP2 (``fully_shard``) over the fabric against gloo, in one run: the same model
sharded over both, time per step, the gathered parameters compared.

    torchrun --standalone --nproc-per-node 2 examples/torch_fsdp2.py --steps 10
    SEMFAB_NUMERICS=fixed torchrun --standalone --nproc-per-node 4 examples/torch_fsdp2.py
    semfab launch --workers 2 --run examples/torch_fsdp2.py:main --args '[10]'

FSDP2 all-gathers each layer's parameters before use (``all_gather_into_tensor``)
and reduce-scatters its gradients (``reduce_scatter_tensor``); on semfab both run
on the fabric's ``ina`` collectives by default. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import fabric.torch


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def train(pg: Any, steps: int, batch: int = 16,
          record: str | None = None) -> tuple[list[torch.Tensor], float]:
    """``steps`` Adam steps of the model sharded over ``pg``; (full parameters,
    seconds per step after the first)."""
    mesh = DeviceMesh.from_group(pg, "cpu")
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        # the last step on the fabric, recorded when asked (--record)
        last = record is not None and step == steps - 1 and pg is dist.group.WORLD
        with fabric.torch.record(record) if last else contextlib.nullcontext():
            x = torch.randn(batch, 64, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    return full, per_step


def digest(params: list[torch.Tensor]) -> str:
    """A short hash of the parameters' bits."""
    h = hashlib.sha1()
    for p in params:
        h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def compare(steps: int, record: str | None = None) -> dict[str, Any]:
    """Train on gloo then on semfab; the summary."""
    gloo = dist.new_group(backend="gloo")
    ref, gloo_s = train(gloo, steps)
    frames0 = int(fabric.torch.switch_stats().get("reduce_frames", 0))
    ours, semfab_s = train(dist.group.WORLD, steps, record=record)
    frames1 = int(fabric.torch.switch_stats().get("reduce_frames", 0))
    return {
        "example": "fsdp2", "world": dist.get_world_size(), "steps": steps,
        "path": os.environ.get("SEMFAB_PATH", "ina"),
        "numerics": os.environ.get("SEMFAB_NUMERICS", "float"),
        "gloo_ms_per_step": round(gloo_s * 1e3, 3), "semfab_ms_per_step": round(semfab_s * 1e3, 3),
        "bit_identical": all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True)),
        # the same on every run and every path under SEMFAB_NUMERICS=fixed
        "semfab_params_sha1": digest(ours),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(ref, ours, strict=True)),
        "switch_reduce_frames": frames1 - frames0,
        "fallbacks": fabric.torch.fallbacks(),
    }


def main(ep: Any = None, steps: int = 10, record: str | None = None) -> dict[str, Any]:
    """Entry of ``semfab launch --run examples/torch_fsdp2.py:main`` and of torchrun."""
    fabric.torch.init(ep)
    try:
        return compare(steps, record)
    finally:
        fabric.torch.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--record", metavar="TRACE.json",
                   help="record the last semfab step (replay: semfab sim replay)")
    args = p.parse_args()
    summary = main(steps=args.steps, record=args.record)
    if int(os.environ.get("RANK", "0")) == 0:
        if not args.json:
            print(f"FSDP2, {summary['world']} ranks, {args.steps} steps: gloo "
                  f"{summary['gloo_ms_per_step']} ms/step, semfab ({summary['path']}) "
                  f"{summary['semfab_ms_per_step']} ms/step; parameters "
                  f"{'bit-identical' if summary['bit_identical'] else 'differ'} "
                  f"(max |diff| {summary['max_abs_diff']:.3g})")
        print(json.dumps(summary))
