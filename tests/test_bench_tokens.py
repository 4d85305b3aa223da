"""`semfab bench tokens` as a client of any OpenAI-compatible server, against a real
`semfab serve` started on its own (seed, temperature, /metrics, stats, run folders)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import tokens as bench_tokens
from fabric.errors import UsageError
from fabric.serving import assets, dataset, metrics

pytestmark = pytest.mark.timeout(150)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_tokens.add_arguments(p)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    port: int
    runs: Path  # its SEMFAB_RUN_DIR
    env: dict[str, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`semfab serve` in its own process group on a free port; always stopped."""
    tmp = tmp_path_factory.mktemp("serve")
    runs = tmp / "runs"
    env = {**os.environ, "SEMFAB_CACHE_DIR": str(tmp / "cache"), "SEMFAB_RUN_DIR": str(runs),
           "SEMFAB_NO_PROGRESS": "1"}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "serve", "--backend", "numpy", "--step-ms", "3",
         "--prefill-ms", "5", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        up = False
        while not up and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            up = "base URL:" in line
        assert up, f"semfab serve did not come up (exit {proc.poll()})"
        yield Server(f"http://127.0.0.1:{port}", port, runs, env)
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler (or `timeout`) stops it
        assert proc.wait(30) == 0
        assert not any(runs.iterdir()), "a clean stop removes its run folder"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _text(base: str, **kw: Any) -> str:
    body = {"model": "semfab-toy", "prompt": "Tell me about the weather", "max_tokens": 24,
            **kw}
    return str(_post(base, body)["choices"][0]["text"])


# --------------------------------------------------------------------- against a server
def test_bench_tokens_base_url_measures_a_server_it_did_not_start(
        server: Server, tmp_path: Path) -> None:
    out = tmp_path / "ext.json"
    env = {**server.env, "SEMFAB_RUN_DIR": str(tmp_path / "bench-runs")}
    proc = subprocess.run(
        [sys.executable, "-m", "fabric", "bench", "tokens", "--base-url", server.base + "/v1",
         "--model", "semfab-toy", "--num-prompts", "8", "--request-rate", "20", "--tokens",
         "16", "--dataset", "sonnet", "--input-len", "24", "--metric-percentiles", "50,90,99",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "client only; no fabric launched" in text
    assert "Serving Benchmark Result" in text and "Successful requests:" in text
    for line in ("Mean TTFT (ms):", "Median TPOT (ms):", "P90 ITL (ms):", "P99 E2EL (ms):",
                 "Total Token throughput (tok/s):", "Input token throughput (tok/s):"):
        assert line in text
    assert "warning: p99 rests on fewer than 100 samples" in text  # 8 requests
    assert not (tmp_path / "bench-runs").exists()  # a pure client launches nothing
    doc = json.loads(out.read_text())
    params = doc["params"]
    assert params["base_url"] == server.base and params["request_rate"] == "20"
    assert params["burstiness"] == 1.0 and params["seed"] == 0 and params["num_prompts"] == 8
    (row,) = doc["results"]
    assert row["completed"] == 8 and row["failed"] == 0 and row["request_rate"] == 20
    assert row["concurrency"] is None and row["model"] == "semfab-toy"
    per = row["per_request"]
    for key in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "input_lens", "output_lens",
                "start_ms"):
        assert len(per[key]) == 8, key
    assert per["output_lens"] == [16] * 8
    assert all(itl for itl in per["itl_ms"]) and all(x > 0 for x in per["ttft_ms"])
    assert row["input_tokens_from"] == "server" and min(per["input_lens"]) > 0
    assert row["total_input_tokens"] == sum(per["input_lens"])
    assert row["total_output_tokens"] == 8 * 16
    assert row["total_throughput_tok_s"] == pytest.approx(
        row["input_throughput_tok_s"] + row["output_throughput_tok_s"])
    assert max(per["start_ms"]) > 50  # an open loop: requests were spread out
    for key in ("p50_ttft_ms", "p90_itl_ms", "p99_e2el_ms", "mean_tpot_ms", "median_ttft_ms"):
        assert math.isfinite(row[key]), key
    assert row["warnings"] and row["goodput_req_s"] is not None


def test_a_server_that_refuses_the_first_request_is_one_line(server: Server) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fabric", "bench", "tokens", "--base-url", server.base,
         "--model", "no-such-model", "--num-prompts", "2"],
        capture_output=True, text=True, env=server.env, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"semfab: error: the first request to {server.base} failed")
    assert "model_not_found" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_seed_and_temperature_are_honoured(server: Server) -> None:
    a = _text(server.base, seed=7, temperature=1.0)
    assert _text(server.base, seed=7, temperature=1.0) == a  # same seed, same text
    assert _text(server.base, seed=8, temperature=1.0) != a  # another seed, another text
    g = _text(server.base, seed=1, temperature=0)
    assert _text(server.base, seed=2, temperature=0) == g  # greedy: the seed changes nothing
    # a seeded request's text does not depend on who shares the batch
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_text, server.base, temperature=1.0) for _ in range(3)]
        busy = pool.submit(_text, server.base, seed=7, temperature=1.0)
        assert busy.result() == a
        for f in others:
            f.result()
    with pytest.raises(urllib.error.HTTPError) as err:
        _text(server.base, seed="seven")
    assert err.value.code == 400


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


