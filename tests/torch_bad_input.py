"""A torch job for tests/test_torch_errors.py (run under torchrun, 2 ranks).

``refusals DIR``: each bad call must raise the backend's typed error naming the
rank and the operation, within the timeout; each rank writes what it saw to
DIR/rank<r>.json; then rank 0 is SIGKILLed (the test checks that nothing is left
running). ``crash-1`` / ``kill-0`` (by hand): rank 1 exits, or rank 0 is
SIGKILLed, after one allreduce, while the other waits in the next one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fabric.torch
from fabric.torch import Options, TorchCommError, TorchOpError


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "s": time.monotonic() - t0}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "rank": getattr(exc, "rank", None), "op": getattr(exc, "op", None),
                "typed": isinstance(exc, (TorchOpError, TorchCommError)),
                "s": time.monotonic() - t0}


def refusals(checked: Any) -> dict[str, Any]:
    r = dist.get_rank()
    seen: dict[str, Any] = {}
    seen["product"] = outcome(lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.PRODUCT))
    seen["float64"] = outcome(lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64)))
    seen["meta"] = outcome(lambda: dist.all_reduce(torch.ones(4, device="meta")))
    seen["anysource"] = outcome(lambda: dist.recv(torch.ones(4)))
    seen["uneven_split"] = outcome(lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3)))
    # a checked group: the ranks agree on each call first, so a mismatch is refused
    # by name and the group stays usable
    seen["checked_mismatch"] = outcome(
        lambda: dist.all_reduce(torch.ones(10 if r == 0 else 20), group=checked))
    x = torch.full((5,), float(r + 1))
    seen["checked_after"] = outcome(lambda: dist.all_reduce(x, group=checked))
    seen["checked_value"] = x.tolist()
    # one rank refuses its own argument: the other is told at once (no timeout)
    # and the next call is exact on both
    seen["one_refuses"] = outcome(lambda: dist.all_reduce(
        torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32)))
    y = torch.full((3,), float(r + 1))
    seen["one_after"] = outcome(lambda: dist.all_reduce(y))
    seen["one_after_value"] = y.tolist()
    # the world group, unchecked: the switch refuses the chunk whose length differs;
    # the call ends on both ranks, naming the op, and the next call is exact
    seen["mismatch"] = outcome(lambda: dist.all_reduce(torch.ones(10 if r == 0 else 20)))
    z = torch.full((4,), float(r + 1))
    seen["after"] = outcome(lambda: dist.all_reduce(z))
    seen["after_value"] = z.tolist()
    return seen


def main() -> None:
    mode = sys.argv[1]
    fabric.torch.init()
    r = dist.get_rank()
    if mode == "refusals":
        checked = dist.new_group(backend="semfab", pg_options=Options(check=True))
        seen = refusals(checked)
        # a file per rank: two long lines on one pipe may interleave
        Path(sys.argv[2], f"rank{r}.json").write_text(json.dumps({"rank": r, **seen}))
        # then rank 0, which started the switch and host, dies while rank 1 waits on it
        if r == 0:
            deadline = time.monotonic() + 30
            while len(list(Path(sys.argv[2]).glob("rank*.json"))) < dist.get_world_size() \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # (this process's comm thread is broken by the mismatch above)
        return
    dist.all_reduce(torch.ones(8))  # the fabric works
    if mode == "crash-1" and r == 1:
        os._exit(3)
    if mode == "kill-0" and r == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    dist.all_reduce(torch.ones(8))  # the survivor waits here until its timeout at most
    fabric.torch.shutdown()


if __name__ == "__main__":
    main()
