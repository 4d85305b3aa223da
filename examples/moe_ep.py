"""MoE expert parallelism in both worlds: dispatch and combine on tensor-parallel
pairs and an expert-parallel group, flat against in the network, checked
against NumPy (identity experts: combine(dispatch(x)) = sum_k w_k x).

    python examples/moe_ep.py
"""

import numpy as np

from fabric.core.moe import expert_partials, make_inputs, moe_reference
from fabric.core.topology import leaf_spine
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.sim import Simulation

T, H, K = 32, 256, 4  # tokens per rank, hidden size, top-k


def work(ctx, experts):
    ep = yield ctx.group(range(ctx.world))  # the expert-parallel group
    x, idx, w = make_inputs(ctx.rank, T, H, K, experts, "float32")
    out = {}
    for variant in ("flat", "in-network"):
        t0 = yield ctx.clock()
        d = yield ctx.moe_dispatch(x, idx, w, experts, variant=variant, group=ep)
        y = yield ctx.moe_combine(d, expert_partials(d, ep.rank, ep.size), group=ep)
        t1 = yield ctx.clock()
        out[variant] = (np.array(y), t1 - t0)
    yield ctx.close_group(ep)
    return out


def check(results, world, experts):
    ins = [make_inputs(r, T, H, K, experts, "float32") for r in range(world)]
    want = moe_reference(*zip(*ins, strict=True), experts)
    for variant in ("flat", "in-network"):
        wrong = sum(int((res[variant][0] != want[r]).sum()) for r, res in enumerate(results))
        took = max(res[variant][1] for res in results) * 1e3
        print(f"  {variant:10s} wrong elements: {wrong}   slowest rank: {took:.2f} ms")


if __name__ == "__main__":
    topo = leaf_spine(4, 8, leaf_bandwidth_gbps=100)  # 32 ranks, virtual time
    print("simulated, 32 ranks:")
    check(Simulation(topo).run(work, 64).results, 32, 64)
    print("emulated, 4 ranks on 2 leaves:")
    with launch(topology=leaf_spine(2, 2, hosts=0)) as fab:
        check(fab.run(run_in_emulation, work, 16), 4, 16)
