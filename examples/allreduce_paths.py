"""Allreduce one tensor on every path and check the exact result.

    semfab launch --workers 4 --run examples/allreduce_paths.py:work
"""

import numpy as np


def work(ep, count=100_003):
    """Runs on every worker; ``ep`` is its fabric endpoint."""
    expected = sum(np.arange(count, dtype=np.float32) * (r + 1) for r in range(ep.world))
    wrong = {}
    for path in ("ina", "ina-mem", "host-ps", "host-ring"):
        x = ep.alloc(count, "float32")  # registered "device memory"
        x[:] = np.arange(count, dtype=np.float32) * (ep.rank + 1)
        ep.allreduce(x, op="sum", path=path, out=x)
        wrong[path] = int((x != expected).sum())
    return wrong
