"""`semfab bench tokens` (a tiny sweep) and `semfab serve` (started, used, Ctrl-C)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench import tokens as bench_tokens
from fabric.errors import UsageError
from fabric.serving import assets
from fabric.serving import cli as serve_cli

pytestmark = pytest.mark.timeout(150)


def _args(add, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_bench_tokens_small_sweep_writes_json_trace_and_plot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SEMFAB_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = _args(bench_tokens.add_arguments, [
        "--concurrency", "1,3", "--tokens", "24", "--transport", "direct,host-staged",
        "--detok", "immediate,batched", "--batch-tokens", "4", "--step-ms", "4",
        "--prefill-ms", "6", "--backend", "numpy", "--slo", "ttft:500ms,tpot:100ms",
        "--repeat", "2",
        "--json", str(out / "t.json"), "--trace", str(out / "t.trace.json"),
        "--plot", str(out / "itl.png"), "--markdown", str(out / "t.md"),
        "--run-dir", str(tmp_path / "run")])
    assert bench_tokens.run(args) == 0
    text = capsys.readouterr().out
    assert "Time per token in each layer" in text and "Effective experience" in text
    doc = json.loads((out / "t.json").read_text())
    assert doc["kind"] == "tokens" and "versions" in doc["env"]
    rows = doc["results"]
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        assert r["lost_tokens"] == 0 and r["text_mismatches"] == 0 and r["failed"] == 0
        assert r["requests"] == 2 * max(r["concurrency"], 2)  # two repetitions, pooled
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
            assert {"mean", "median", "p50", "p90", "p99", "p99.9"} <= set(r[key])
        for layer in ("generation", "transport", "interpretation", "presentation"):
            assert r["layers_ms"][layer]["p50"] >= 0
        e = r["experience"]
        assert 0 < e["product"] <= 1.5 and e["completion"] == 1
    by = {(r["transport"], r["detok"], r["concurrency"]): r for r in rows}
    direct = by[("direct", "immediate", 3)]["semantic_per_token"]["transport"]
    staged = by[("host-staged", "immediate", 3)]["semantic_per_token"]["transport"]
    assert direct["encodes"] == 0 and staged["encodes"] == 4
    assert staged["crossings"] > direct["crossings"] and staged["hops"] == 2
    # batched detok sends fewer events than tokens
    batched = by[("direct", "batched", 3)]["semantic_per_token"]["presentation"]
    immediate = by[("direct", "immediate", 3)]["semantic_per_token"]["presentation"]
    assert batched["encodes"] < immediate["encodes"]
    trace = json.loads((out / "t.trace.json").read_text())
    assert any(e["ph"] == "s" for e in trace["traceEvents"])
    assert (out / "itl.png").read_bytes()[:4] == b"\x89PNG"
    assert "| strategy " in (out / "t.md").read_text()


def test_bench_tokens_refuses_bad_flags() -> None:
    for argv in (["--transport", "carrier-pigeon"], ["--concurrency", "0"],
                 ["--slo", "speed:9"], ["--tokens", "1"], ["--model", "tiny", "--tp", "3"],
                 ["--model", "tiny", "--ep", "2", "--workers", "3"], ["--tp", "2"],
                 ["--model", "tiny", "--ep", "2", "--concurrency", "129"]):
        with pytest.raises(UsageError):
            bench_tokens.options(_args(bench_tokens.add_arguments, argv))


def test_semfab_serve_prints_the_url_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "SEMFAB_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.serving.cli", "--backend", "numpy", "--step-ms", "2",
         "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    try:
        url = None
        deadline = time.monotonic() + 90
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "base URL:" in line:
                url = line.split("base URL:")[1].strip()
        assert url, "no URL printed"
        body = json.dumps({"model": "semfab-toy", "prompt": "hi", "max_tokens": 5}).encode()
        req = urllib.request.Request(url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    # no node of that fabric is left behind
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "run") not in ps


def test_serve_flags_parse() -> None:
    args = _args(serve_cli.add_arguments, ["--transport", "host-staged", "--detok", "batched",
                                           "--port", "0"])
    assert args.transport == "host-staged" and args.workers is None  # one group: 1 worker
    args = _args(serve_cli.add_arguments, ["--model", "tiny", "--tp", "2", "--ep", "2",
                                           "--moe", "in-network", "--tp-path", "host-ring"])
    assert (args.model, args.tp, args.ep, args.pp, args.moe, args.tp_path) == \
        ("tiny", 2, 2, 1, "in-network", "host-ring")


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_serve_reports_a_port_in_use_at_once(tmp_path: Path) -> None:
    with _listening() as busy:
        port = busy.getsockname()[1]
        env = {**os.environ, "SEMFAB_CACHE_DIR": str(tmp_path / "cache"),
               "SEMFAB_RUN_DIR": str(tmp_path / "runs")}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "fabric", "serve", "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=60)
        took = time.monotonic() - t0
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"semfab: error: port {port} is in use on 127.0.0.1")
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout
    assert not (tmp_path / "runs").exists()  # refused before anything was launched
    assert took < 20


def test_a_port_taken_after_the_check_fails_the_chain_in_one_line(tmp_path: Path) -> None:
    from fabric.serving.config import ServeConfig
    from fabric.serving.runner import ServingChain

    with _listening() as busy:
        port = busy.getsockname()[1]
        cfg = ServeConfig(port=port, backend="numpy", step_ms=2,
                          assets_dir=str(assets.ensure_assets(tmp_path / "cache")))
        with pytest.raises(UsageError, match=f"^port {port} is in use on 127.0.0.1"):
            ServingChain(cfg, workers=1, run_dir=tmp_path / "run", timeout_s=20).start()
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "run") not in ps
