"""DDP over the fabric against gloo, in one run: the same model trained on both,
time per step, parameters compared, and the switch's counters as proof that the
gradient buckets were reduced in the switch.

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py --steps 20
    SEMFAB_PATH=ina-mem torchrun --standalone --nproc-per-node 4 examples/torch_ddp.py
    semfab launch --workers 2 --run examples/torch_ddp.py:main --args '[20]'

Rank 0 prints one JSON line (``--json`` only that line).
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
from torch.nn.parallel import DistributedDataParallel as DDP

import fabric.torch

#: Hidden width of the model (--width): 256 gives 85k parameters, 2048 gives 4.3M.
WIDTH = int(os.environ.get("SEMFAB_EXAMPLE_WIDTH", "256"))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 10))


def train(pg: Any, steps: int, batch: int = 32, hook: Any = None,
          record: str | None = None) -> tuple[list[torch.Tensor], float]:
    """``steps`` SGD steps of DDP over ``pg`` (gradients through ``fabric.torch``'s
    comm hook on group ``hook`` when given); (parameters, seconds per step after
    the first, which builds DDP's buckets)."""
    rank = dist.get_rank()
    model = DDP(make_model(), process_group=pg)
    if hook is not None:
        model.register_comm_hook(hook, fabric.torch.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        # the last step on the fabric, recorded when asked (--record)
        last = record is not None and step == steps - 1 and pg is None
        with fabric.torch.record(record) if last else contextlib.nullcontext():
            x = torch.randn(batch, 64, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    return [p.detach().clone() for p in model.parameters()], per_step


def _engine(stats: dict[str, Any]) -> tuple[int, int]:
    engine = stats.get("engine") or {}
    return int(stats.get("reduce_frames", 0)), int(engine.get("completions", 0))


def digest(params: list[torch.Tensor]) -> str:
    """A short hash of the parameters' bits."""
    h = hashlib.sha1()
    for p in params:
        h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def compare(steps: int, record: str | None = None) -> dict[str, Any]:
    """Train on gloo, on semfab (the default group), and on gloo with the gradients
    through fabric.torch.allreduce_hook; the summary."""
    gloo = dist.new_group(backend="gloo")
    ref, gloo_s = train(gloo, steps)
    frames0, done0 = _engine(fabric.torch.switch_stats())
    ours, semfab_s = train(None, steps, record=record)
    frames1, done1 = _engine(fabric.torch.switch_stats())
    # gloo for DDP's setup, the fabric for the gradients only
    hooked, hook_s = train(gloo, steps, hook=dist.group.WORLD)
    diffs = [float((a - b).abs().max()) for a, b in zip(ref, ours, strict=True)]
    return {
        "example": "ddp", "world": dist.get_world_size(), "steps": steps, "width": WIDTH,
        "path": os.environ.get("SEMFAB_PATH", "ina"),
        "numerics": os.environ.get("SEMFAB_NUMERICS", "float"),
        "gloo_ms_per_step": round(gloo_s * 1e3, 3), "semfab_ms_per_step": round(semfab_s * 1e3, 3),
        "bit_identical": all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True)),
        # the same on every run and every path under SEMFAB_NUMERICS=fixed
        "semfab_params_sha1": digest(ours),
        "max_abs_diff": max(diffs),
        "hook_ms_per_step": round(hook_s * 1e3, 3),
        "hook_bit_identical": all(torch.equal(a, b) for a, b in zip(ref, hooked, strict=True)),
        "switch_reduce_frames": frames1 - frames0, "switch_completions": done1 - done0,
        "fallbacks": fabric.torch.fallbacks(),
    }


def main(ep: Any = None, steps: int = 20, record: str | None = None) -> dict[str, Any]:
    """Entry of ``semfab launch --run examples/torch_ddp.py:main`` (``ep`` given) and
    of torchrun (below)."""
    fabric.torch.init(ep)
    try:
        return compare(steps, record)
    finally:
        fabric.torch.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=WIDTH,
                   help="hidden width (256: 85k parameters; 2048: 4.3M, 17 MB of gradients)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--record", metavar="TRACE.json",
                   help="record the last semfab step (replay: semfab sim replay)")
    args = p.parse_args()
    WIDTH = args.width
    summary = main(steps=args.steps, record=args.record)
    if int(os.environ.get("RANK", "0")) == 0:
        if not args.json:
            print(f"DDP, {summary['world']} ranks, {args.steps} steps: gloo "
                  f"{summary['gloo_ms_per_step']} ms/step, semfab ({summary['path']}) "
                  f"{summary['semfab_ms_per_step']} ms/step; parameters "
                  f"{'bit-identical' if summary['bit_identical'] else 'differ'} "
                  f"(max |diff| {summary['max_abs_diff']:.3g}); switch reduced "
                  f"{summary['switch_reduce_frames']} frames")
        print(json.dumps(summary))
