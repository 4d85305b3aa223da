"""An expert-parallel MoE layer over the fabric against gloo, in one run: tokens
go to the rank holding their expert and back with uneven ``all_to_all_single``
(after an ``all_to_all_single`` of the counts), the gate's gradients are
averaged with ``all_reduce``; time per step and parameters compared.

    torchrun --standalone --nproc-per-node 2 examples/torch_moe_ep.py --steps 10
    torchrun --standalone --nproc-per-node 4 examples/torch_moe_ep.py
    semfab launch --workers 2 --run examples/torch_moe_ep.py:main --args '[10]'

Rank 0 prints one JSON line.
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
import torch.distributed._functional_collectives as fc
from torch import nn

import fabric.torch

HIDDEN, EXPERTS_PER_RANK, TOKENS = 32, 2, 64


class ExpertParallelMoE(nn.Module):
    """Top-1 MoE: a replicated gate, ``EXPERTS_PER_RANK`` experts on each rank."""

    def __init__(self, pg: Any) -> None:
        super().__init__()
        self.pg = pg
        self.world, self.rank = dist.get_world_size(pg), dist.get_rank(pg)
        torch.manual_seed(0)  # the same gate everywhere
        self.gate = nn.Linear(HIDDEN, EXPERTS_PER_RANK * self.world)
        experts = []
        for e in range(EXPERTS_PER_RANK):
            torch.manual_seed(100 + self.rank * EXPERTS_PER_RANK + e)  # by global expert id
            experts.append(nn.Linear(HIDDEN, HIDDEN))
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        weight, expert = probs.max(-1)
        order = expert.argsort(stable=True)
        dest = expert[order] // EXPERTS_PER_RANK
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.pg)  # the counts first
        s, r = send.tolist(), recv.tolist()
        local_id = torch.empty(sum(r), dtype=torch.int64)
        dist.all_to_all_single(local_id, expert[order] % EXPERTS_PER_RANK, r, s, group=self.pg)
        # the autograd form: its backward sends the gradients back the same way
        tokens = fc.all_to_all_single_autograd(x[order], r, s, self.pg)
        out = torch.zeros_like(tokens)
        for e, layer in enumerate(self.experts):
            mine = local_id == e
            out = out.index_put((mine.nonzero().squeeze(1),), layer(tokens[mine]))
        back = fc.all_to_all_single_autograd(out, s, r, self.pg)
        y = torch.empty_like(back).index_put((order,), back)
        return x + y * weight.unsqueeze(1)


def train(pg: Any, steps: int, record: str | None = None) -> tuple[list[torch.Tensor], float]:
    """``steps`` SGD steps; (parameters, seconds per step after the first)."""
    model = ExpertParallelMoE(pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    world = dist.get_world_size(pg)
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        # the last step on the fabric, recorded when asked (--record)
        last = record is not None and step == steps - 1 and pg is dist.group.WORLD
        with fabric.torch.record(record) if last else contextlib.nullcontext():
            x = torch.randn(TOKENS, HIDDEN, generator=gen)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.gate.parameters():  # the replicated gate: average its gradients
                assert p.grad is not None
                p.grad.div_(world)
                dist.all_reduce(p.grad, group=pg)
            opt.step()
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    return [p.detach().clone() for p in model.parameters()], per_step


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
    ours, semfab_s = train(dist.group.WORLD, steps, record=record)
    return {
        "example": "moe_ep", "world": dist.get_world_size(), "steps": steps,
        "path": os.environ.get("SEMFAB_PATH", "ina"),
        "numerics": os.environ.get("SEMFAB_NUMERICS", "float"),
        "gloo_ms_per_step": round(gloo_s * 1e3, 3), "semfab_ms_per_step": round(semfab_s * 1e3, 3),
        "bit_identical": all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True)),
        # the same on every run and every path under SEMFAB_NUMERICS=fixed
        "semfab_params_sha1": digest(ours),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(ref, ours, strict=True)),
        "fallbacks": fabric.torch.fallbacks(),
    }


def main(ep: Any = None, steps: int = 10, record: str | None = None) -> dict[str, Any]:
    """Entry of ``semfab launch --run examples/torch_moe_ep.py:main`` and of torchrun."""
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
            print(f"MoE EP, {summary['world']} ranks, {args.steps} steps: gloo "
                  f"{summary['gloo_ms_per_step']} ms/step, semfab "
                  f"{summary['semfab_ms_per_step']} ms/step; parameters "
                  f"{'bit-identical' if summary['bit_identical'] else 'differ'} "
                  f"(max |diff| {summary['max_abs_diff']:.3g})")
        print(json.dumps(summary))
