"""The runnable model sharded over the fabric (fabric.core.decode_workload): every
layout, MoE variant and world gives exactly the unsharded model's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.decode_workload import PARTS, sharded_decode
from fabric.core.decoder import TinyWeights, generate_reference, rescale
from fabric.core.model import get_model
from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.sim import Simulation
from fabric.sim.engine import SimulationError

PROMPTS = [[1, 2, 3], [7, 8], [100, 200, 300, 400], [5], [9, 9], [11, 12, 13], [42], [77, 78]]


def _tokens(results: list[dict]) -> list[list[int]]:
    got: dict[int, list[int]] = {}
    for res in results:
        for seq, toks in res["tokens"].items():  # a replica's TP ranks agree on its sequences
            assert got.setdefault(seq, toks) == toks, seq
    return [got[i] for i in range(len(got))]


@pytest.mark.parametrize("tp,ep,pp,variant", [(2, 4, 1, "flat"), (2, 4, 1, "in-network"),
                                              (1, 4, 1, "hierarchical"), (4, 2, 1, "flat"),
                                              (4, 1, 1, "flat"), (2, 2, 2, "flat")])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sharded_tokens_are_the_unsharded_ones_in_simulation(tp: int, ep: int, pp: int,
                                                             variant: str,
                                                             temperature: float) -> None:
    w = TinyWeights(get_model("tiny"), seed=5)
    want = generate_reference(w, PROMPTS, 5, temperature, seed=11)
    n = tp * ep * pp
    topo = star(n, bandwidth_gbps=10) if variant == "flat" else leaf_spine(
        2, n // 2, leaf_bandwidth_gbps=10)
    r = Simulation(topo, timeout_s=60).run(sharded_decode, "tiny", tp, ep, PROMPTS, 5, pp=pp,
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
            (4, 2, 4, PROMPTS, "pp 1 x ep 4 x tp 2 needs 8 workers, the fabric has 4"),
            (3, 1, 3, PROMPTS, "--ep 3 does not divide tiny's 4 experts"),
            (4, 1, 4, PROMPTS[:2], "need at least one non-empty prompt per replica")]:
        with pytest.raises(SimulationError, match=f"UsageError: {words}"):
            Simulation(star(n)).run(sharded_decode, "tiny", tp, ep, prompts, 2)


def test_timing_only_steps_split_into_parts_that_add_up() -> None:
    """mixtral-8x7b timing-only on 8 simulated GPUs (TP 2 x EP 4) of 25 Gb/s: every
    step's parts (compute charged from the cost model, the TP allreduces, dispatch,
    combine) add up to the step on every rank, and each part is there."""
    topo = star(8, bandwidth_gbps=25, latency_us=2)
    r = Simulation(topo, timeout_s=120).run(sharded_decode, "mixtral-8x7b", 2, 4, [[1]] * 16,
                                            3, data=False, gpu="h100", context=1024)
    for res in r.results:
        assert len(res["steps"]) == 3
        for step in res["steps"]:
            parts = sum(step.get(p, 0.0) for p in PARTS)
            assert parts == pytest.approx(step["step"], rel=0.05)
            assert all(step.get(p, 0.0) > 0 for p in ("compute", "tp", "dispatch", "combine"))
    assert r.results[0]["tokens"] == {q: [0, 0, 0] for q in range(0, 16, 4)}


def test_a_checkpoint_burst_beside_the_decode_leaves_its_tokens_exact() -> None:
    """Twice the world: even ranks decode (the layout), odd ranks exchange 2 MB
    across the spine; the tokens are the unsharded ones and each odd rank reports
    its burst's time."""
    want = generate_reference(TinyWeights(get_model("tiny")), PROMPTS, 3)
    t = leaf_spine(2, 8, oversubscription=4, leaf_bandwidth_gbps=10, leaf_latency_us=1,
                   spine_latency_us=1)
    r = Simulation(t, timeout_s=60).run(sharded_decode, "tiny", 2, 4, PROMPTS, 3,
                                        background_bytes=2_000_000)
    assert _tokens([x for x in r.results if "steps" in x]) == want
    bursts = [x["background_s"] for x in r.results[1::2]]
    assert len(bursts) == 8 and min(bursts) > 2_000_000 * 8 / 10e9
    with pytest.raises(SimulationError, match="an even number of GPUs, not 1"):
        Simulation(star(2)).run(sharded_decode, "tiny", 1, 1, [[1]], 1, background_bytes=10)