def test_metrics_endpoint_serves_prometheus_text(server: Server) -> None:
    body = {"model": "semfab-toy", "prompt": "hi", "max_tokens": 24, "stream": True}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.read().endswith(b"data: [DONE]\n\n")
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = resp.read().decode()
    samples: dict[str, float] = {}
    types = {}
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"not an exposition line: {line!r}"
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    assert types["semfab_layer_latency_seconds"] == "histogram"
    assert types["semfab_requests_total"] == "counter"
    for layer in ("generation", "transport", "interpretation", "presentation"):
        buckets = [v for k, v in samples.items()
                   if k.startswith(f'semfab_layer_latency_seconds_bucket{{layer="{layer}"')]
        assert buckets == sorted(buckets) and buckets[-1] > 0, layer  # cumulative
        count = samples[f'semfab_layer_latency_seconds_count{{layer="{layer}"}}']
        assert samples[f'semfab_layer_latency_seconds_bucket{{layer="{layer}",le="+Inf"}}'] \
            == count
    assert samples['semfab_requests_total{outcome="completed"}'] >= 1
    assert samples["semfab_time_to_first_token_seconds_count"] >= 1
    assert samples["semfab_generation_tokens_total"] >= 24
    assert samples["semfab_prompt_tokens_total"] > 0


