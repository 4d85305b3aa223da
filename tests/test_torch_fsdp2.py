"""FSDP2 over the semfab backend against gloo (examples/torch_fsdp2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun

pytest.importorskip("torch")


def test_fsdp2_matches_gloo_bit_for_bit(tmp_path: Path) -> None:
    # all_gather_into_tensor (input a view of its output) and reduce_scatter_tensor
    # on the fabric's ina paths; two ranks, so every sum has gloo's bits
    res = torchrun("examples/torch_fsdp2.py", 2, tmp_path, "--steps", "4", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    s = last_json(res.stdout)
    assert s["bit_identical"], s
    assert s["switch_reduce_frames"] > 0, s  # gradients reduce-scattered in the switch
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []
