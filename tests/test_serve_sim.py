"""`semfab bench tokens --sim` (bench.serve_sim): the serving loop in virtual time,
the client side modelled, rows like the emulated benchmark's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tokens as bench_tokens


def _main(argv: list[str]) -> int:
    return bench_tokens.main(argv)


def test_sim_rows_have_client_metrics_and_the_step_split(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    topo = tmp_path / "c.toml"
    subprocess.run([sys.executable, "-m", "fabric.cli", "topo", "gen", "--cluster", "2",
                    "--gpus-per-domain", "2", "-o", str(topo)], check=True, timeout=60)
    out = tmp_path / "s.json"
    assert _main(["--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "2", "--layers",
                  "2", "--topology", str(topo), "--concurrency", "1,4", "--num-prompts", "6",
                  "--tokens", "6", "--input-len", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| c=1 |" in text and "| c=4 |" in text
    doc = json.loads(out.read_text())
    assert doc["params"]["frontend_s"] > 0  # the cluster's links from w0 to host0
    rows = doc["results"]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 36
        assert r["itl_ms"]["median"] > 0 and r["ttft_ms"]["median"] > r["itl_ms"]["median"]
        assert r["parts_ms"]["dispatch"]["mean"] > 0 and r["parts_ms"]["tp"]["mean"] > 0
        assert r["step_over_itl"] == pytest.approx(1.0, rel=0.05)
        assert 0 < r["experience"]["compute"] <= 1
        assert r["kb_per_token_by_class"]["scaleup"] > 0  # TP inside a domain
        # the tokens go to host0 as frames: a step's records and their ACK on the
        # front-end's link, each way at least the path's time
        assert r["tokens_as_frames"] and r["kb_per_token_by_class"]["frontend"] > 0
        assert r["semantic_per_token_by_class"]["frontend"]["crossings"] > 0
        assert r["parts_ms"]["transport"]["p50"] >= doc["params"]["frontend_s"] * 1e3 * 0.999
    by = {r["concurrency"]: r for r in rows}
    assert by[4]["output_throughput_tok_s"] > by[1]["output_throughput_tok_s"]


def test_sim_runs_data_parallel_generators_from_workers(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """--workers 8 of tp 2 x ep 2: two generators, each serving half of the requests;
    the same load on one generator queues more per step."""
    rows = {}
    for workers in (4, 8):
        out = tmp_path / f"w{workers}.json"
        assert _main(["--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "2",
                      "--workers", str(workers), "--layers", "1", "--concurrency", "8",
                      "--num-prompts", "16", "--tokens", "4", "--input-len", "16",
                      "--json", str(out)]) == 0
        rows[workers] = json.loads(out.read_text())["results"][0]
    assert "2 generators of tp 2 x ep 2" in capsys.readouterr().out
    one, two = rows[4], rows[8]
    assert (one["dp"], two["dp"]) == (1, 2) and two["gpus"] == 8
    for r in (one, two):
        assert r["completed"] == 16 and r["total_output_tokens"] == 64
        assert r["step_over_itl"] == pytest.approx(1.0, rel=0.05)
    assert two["itl_ms"]["median"] < one["itl_ms"]["median"]  # half the batch per step
    assert two["output_throughput_tok_s"] > one["output_throughput_tok_s"]


@pytest.mark.parametrize("argv,says", [
    (["--sim"], "--sim serves a model preset"),
    (["--sim", "--model", "tiny", "--tp", "3"], "does not divide"),
    (["--sim", "--model", "tiny", "--tp", "2", "--workers", "3"], "a multiple of tp x ep x pp"),
    (["--sim", "--model", "tiny", "--gpu", "b300"], "--gpu"),
    (["--sim", "--model", "tiny", "--base-url", "http://127.0.0.1:9"], "--base-url"),
    (["--sim", "--model", "tiny", "--topology", "/nonexistent.toml"], "--topology"),
    (["--sim", "--model", "tiny", "--workers", "0"], "a multiple of tp x ep x pp"),
    (["--sim", "--model", "tiny", "--checkpoint", "lots"], "--checkpoint lots"),
    (["--sim", "--model", "tiny", "--checkpoint", "1M", "--frontend-us", "5"], "needs a topology"),
])
def test_sim_refuses_bad_flags_in_one_line(argv: list[str], says: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_checkpoint_to_host0_delays_the_tokens_not_the_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--checkpoint: every rank posts its shard to host0 as decoding starts, over the
    links the tokens take; the tokens wait behind its frames, the steps do not."""
    topo = tmp_path / "c.toml"  # two domains of two; host0 on a 1 Gb/s front-end
    subprocess.run([sys.executable, "-m", "fabric.cli", "topo", "gen", "--cluster", "2",
                    "--gpus-per-domain", "2", "--frontend-gbps", "1", "-o", str(topo)],
                   check=True, timeout=60)
    rows = {}
    for ckpt in ("", "2M"):
        out = tmp_path / f"c{ckpt}.json"
        assert _main(["--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "2", "--layers",
                      "1", "--concurrency", "4", "--num-prompts", "4", "--tokens", "4",
                      "--input-len", "16", "--topology", str(topo), "--json", str(out)]
                     + (["--checkpoint", ckpt] if ckpt else [])) == 0
        rows[ckpt] = json.loads(out.read_text())["results"][0]
    assert "checkpoint 2097152 B per rank to host0" in capsys.readouterr().out
    quiet, busy = rows[""], rows["2M"]
    assert busy["checkpoint_bytes"] == 2 << 20 and quiet["checkpoint_bytes"] == 0
    # 8 MiB on 1 Gb/s: the first tokens wait milliseconds at host0's link
    assert busy["parts_ms"]["transport"]["p50"] > 100 * quiet["parts_ms"]["transport"]["p50"]
    assert busy["ttft_ms"]["p50"] > quiet["ttft_ms"]["p50"]
    for part in ("dispatch", "combine", "tp"):  # the steps do not (other links)
        assert busy["parts_ms"][part]["mean"] == pytest.approx(
            quiet["parts_ms"][part]["mean"], rel=0.01)
