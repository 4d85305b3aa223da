"""The runnable model sharded over the fabric (fabric.core.decode_workload): every
layout, MoE variant and world gives exactly the unsharded model's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.decode_workload import sharded_decode
from fabric.core.decoder import TinyWeights, generate_reference, rescale
from fabric.core.model import get_model
from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.sim import Simulation
from fabric.sim.engine import SimulationError

PROMPTS = [[1, 2, 3], [7, 8], [100, 200, 300, 400], [5], [9, 9], [11, 12, 13], [42], [77, 78]]


def _tokens(results: list[dict[int, list[int]]]) -> list[list[int]]:
    got: dict[int, list[int]] = {}
    for d in results:
        for seq, toks in d.items():  # a replica's TP ranks agree on its sequences
            assert got.setdefault(seq, toks) == toks, seq
    return [got[i] for i in range(len(got))]


@pytest.mark.parametrize("tp,ep,variant", [(2, 4, "flat"), (2, 4, "in-network"),
                                           (1, 4, "hierarchical"), (4, 2, "flat"),
                                           (4, 1, "flat")])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sharded_tokens_are_the_unsharded_ones_in_simulation(tp: int, ep: int, variant: str,
                                                             temperature: float) -> None:
    w = TinyWeights(get_model("tiny"), seed=5)
    want = generate_reference(w, PROMPTS, 5, temperature, seed=11)
    n = tp * ep
    topo = star(n, bandwidth_gbps=10) if variant == "flat" else leaf_spine(
        2, n // 2, leaf_bandwidth_gbps=10)
    r = Simulation(topo, timeout_s=60).run(sharded_decode, "tiny", tp, ep, PROMPTS, 5,
                                           temperature=temperature, seed=11, weights_seed=5,
                                           variant=variant)
    assert _tokens(r.results) == want
    assert len({tuple(t) for t in want}) > 1  # the prompts lead to different tokens


def test_tp2_ep2_on_four_emulated_workers_gives_the_unsharded_tokens(tmp_path) -> None:
    want = generate_reference(TinyWeights(get_model("tiny")), PROMPTS[:4], 4)
    with launch(workers=4, run_dir=tmp_path, timeout_s=60) as fab:
        res = fab.run(run_in_emulation, sharded_decode, "tiny", 2, 2, PROMPTS[:4], 4)
    assert _tokens(res) == want


def test_the_reference_is_not_trivially_stable() -> None:
    """Different weights or prompts change the tokens; the fixed point's rounding
    is half up and exact on integers."""
    m = get_model("tiny")
    a = generate_reference(TinyWeights(m, seed=1), PROMPTS[:2], 4)
    b = generate_reference(TinyWeights(m, seed=2), PROMPTS[:2], 4)
    assert a != b
    assert rescale(np.array([3, 4, -3, -4, 5]), 1).tolist() == [2, 2, -1, -2, 3]


def test_layouts_that_do_not_fit_are_refused() -> None:
    for n, tp, ep, prompts, words in [
            (4, 2, 4, PROMPTS, "tp 2 x ep 4 needs 8 workers, the fabric has 4"),
            (3, 1, 3, PROMPTS, "--ep 3 does not divide tiny's 4 experts"),
            (4, 1, 4, PROMPTS[:2], "need at least one non-empty prompt per replica")]:
        with pytest.raises(SimulationError, match=f"UsageError: {words}"):
            Simulation(star(n)).run(sharded_decode, "tiny", tp, ep, prompts, 2)
