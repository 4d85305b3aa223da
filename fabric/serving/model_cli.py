"""`semfab model`: a sharded model's decode step, part by part, before any traffic.

Prints what one decode step costs one GPU of a layout: each part's compute time
(the roofline of :mod:`fabric.core.model`) and the bytes each collective puts on
the network, per layer and per step; ``--json`` writes every figure and setting,
``--markdown`` the table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from fabric.core.model import GPUS, MODELS, Layout, decode_step, get_gpu, get_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab model`."""
    p.add_argument("--model", default="deepseek-v3", metavar="PRESET",
                   help=f"model preset: {', '.join(MODELS)}")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--dp", type=int, default=1, help="data-parallel copies")
    p.add_argument("--batch", type=int, default=128,
                   help="sequences decoded together per data-parallel copy")
    p.add_argument("--context", type=int, default=4096, help="tokens cached per sequence")
    p.add_argument("--gpu", default="h100", help=f"GPU figures: {', '.join(GPUS)}")
    p.add_argument("--json", metavar="FILE", help="write every figure and setting here")
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown here")


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def run(args: argparse.Namespace) -> int:
    """Print the step's parts; 0."""
    from bench.report import markdown_table

    m = get_model(args.model)
    layout = Layout(tp=args.tp, ep=args.ep, pp=args.pp, dp=args.dp)
    gpu = get_gpu(args.gpu)
    step = decode_step(m, layout, gpu, batch=args.batch, context=args.context)
    print(f"# semfab model: {m.name} ({m.params() / 1e9:.1f} B parameters, {m.dtype}); "
          f"tp {layout.tp} x ep {layout.ep} x pp {layout.pp} x dp {layout.dp} = "
          f"{layout.world} GPUs ({gpu.name}: {gpu.tflops:g} TFLOP/s x {gpu.flops_eff:g}, "
          f"{gpu.hbm_gbs:g} GB/s x {gpu.hbm_eff:g}); batch {args.batch} per copy, "
          f"context {args.context}")
    head = ["part", "layers/stage", "compute us/layer", "compute ms/step", "message/layer",
            "sent/layer", "sent/step"]
    rows = []
    for p in step.parts:
        rows.append([p.name, str(p.layers), f"{p.compute_us:.2f}",
                     f"{p.compute_us * p.layers * layout.pp / 1e3:.3f}",
                     _fmt_bytes(p.message_bytes) if p.message_bytes else "-",
                     _fmt_bytes(p.net_bytes) if p.net_bytes else "-",
                     _fmt_bytes(p.net_bytes * p.layers * layout.pp) if p.net_bytes else "-"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    sent = sum(p.net_bytes * p.layers for p in step.parts) * layout.pp
    print(f"# compute per step {step.compute_us / 1e3:.3f} ms (the stages in turn; no "
          f"network): {1e6 / step.compute_us * args.batch:.0f} tokens/s per copy at most; "
          f"each GPU sends {_fmt_bytes(sent)} per step")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(markdown_table(head, rows, left=("part",))) + "\n")
    if args.json:
        doc: dict[str, Any] = {
            "settings": {"model": asdict(m), "layout": asdict(layout), "gpu": asdict(gpu),
                         "batch": args.batch, "context": args.context},
            "params": m.params(), "world": layout.world,
            "compute_us_per_step": step.compute_us, "sent_bytes_per_step": sent,
            "parts": [asdict(p) for p in step.parts],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0
