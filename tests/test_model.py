"""The model, layout and decode-step cost model (fabric.core.model) and `semfab model`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.cli import main
from fabric.core.model import (
    GPUS,
    MODELS,
    GpuSpec,
    Layout,
    ModelConfig,
    decode_step,
    get_model,
)
from fabric.errors import UsageError


@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 46.7), ("deepseek-v3", 671.0)])
def test_presets_have_their_published_parameter_counts(name: str, billions: float) -> None:
    assert get_model(name).params() / 1e9 == pytest.approx(billions, rel=0.005)


def test_layouts_that_do_not_fit_are_one_line_errors() -> None:
    tiny = MODELS["tiny"]
    for layout, words in [(Layout(tp=3), "does not divide tiny's 4 heads"),
                          (Layout(ep=3), "does not divide tiny's 4 experts"),
                          (Layout(pp=3), "more stages than"),
                          (Layout(tp=0), "--tp must be >= 1")]:
        with pytest.raises(UsageError, match=words):
            layout.check(tiny)
    dense = ModelConfig("d", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, vocab=16,
                        ffn=16)
    with pytest.raises(UsageError, match="has no experts"):
        Layout(ep=2).check(dense)
    with pytest.raises(UsageError, match="needs 8 GPUs; the topology has 4 workers"):
        Layout(tp=2, ep=4).fits(4)
    with pytest.raises(UsageError, match="kv_heads 3 must divide heads 4"):
        ModelConfig("x", layers=1, hidden=8, heads=4, kv_heads=3, head_dim=2, vocab=4, ffn=4)


def test_a_dense_step_by_hand() -> None:
    """One layer, GQA, TP 2, a GPU with round figures: every part's FLOPs, bytes and
    roofline time, and the ring allreduce's bytes, computed here by hand."""
    m = ModelConfig("d", layers=1, hidden=8, heads=2, kv_heads=2, head_dim=4, vocab=16, ffn=16,
                    dtype="float32")
    gpu = GpuSpec("g", tflops=1e-6, hbm_gbs=1.0, flops_eff=1.0, hbm_eff=1.0)  # 1 MFLOP/s, 1 GB/s
    s = decode_step(m, Layout(tp=2), gpu, batch=3, context=5)
    parts = {p.name: p for p in s.parts}
    attn_w = 8 * 8 + 2 * 8 * 8 + 8 * 8  # q, k and v, out
    a = parts["attention"]
    assert a.flops == pytest.approx(2 * 3 * attn_w / 2 + 4 * 3 * 5 * 2 * 4 / 2)
    assert a.hbm_bytes == pytest.approx(attn_w * 4 / 2 + 3 * 5 * (2 * 2 * 4) * 4 / 2)
    assert a.compute_us == pytest.approx(max(a.flops / 1e6, a.hbm_bytes / 1e9) * 1e6)
    ar = parts["tp-allreduce"]
    assert ar.layers == 2 and ar.message_bytes == 3 * 8 * 4
    assert ar.net_bytes == pytest.approx(2 * (2 - 1) / 2 * 3 * 8 * 4)
    f = parts["ffn"]
    assert f.flops == pytest.approx(2 * 3 * 3 * 8 * 16 / 2)
    head = parts["lm-head"]
    assert head.layers == 1 and head.hbm_bytes == pytest.approx(16 * 8 * 4 / 2)
    assert s.compute_us == pytest.approx(a.compute_us + f.compute_us + head.compute_us)
    assert "ep-dispatch" not in parts and "pp-send" not in parts


def test_moe_bytes_and_scaling() -> None:
    """DeepSeek-V3 at 128 tokens per rank, top-8, hidden 7168 in BF16: a dispatch of
    14.7 MB per rank (DeepEP's low-latency case); the remote share grows with EP."""
    m = MODELS["deepseek-v3"]
    h100 = GPUS["h100"]
    by_ep = {}
    for ep in (8, 32, 256):
        s = decode_step(m, Layout(ep=ep), h100, batch=128 * ep, context=1024)
        d = {p.name: p for p in s.parts}["ep-dispatch"]
        assert d.message_bytes == 128 * 8 * 7168 * 2
        assert d.net_bytes == pytest.approx(d.message_bytes * (ep - 1) / ep)
        assert d.layers == 58
        by_ep[ep] = s
    # more experts' groups: fewer expert weights read per GPU, so less compute per step
    assert by_ep[256].compute_us < by_ep[32].compute_us < by_ep[8].compute_us
    # pipeline: the stages run in turn, so compute per step is unchanged, bytes added
    one = decode_step(MODELS["mixtral-8x7b"], Layout(tp=2, ep=4), h100, batch=64, context=512)
    two = decode_step(MODELS["mixtral-8x7b"], Layout(tp=2, ep=4, pp=2), h100, batch=64,
                      context=512)
    assert two.compute_us == pytest.approx(one.compute_us)
    assert two.net_bytes("pp-send") > 0 == one.net_bytes("pp-send")
    assert two.net_bytes("ep-dispatch") == pytest.approx(one.net_bytes("ep-dispatch"))


def test_semfab_model_prints_writes_and_refuses(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    assert main(["model", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "4", "--json",
                 str(out), "--markdown", str(md)]) == 0
    text = capsys.readouterr().out
    assert "mixtral-8x7b (46.7 B parameters" in text and "ep-dispatch" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["layout"] == {"tp": 2, "ep": 4, "pp": 1, "dp": 1}
    assert doc["world"] == 8 and {p["name"] for p in doc["parts"]} >= {"attention", "experts"}
    assert md.read_text().startswith("| part")
    for argv, words in [(["--model", "gpt5"], "unknown model 'gpt5'"),
                        (["--model", "tiny", "--ep", "3"], "does not divide tiny's 4 experts"),
                        (["--gpu", "v100"], "unknown GPU 'v100'")]:
        assert main(["model", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("semfab: error: ") and words in err and "\n" not in err