def test_stats_finds_the_fabric_of_a_running_server(server: Server, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fabric", "stats"], capture_output=True,
                          text=True, env=server.env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sw0: up")
    # a run folder whose launcher is gone is not a running fabric
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "runs" / "stale"
    stale.mkdir(parents=True)
    (stale / "fabric.json").write_text(json.dumps(
        {"pid": dead.pid, "sock_dir": str(tmp_path), "switches": {}}))
    env = {**server.env, "SEMFAB_RUN_DIR": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, "-m", "fabric", "stats"], capture_output=True,
                          text=True, env=env, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("semfab: error: no fabric is running")
    assert len(proc.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------- our own chain
def test_own_chain_open_loop_with_a_dataset_and_run_folder_cleanup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SEMFAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SEMFAB_RUN_DIR", str(tmp_path / "runs"))
    out = tmp_path / "t.json"
    args = _args(["--transport", "direct", "--detok", "immediate", "--tokens", "8",
                  "--request-rate", "40", "--num-prompts", "4", "--dataset", "random",
                  "--input-len", "12", "--step-ms", "3", "--prefill-ms", "4", "--backend",
                  "numpy", "--metric-percentiles", "50,99", "--json", str(out)])
    assert bench_tokens.run(args) == 0
    text = capsys.readouterr().out
    assert "| direct+immediate | 40/s |" in re.sub(" +", " ", text) and "TTFT p99" in text
    assert "fabric logs removed" in text
    assert not any((tmp_path / "runs").iterdir())  # removed after the clean run
    (row,) = json.loads(out.read_text())["results"]
    assert row["completed"] == 4 and row["lost_tokens"] == 0 and row["text_mismatches"] == 0
    assert row["request_rate"] == 40 and row["dataset"] == "random"
    assert min(row["per_request"]["input_lens"]) >= 12
    assert row["layers_ms"]["transport"]["p50"] >= 0


# --------------------------------------------------------------------- flags and pieces
def test_base_url_refuses_flags_of_our_own_chain_and_bad_load() -> None:
    with pytest.raises(UsageError, match="--transport, --step-ms set up semfab's own chain"):
        bench_tokens.options(_args(["--base-url", "http://x:1", "--transport", "direct",
                                    "--step-ms", "2"]))
    for argv, match in ((["--base-url", "ftp://x"], "http:// or https://"),
                        (["--request-rate", "0"], "must be at least 0.001"),
                        (["--request-rate", "fast"], "numbers or inf"),
                        (["--burstiness", "0"], "--burstiness"),
                        (["--metric-percentiles", "100"], "between 0 and 100"),
                        (["--percentile-metrics", "ttft,speed"], "unknown metric speed"),
                        (["--input-len", "0"], "--input-len")):
        with pytest.raises(UsageError, match=match):
            bench_tokens.options(_args(argv))
    assert bench_tokens.normalize_base_url("http://h:8000/v1/") == "http://h:8000"


def test_unreachable_base_url_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    proc = subprocess.run([sys.executable, "-m", "fabric", "bench", "tokens", "--base-url",
                           f"http://127.0.0.1:{port}", "--num-prompts", "2"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SEMFAB_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.startswith("semfab: error: --base-url") and "cannot connect" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_load_levels() -> None:
    closed = bench_tokens.options(_args([])).levels
    assert [(lv.rate, lv.concurrency, lv.num_prompts) for lv in closed] == \
        [(math.inf, 1, 2), (math.inf, 8, 8), (math.inf, 32, 32)]
    (open_,) = bench_tokens.options(_args(["--request-rate", "20"])).levels
    assert (open_.rate, open_.concurrency, open_.num_prompts) == (20, None, 100)
    assert open_.label == "20/s"
    capped = bench_tokens.options(_args(["--request-rate", "5,inf", "--concurrency", "4",
                                         "--num-prompts", "6"])).levels
    assert [(lv.rate, lv.concurrency, lv.num_prompts, lv.label) for lv in capped] == \
        [(5, 4, 6, "5/s c=4"), (math.inf, 4, 6, "c=4")]


def test_arrival_times_follow_a_gamma_process() -> None:
    assert dataset.arrival_times(4, math.inf).tolist() == [0, 0, 0, 0]
    t = dataset.arrival_times(4001, 20.0, 1.0, seed=3)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0, rel=0.1)  # Poisson: CV² = 1
    bursty = np.diff(dataset.arrival_times(4001, 20.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)  # CV² = 1/B
    assert np.array_equal(t, dataset.arrival_times(4001, 20.0, 1.0, seed=3))


def test_datasets_are_seeded_and_sized(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = assets.load_tokenizer(assets.ensure_assets(tmp_path_factory.mktemp("cache")))
    for name in dataset.DATASETS:
        a = dataset.make_prompts(name, 5, 11, tok, 40)
        assert a == dataset.make_prompts(name, 5, 11, tok, 40)
        assert a != dataset.make_prompts(name, 5, 12, tok, 40)
        for p in a:
            assert p.input_len == len(tok.encode(p.text).ids)
            assert 30 <= p.input_len <= 80, (name, p)
    sonnet = dataset.make_prompts("sonnet", 3, 0, tok)
    lines = set(dataset.SONNETS.read_text().splitlines())
    for p in sonnet:
        head, *body = p.text.rstrip("\n").split("\n")
        assert head + "\n" == dataset.SONNET_PREFIX and body and set(body) <= lines
    assert all(len(p.text) <= 200 for p in dataset.make_prompts("corpus", 5, 0, tok))


def test_thin_percentiles_warn_on_a_handful_of_samples() -> None:
    w = metrics.thin_percentiles({"ttft": 8, "itl": 120}, [50, 99])
    assert len(w) == 1 and w[0].startswith("p99 rests on fewer than 100 samples for TTFT (8)")
    assert metrics.thin_percentiles({"ttft": 100}, [99]) == []
    assert metrics.thin_percentiles({"ttft": 999}, [99.9])
    assert metrics.thin_percentiles({"ttft": 1}, [50])
    s = metrics.stats([1.0, 2.0, 3.0, 4.0], [25, 75])
    assert s["p25"] == 1.75 and s["p75"] == 3.25 and s["median"] == 2.5
