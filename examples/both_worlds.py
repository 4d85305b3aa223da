"""One workload, two worlds: the same generator on a simulated leaf/spine
fabric (virtual time) and on launched processes (real time).

    python examples/both_worlds.py
"""

import numpy as np

from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.sim import Simulation


def work(ctx, count):
    x = np.arange(count, dtype=np.int32) * (ctx.rank + 1)
    y = yield ctx.allreduce(x, path="ina")  # yields, never blocks
    t = yield ctx.clock()  # virtual seconds in simulation, monotonic in emulation
    return int(y[1]), t


if __name__ == "__main__":
    sim = Simulation(leaf_spine(4, 8, leaf_bandwidth_gbps=100)).run(work, 1 << 16)
    print("simulated, 32 workers:", sim.results[0][0], f"in {sim.end_s * 1e6:.1f} us virtual")
    with launch(topology=star(4)) as fab:  # real processes
        print("emulated, 4 workers:", [r[0] for r in fab.run(run_in_emulation, work, 1 << 16)])
