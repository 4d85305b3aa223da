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


def test_a_prompt_fed_in_one_call_attends_as_token_by_token() -> None:
    """Rows of several tokens per sequence (a batched prefill) give bit for bit the
    rows a token per call gives, whatever the other sequences in the call."""
    from fabric.core.decoder import KvCache, attention_partial

    w = TinyWeights(get_model("tiny"), seed=3)
    rng = np.random.default_rng(7)
    xn = rng.integers(-(1 << 12), 1 << 12, (6, 64)).astype(np.int64)
    one = KvCache()
    want = [attention_partial(w, 0, xn[i:i + 1], one, 2, 1, [0], [1]) for i in range(4)]
    want.append(attention_partial(w, 0, xn[4:5], one, 2, 1, [9], [1]))
    want.append(attention_partial(w, 0, xn[5:6], one, 2, 1, [0], [1]))
    many = KvCache()
    first = attention_partial(w, 0, xn[:5], many, 2, 1, [0, 9], [4, 1])
    second = attention_partial(w, 0, xn[5:6], many, 2, 1, [0], [1])
    np.testing.assert_array_equal(np.concatenate([first, second]), np.concatenate(want))
    assert many.length(0) == 5 and many.length(9) == 1
    many.drop(0)
    assert many.length(0) == 0 and many.length(9) == 1


def _continuous(ctx, tp: int, ep: int, arrivals: list[tuple[int, int, list[int], int, float]],
                steps: int):
    """Sequences join (whole prompt in one step) and leave a running batch; a replica
    may be empty while the others step."""
    from fabric.core.decode_workload import DecodeShard

    shard = DecodeShard(ctx, get_model("tiny"), tp, ep, 1, ctx.rank, weights_seed=4)
    yield from shard.open()
    live: dict[int, dict] = {}
    done: dict[int, list[int]] = {}
    for step in range(steps):
        for i, (at, replica, prompt, n, temp) in enumerate(arrivals):
            if at == step and replica == shard.e:
                live[i] = {"feed": list(prompt), "pos": len(prompt) - 1, "left": n,
                           "temp": temp, "out": []}
        ids = sorted(live)
        counts = np.array([len(live[i]["feed"]) for i in ids], np.int64)
        feed = np.array([t for i in ids for t in live[i]["feed"]], np.int64)
        new = yield from shard.step(
            counts, feed, ids, np.zeros(len(ids), np.int64),
            np.array([live[i]["pos"] for i in ids], np.int64),
            np.array([live[i]["temp"] for i in ids]), np.full(len(ids), 13, np.uint64),
            index=step, batch=int(counts.sum()), prefill=any(c > 1 for c in counts))
        for j, i in enumerate(ids):
            s = live[i]
            s["out"].append(int(new[j]))
            s["feed"], s["pos"], s["left"] = [int(new[j])], s["pos"] + 1, s["left"] - 1
            if s["left"] == 0:
                done[i] = live.pop(i)["out"]
                shard.cache.drop(i)
    yield from shard.close()
    return done


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (1, 4)])
def test_continuous_batching_gives_each_sequence_its_unsharded_tokens(tp: int,
                                                                      ep: int) -> None:
    w = TinyWeights(get_model("tiny"), seed=4)
    arrivals = [(0, 0, [1, 2, 3], 4, 0.0), (1, 0, [7, 8], 3, 0.8), (2, ep - 1, [5], 5, 0.0),
                (2, 0, [100, 200, 300, 400], 2, 0.0), (4, ep // 2, [9, 9], 3, 1.1)]
    r = Simulation(star(tp * ep, bandwidth_gbps=10), timeout_s=60).run(
        _continuous, tp, ep, arrivals, 8)
    got: dict[int, list[int]] = {}
    for res in r.results:
        for i, toks in res.items():
            assert got.setdefault(i, toks) == toks  # a replica's TP ranks agree
    assert sorted(got) == list(range(len(arrivals)))
    for i, (_at, _rep, prompt, n, temp) in enumerate(arrivals):
        assert got[i] == generate_reference(w, [prompt], n, temp, seed=13)[0], i


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_numba_attention_kernel_gives_the_same_tokens(temperature: float) -> None:
    """The unsharded model with the numba-cpu backend's attention and with the NumPy
    reference's: the same tokens (the kernel's conformance is in test_kernels)."""
    from kernels import get_backend

    w = TinyWeights(get_model("tiny"), seed=3)
    kernel = get_backend("numba-cpu").attention_fixed
    want = generate_reference(w, PROMPTS, 6, temperature, seed=4)
    assert generate_reference(w, PROMPTS, 6, temperature, seed=4, kernel=kernel) == want
