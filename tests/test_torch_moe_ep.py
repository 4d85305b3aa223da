"""An expert-parallel MoE layer over the semfab backend against gloo
(examples/torch_moe_ep.py): uneven all_to_all_single forward and backward, the
gate's gradients averaged with fixed-point numerics, on 3 ranks (where the order
of a sum matters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun

pytest.importorskip("torch")


def test_moe_ep_on_three_ranks_matches_gloo_within_rounding(tmp_path: Path) -> None:
    res = torchrun("examples/torch_moe_ep.py", 3, tmp_path, "--steps", "4", "--json",
                   SEMFAB_NUMERICS="fixed")
    assert res.returncode == 0, res.stderr[-3000:]
    s = last_json(res.stdout)
    assert s["world"] == 3 and s["numerics"] == "fixed", s
    # tokens move bit for bit; the gate's averaged gradients differ from gloo's sums
    # by the fixed-point quantisation at most (a few float32 ulps after 4 steps)
    assert s["max_abs_diff"] < 1e-6, s
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []
