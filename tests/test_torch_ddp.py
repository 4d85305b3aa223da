"""DDP over the semfab backend against gloo (examples/torch_ddp.py) under torchrun,
with the switch's counters as proof of in-switch reduction (`semfab launch` and
the other paths: tests/test_torch_ops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun

pytest.importorskip("torch")

STEPS = "6"


def test_ddp_torchrun_matches_gloo_bit_for_bit(tmp_path: Path) -> None:
    # two ranks: each sum has two terms, so any order gives gloo's bits
    res = torchrun("examples/torch_ddp.py", 2, tmp_path, "--steps", STEPS, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    s = last_json(res.stdout)
    assert s["world"] == 2 and s["path"] == "ina"
    assert s["bit_identical"], s
    # gloo DDP with fabric.torch.allreduce_hook: the gradients alone on the fabric
    assert s["hook_bit_identical"], s
    # every bucket of every step was reduced in the switch: REDUCE frames came in
    # and chunks completed there; nothing fell back to another path
    assert s["switch_reduce_frames"] >= 2 * int(STEPS), s
    assert s["switch_completions"] >= int(STEPS), s
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []
