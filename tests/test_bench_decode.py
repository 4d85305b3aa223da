"""`semfab bench decode`: rows, parts, token checks, JSON, --both and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.cli import main


def test_sim_rows_check_every_token_and_write_json(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out, md, png = tmp_path / "d.json", tmp_path / "d.md", tmp_path / "d.png"
    assert main(["bench", "decode", "--sim", "--tp", "2", "--ep", "2,4", "--per-leaf", "4",
                 "--variants", "flat,in-network", "--tokens", "4", "--latency-us", "5",
                 "--prompt-len", "4", "--slo-ms", "1",
                 "--json", str(out), "--markdown", str(md), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "every token exact" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["model"] == "tiny" and doc["settings"]["eps"] == [2, 4]
    rows = doc["results"]
    assert [(r["ep"], r["variant"]) for r in rows] == [(2, "flat"), (2, "in-network"),
                                                      (4, "flat"), (4, "in-network")]
    for r in rows:
        assert r["wrong_sequences"] == 0 and r["world"] == "simulation"
        parts = sum(v["mean"] for k, v in r["parts_ms"].items() if k != "other")
        assert parts == pytest.approx(r["itl_ms"]["mean"], rel=0.05)  # the parts add up
        assert r["parts_ms"]["dispatch"]["mean"] > 0 and r["parts_ms"]["tp"]["p50"] > 0
        assert set(r["parts_ms"]["combine"]) == {"mean", "p50", "p99"}
        # prompts of 1..4 tokens, a token a step: the first token after 1..4 steps
        assert r["itl_ms"]["p50"] * 0.9 <= r["ttft_ms"]["p50"] <= 4.1 * r["itl_ms"]["p99"]
        assert r["tokens_per_s_per_gpu"] == pytest.approx(
            4 * r["ep"] / (r["itl_ms"]["mean"] / 1e3) / r["gpus"])
        assert r["within_slo"] == 1.0  # 1 ms: far above these steps
        assert r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    assert md.read_text().count("\n| simulation") == 4
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_congestion_settings_reach_the_switches(capsys: pytest.CaptureFixture[str]) -> None:
    """mixtral's dispatch through a 4:1 leaf uplink behind a 100 kB buffer, trimming,
    nscc: the header says so and every row completes."""
    assert main(["bench", "decode", "--sim", "--model", "mixtral-8x7b", "--tp", "1", "--ep",
                 "8", "--per-leaf", "4", "--oversubscription", "4", "--layers", "1",
                 "--batch", "16", "--tokens", "2", "--bandwidth-gbps", "100", "--mtu", "16384",
                 "--buffer", "100K", "--trim", "--cc", "nscc", "--variants", "flat"]) == 0
    text = capsys.readouterr().out
    assert "congestion: cc nscc, buffer 102400, trimming" in text and "1 rows in" in text


@pytest.mark.parametrize(("flags", "words"), [
    (["--buffer", "100K", "--pfc"], "buffer 102400, PFC"),
    (["--credit"], "buffer unbounded, credit-based links"),
])
def test_lossless_fabrics_reach_the_switches(flags: list[str], words: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same dispatch through lossless switches: PFC behind the buffer, or
    credit-based links; in-network MoE too."""
    assert main(["bench", "decode", "--sim", "--model", "mixtral-8x7b", "--tp", "1", "--ep",
                 "8", "--per-leaf", "4", "--oversubscription", "4", "--layers", "1",
                 "--batch", "16", "--tokens", "2", "--bandwidth-gbps", "100", "--mtu", "16384",
                 "--cc", "nscc", "--variants", "flat,in-network", *flags]) == 0
    text = capsys.readouterr().out
    assert words in text and "2 rows in" in text


def test_completion_rate_counts_the_operations_that_resent(tmp_path: Path) -> None:
    """Behind a 30 kB buffer at 4:1, about half of the network operations of a rank
    resend something; on unbounded queues none does."""
    out = tmp_path / "d.json"
    base = ["bench", "decode", "--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "4",
            "--per-leaf", "4", "--oversubscription", "4", "--bandwidth-gbps", "10", "--mtu",
            "4096", "--layers", "1", "--batch", "16", "--tokens", "2", "--variants", "flat",
            "--json", str(out)]
    assert main([*base, "--buffer", "30K"]) == 0
    lossy = json.loads(out.read_text())["results"][0]["completion_rate"]
    assert main(base) == 0
    assert json.loads(out.read_text())["results"][0]["completion_rate"] == 1.0
    assert 0.1 < lossy < 0.9


def test_a_checkpoint_burst_slows_the_steps_it_shares_the_uplinks_with(tmp_path: Path) -> None:
    """A 64 MiB exchange per interleaved rank across a 4:1 spine while mixtral
    decodes: the same exact layout, slower steps (the dispatch waits behind it)."""
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep",
                 "4", "--per-leaf", "8", "--oversubscription", "4", "--bandwidth-gbps", "100",
                 "--layers", "1", "--batch", "16", "--tokens", "4", "--checkpoint", "0,64M",
                 "--variants", "flat", "--json", str(out)]) == 0
    quiet, busy = json.loads(out.read_text())["results"]
    assert (quiet["checkpoint_bytes"], busy["checkpoint_bytes"]) == (0, 64 << 20)
    assert quiet["checkpoint_ms"] is None and busy["checkpoint_ms"] > 0
    assert busy["gpus"] == quiet["gpus"] == 8  # the decoding ranks alone
    assert busy["itl_ms"]["mean"] > 1.5 * quiet["itl_ms"]["mean"]
    assert busy["parts_ms"]["dispatch"]["mean"] > 3 * quiet["parts_ms"]["dispatch"]["mean"]


def test_a_timing_only_prefill_gives_the_first_token(tmp_path: Path) -> None:
    """mixtral with 64-token prompts: the first step prefills them all (the TTFT),
    the ITL counts the three decode steps after it alone."""
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--sim", "--model", "mixtral-8x7b", "--tp", "2", "--ep",
                 "2", "--layers", "1", "--batch", "8", "--tokens", "4", "--prompt-len", "64",
                 "--variants", "flat", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert r["steps"] == 4 * 3  # four ranks, three decode steps each
    assert r["ttft_ms"]["p50"] > 2 * r["itl_ms"]["p99"]  # 37 ms against 11


def test_layers_extrapolate_a_timing_only_preset(capsys: pytest.CaptureFixture[str]) -> None:
    """deepseek-v3 with one of its 61 layers run: the per-layer parts are scaled by
    61, the LM head's compute is not."""
    assert main(["bench", "decode", "--sim", "--model", "deepseek-v3", "--tp", "1", "--ep",
                 "8", "--batch", "2", "--tokens", "2", "--layers", "1",
                 "--variants", "flat"]) == 0
    text = capsys.readouterr().out
    assert "1 of 61 layers run, x61" in text and "timing-only: no token check" in text


def test_both_worlds_side_by_side(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "both.json"
    assert main(["bench", "decode", "--tp", "2", "--ep", "2", "--tokens", "3",
                 "--variants", "flat", "--both", "--gpu", "none", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# emulated ITL p50 over simulated: " in text
    assert "| emulation" in text and "| simulation" in text and "every token exact" in text
    # the switch daemons count each class's links as the simulator does: the same
    # frames (a stray resend or ACK more when launched), bytes and switch hops
    emu, sim = (next(r for r in json.loads(out.read_text())["results"] if r["world"] == w)
                for w in ("emulation", "simulation"))
    assert set(emu["semantic_per_token_by_class"]) == {"scaleup"}
    for key in ("crossings", "hops"):
        e, s = (r["semantic_per_token_by_class"]["scaleup"][key] for r in (emu, sim))
        assert s > 0 and 0.9 * s <= e <= 1.1 * s, (key, e, s)
    e, s = (r["mb_per_step_by_class"]["scaleup"] for r in (emu, sim))
    assert s > 0 and 0.9 * s <= e <= 1.1 * s
    # the simulated row simulates this emulator: the service times measured first
    doc = json.loads(out.read_text())
    assert doc["settings"]["timing"]["switch_frame_s"] > 0
    assert "as this emulator (switch " in sim["note"] and "vs_sim" in emu


@pytest.mark.parametrize("argv,words", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--ep", "3"], "--ep 3 does not divide tiny's 4 experts"),
    (["--ep", "two"], "--ep takes whole numbers"),
    (["--tp", "2", "--ep", "4", "--pp", "2"], "too many processes to emulate"),
    (["--variants", "ring"], "--variants: choose from"),
    (["--layers", "1"], "tiny computes every layer"),
    (["--gpu", "v100"], "--gpu 'v100'"),
    (["--sim", "--both"], "leave out --sim"),
    (["--calibration", "c.json"], "add --sim or --both"),
    (["--sim", "--calibration", "/nonexistent.json"], "not a calibration file"),
    (["--sim", "--ep", "4", "--per-leaf", "3"], "do not fill leaves of --per-leaf 3"),
    (["--sim", "--cc", "reno"], "--cc reno: unknown policy"),
    (["--sim", "--trim"], "give --buffer"),
    (["--sim", "--pfc"], "--pfc pauses senders when a buffer fills: give --buffer"),
    (["--sim", "--credit", "--buffer", "1M", "--trim"], "lossless by themselves"),
    (["--sim", "--buffer", "1K"], "cannot hold one frame"),
    (["--sim", "--mtu", "100"], "--mtu 100"),
    (["--sim", "--checkpoint", "lots"], "--checkpoint lots"),
    (["--tp", "2", "--ep", "4", "--checkpoint", "1M"], "too many processes to emulate"),
])
def test_bad_flags_are_one_line(argv: list[str], words: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("semfab: error: ") and words in err and "\n" not in err


def test_on_a_cluster_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TP inside the scale-up domains of `topo gen --cluster`, EP across them: bytes
    on both networks, none on the front-end; the file's worker count must be the
    layout's."""
    topo, out = tmp_path / "c.toml", tmp_path / "d.json"
    assert main(["topo", "gen", "--cluster", "4", "--gpus-per-domain", "2",
                 "--domains-per-leaf", "2", "--oversubscription", "2", "-o", str(topo)]) == 0
    assert main(["bench", "decode", "--sim", "--topology", str(topo), "--tp", "2", "--ep", "4",
                 "--variants", "flat,in-network", "--tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"fabric {topo}" in text and "every token exact" in text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    for r in rows.values():
        mb = r["mb_per_step_by_class"]
        assert mb["scaleup"] > 0 and mb["scaleout"] > 0 and mb["frontend"] == 0
        sem = r["semantic_per_token_by_class"]
        assert sem["scaleout"]["crossings"] >= sem["scaleout"]["hops"] > 0
    # in-network MoE crosses the scale-out less: the leaf sums what flat sends home
    out_flat = rows["flat"]["semantic_per_token_by_class"]["scaleout"]["crossings"]
    assert rows["in-network"]["semantic_per_token_by_class"]["scaleout"]["crossings"] \
        < out_flat
    assert main(["bench", "decode", "--sim", "--topology", str(topo), "--tp", "2",
                 "--ep", "2"]) == 2
    assert "has 8 workers; the layout needs 4" in capsys.readouterr().err
