"""An expert-parallel MoE layer over the semfab backend against gloo
(examples/torch_moe_ep.py): uneven all_to_all_single, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun

pytest.importorskip("torch")


def test_moe_ep_matches_gloo_bit_for_bit(tmp_path: Path) -> None:
    res = torchrun("examples/torch_moe_ep.py", 2, tmp_path, "--steps", "4", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    s = last_json(res.stdout)
    assert s["world"] == 2 and s["bit_identical"], s
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []
