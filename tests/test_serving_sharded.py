"""A sharded model behind the OpenAI URL (fabric.serving.sharded): a group of
workers is one generator, and its text is exactly the unsharded model's."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fabric.core.decoder import TinyWeights, generate_reference
from fabric.core.model import get_model
from fabric.emulation.launcher import Fabric
from fabric.serving import assets
from fabric.serving.config import ServeConfig
from fabric.serving.runner import ServingChain, launch_for

pytestmark = pytest.mark.timeout(180)

openai = pytest.importorskip("openai")

# (prompt, max_tokens): several lengths, so sequences join and leave a running batch
REQUESTS = [("Hello there", 12), ("The switch sums the contributions", 20), ("数据中心", 7),
            ("a", 16), ("Tokens stream to the client one by one", 9), ("", 5)]


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    # switch + 4 workers + host0: 6 processes beside pytest
    f = launch_for(["direct"], 4, run_dir=tmp_path_factory.mktemp("fab"), timeout_s=30)
    try:
        yield f
    finally:
        f.close()
    assert all(code is not None for code in f.exit_codes().values())


@contextlib.contextmanager
def chain(fab: Fabric, assets_dir: Path, **kw: Any) -> Iterator[ServingChain]:
    cfg = ServeConfig(model="tiny", record=True, assets_dir=str(assets_dir), step_ms=0.0,
                      prefill_ms=0.0, temperature=0.0, **kw)
    ch = ServingChain(cfg, fabric=fab, timeout_s=30).start()
    try:
        yield ch
    finally:
        ch.close()


def unsharded_text(tokenizer: Any, vocab: np.ndarray, prompt: str, n: int) -> str:
    """What the unsharded model says, computed here: the prompt's ids folded into the
    model's vocabulary, the reference decoder, the ids back to text."""
    ids = tokenizer.encode(prompt).ids[-256:]
    toks = generate_reference(TinyWeights(get_model("tiny"), seed=0),
                              [[i % 512 for i in ids] or [0]], n)[0]
    return str(tokenizer.decode(vocab[np.array(toks)].tolist()))


def ask_all(url: str) -> list[str]:
    """Every request at once (threads), each a greedy completion; their texts."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def one(req: tuple[str, int]) -> str:
        r = client.completions.create(model="tiny", prompt=req[0], max_tokens=req[1],
                                      temperature=0)
        return str(r.choices[0].text)

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


def test_tp2_ep2_answers_with_exactly_the_unsharded_text(fab: Fabric, assets_dir: Path,
                                                         tokenizer: Any) -> None:
    vocab = assets.model_vocab(assets_dir, 512)
    want = [unsharded_text(tokenizer, vocab, p, n) for p, n in REQUESTS]
    assert len(set(want)) == len(want)  # the prompts lead to different text
    got = {}
    for tp, ep in ((1, 1), (2, 2)):  # (1, 1) on 4 workers: 4 data-parallel generators
        with chain(fab, assets_dir, tp=tp, ep=ep) as ch:
            got[tp, ep] = ask_all(ch.url)
            res = ch.stop()
        counters = res["host"]["counters"]
        assert counters["completed"] == len(REQUESTS) and counters["gap_tokens"] == 0
        workers = res["workers"]
        if (tp, ep) == (2, 2):
            roles = sorted((w["role"]["replica"], w["role"]["tp_rank"]) for w in workers)
            assert roles == [(0, 0), (0, 1), (1, 0), (1, 1)]
            emitted = sum(w["tokens"] for w in workers)
            assert emitted == sum(n for _p, n in REQUESTS)  # each token sent once
            assert all(w["tokens"] == 0 for w in workers if not w["role"]["emitter"])
            leader = next(w for w in workers if w["role"]["leader"])
            parts = leader["parts"]
            assert parts and all({"tp", "dispatch", "combine", "step"} <= set(p)
                                 for p in parts if not p["prefill"])
    assert got[1, 1] == want
    assert got[2, 2] == want


@pytest.mark.parametrize("layout", [dict(ep=2, pp=2, moe="in-network"),
                                    dict(tp=4, tp_path="host-ring")])
def test_pipeline_stages_and_other_paths_give_the_same_text(fab: Fabric, assets_dir: Path,
                                                            tokenizer: Any,
                                                            layout: dict[str, Any]) -> None:
    vocab = assets.model_vocab(assets_dir, 512)
    with chain(fab, assets_dir, **layout) as ch:
        got = ask_all(ch.url)
        res = ch.stop()
    assert got == [unsharded_text(tokenizer, vocab, p, n) for p, n in REQUESTS]
    assert res["host"]["counters"]["completed"] == len(REQUESTS)


def test_an_aborted_stream_leaves_the_group_serving(fab: Fabric, assets_dir: Path,
                                                    tokenizer: Any) -> None:
    vocab = assets.model_vocab(assets_dir, 512)
    with chain(fab, assets_dir, tp=2, ep=2) as ch:
        client = openai.OpenAI(base_url=ch.url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="long", max_tokens=400,
                                           temperature=0, stream=True)
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the host aborts the request: the leader takes it out of the batch
        r = client.completions.create(model="tiny", prompt="after", max_tokens=10,
                                      temperature=0)
        assert r.choices[0].text == unsharded_text(tokenizer, vocab, "after", 10)
        res = ch.stop()
    assert res["host"]["counters"]["aborted"] == 1
    assert sum(len(w["aborted"]) for w in res["workers"]) == 1


@pytest.mark.parametrize("args,says", [
    (["--model", "tiny", "--tp", "3"], "does not divide"),
    (["--model", "tiny", "--ep", "3"], "does not divide"),
    (["--model", "mixtral-8x7b"], "timed only"),
    (["--tp", "2"], "shard a model preset"),
    (["--model", "tiny", "--tp", "2", "--workers", "3"], "multiple of 2"),
])
def test_serve_refuses_a_layout_that_cannot_run_in_one_line(args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "fabric.cli", "serve", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bench_tokens_splits_the_sharded_step_per_token(tmp_path: Path) -> None:
    """`semfab bench tokens --model tiny --tp 2`: every text exact, and the step's parts
    (its own work and each wait) per token in the JSON, adding up to the step."""
    import json

    from bench import tokens as bench_tokens
    from bench.step_split import STEP_PARTS

    out = tmp_path / "t.json"
    p = bench_tokens.argparse.ArgumentParser()
    bench_tokens.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--tp", "2", "--concurrency", "1,4", "--tokens",
                         "12", "--transport", "direct", "--detok", "immediate",
                         "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert bench_tokens.run(args) == 0
    doc = json.loads(out.read_text())
    assert (doc["params"]["workers"], doc["params"]["step_ms"]) == (2, 0.0)
    for r in doc["results"]:
        assert r["lost_tokens"] == 0 and r["text_mismatches"] == 0 and r["failed"] == 0
        parts = r["parts_ms"]
        assert {"compute", "tp", "dispatch", "combine", "pp", "plan", "transport",
                "interpretation", "presentation"} <= set(parts)
        assert parts["tp"]["mean"] > 0 and parts["dispatch"]["mean"] == 0  # tp 2, ep 1
        total = sum(parts[k]["mean"] for k in STEP_PARTS)
        assert total == pytest.approx(r["step_ms_per_token"]["mean"], rel=1e-6)
        assert r["collectives"]["ops"] > 0
