"""`semfab sim calibrate`: measure this machine's emulator, for the simulator.

The simulator's switches and nodes cost nothing by default (ideal hardware).
To simulate "this emulator" instead, it needs the time a software switch and
a node take per frame and per byte. This command launches stars of 2 and 4
workers on unshaped links and fits, by least squares over the runs:

* a barrier (one small frame up, one down per worker; the switch handles all
  of them one after another): ``T = 2 node_frame + W switch_frame``;
* an ``ina`` allreduce of ``B`` bytes per worker (the switch copies every
  contribution in and every result out): its growth with ``B`` gives
  ``switch_byte = dT/dB / (2 W)``, the switch being the bottleneck.

The fit is a model, not a measurement of each part: it is what makes the
simulator's unshaped times resemble the emulator's. It writes JSON that
``semfab sim allreduce --calibration FILE`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np

from fabric.errors import UsageError, parse_json
from fabric.sim.engine import TimingModel

SMALL, LARGE = 4096, 4 << 20


def _barrier_workload(ctx: Any, n: int) -> Generator[Any, Any, list[float]]:
    times = []
    for _ in range(n):
        t0 = yield ctx.clock()
        yield ctx.barrier()
        t1 = yield ctx.clock()
        times.append(t1 - t0)
    return times


def _ina_workload(ctx: Any, nbytes: int, n: int) -> Generator[Any, Any, list[float]]:
    x = np.full(nbytes // 4, ctx.rank + 1, np.float32)
    times = []
    for i in range(n + 2):
        yield ctx.barrier()
        t0 = yield ctx.clock()
        yield ctx.allreduce(x, path="ina")
        t1 = yield ctx.clock()
        if i >= 2:  # warm-up: job registration, first wake-ups
            times.append(t1 - t0)
    return times


def measure(workers: tuple[int, ...] = (2, 4), iters: int = 20) -> dict[str, Any]:
    """Run the emulator and fit a TimingModel; returns the fit and its inputs."""
    from fabric.core.topology import star
    from fabric.emulation.launcher import launch
    from fabric.emulation.workloads import run_in_emulation

    rows = []
    for w in workers:
        with launch(topology=star(w)) as fab:
            bar = fab.run(run_in_emulation, _barrier_workload, iters)
            small = fab.run(run_in_emulation, _ina_workload, SMALL, iters)
            large = fab.run(run_in_emulation, _ina_workload, LARGE, max(iters // 4, 3))
        med = [statistics.median(max(r[k] for r in runs) for k in range(len(runs[0])))
               for runs in (bar, small, large)]
        rows.append({"workers": w, "barrier_s": med[0], "ina_small_s": med[1],
                     "ina_large_s": med[2]})
    # T_barrier = 2 n + W s  (least squares over the worker counts)
    a = np.array([[2.0, r["workers"]] for r in rows])
    b = np.array([r["barrier_s"] for r in rows])
    (node_frame, switch_frame), *_ = np.linalg.lstsq(a, b, rcond=None)
    slopes = [(r["ina_large_s"] - r["ina_small_s"]) / (LARGE - SMALL) / (2 * r["workers"])
              for r in rows]
    model = TimingModel(switch_frame_s=max(float(switch_frame), 0.0),
                        switch_byte_s=max(statistics.median(slopes), 0.0),
                        node_frame_s=max(float(node_frame), 0.0))
    return {"timing": dataclasses.asdict(model), "measured": rows,
            "model": "barrier = 2 node_frame + W switch_frame; "
                     "d(ina time)/d(bytes) = 2 W switch_byte"}


def load(path: str) -> TimingModel:
    """The TimingModel a calibration file holds (UsageError when it is not one)."""
    how = "write one with `semfab sim calibrate --json FILE`"
    try:
        doc = parse_json(Path(path).read_bytes(), f"--calibration {path}")
        t = doc["timing"]
        costs = {k: float(t[k]) for k in ("switch_frame_s", "switch_byte_s", "node_frame_s",
                                          "node_byte_s")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--calibration {path}: not a calibration file ({exc}); {how}") from None
    bad = [k for k, v in costs.items() if not 0 <= v < 1]  # NaN too: seconds per frame or byte
    if bad:
        raise UsageError(f"--calibration {path}: {', '.join(bad)} must be from 0 to 1 s; {how}")
    return TimingModel(switch_frame_s=costs["switch_frame_s"],
                       switch_byte_s=costs["switch_byte_s"],
                       node_frame_s=costs["node_frame_s"], node_byte_s=costs["node_byte_s"])


def run(args: argparse.Namespace) -> int:
    """`semfab sim calibrate`."""
    from fabric.emulation.launch_cli import check_output_file

    if args.json:
        check_output_file("--json", args.json)
    if args.iters < 3:
        raise UsageError("--iters must be at least 3")
    print("# semfab sim calibrate: stars of 2 and 4 workers, unshaped, on this machine")
    fit = measure(iters=args.iters)
    for r in fit["measured"]:
        print(f"  {r['workers']} workers: barrier {r['barrier_s'] * 1e6:.0f} us, ina 4 KiB "
              f"{r['ina_small_s'] * 1e6:.0f} us, ina 4 MiB {r['ina_large_s'] * 1e3:.2f} ms")
    t = fit["timing"]
    print(f"# fit: switch {t['switch_frame_s'] * 1e6:.1f} us/frame + "
          f"{t['switch_byte_s'] * 1e9:.3f} ns/B, node {t['node_frame_s'] * 1e6:.1f} us/frame")
    if args.json:
        Path(args.json).write_text(json.dumps(fit, indent=2) + "\n")
        print(f"# wrote {args.json}")
    return 0
