"""FSDP2 over the semfab backend against gloo (examples/torch_fsdp2.py), and the
recorder: the last step's trace, replayed in simulation at more ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun

pytest.importorskip("torch")


def test_fsdp2_matches_gloo_bit_for_bit_and_records_its_step(tmp_path: Path) -> None:
    # all_gather_into_tensor (input a view of its output) and reduce_scatter_tensor
    # on the fabric's ina paths; two ranks, so every sum has gloo's bits
    rec = tmp_path / "step.json"
    res = torchrun("examples/torch_fsdp2.py", 2, tmp_path, "--steps", "4", "--json",
                   "--record", str(rec))
    assert res.returncode == 0, res.stderr[-3000:]
    s = last_json(res.stdout)
    assert s["bit_identical"], s
    assert s["switch_reduce_frames"] > 0, s  # gradients reduce-scattered in the switch
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []

    # the recorded step: 3 sharded layers (weight + bias each) gathered forward and
    # backward (the root module's reshard aside), gradients reduce-scattered once each
    doc = json.loads(rec.read_text())
    assert doc["world"] == 2
    kinds = [op["kind"] for op in doc["ops"]]
    assert kinds.count("reduce_scatter") == 3 and kinds.count("all_gather") >= 3, kinds
    sizes = {(op["kind"], op["count"]) for op in doc["ops"]}
    # the first layer's shard: (64 x 128 + 128) / 2 elements per rank
    assert ("all_gather", (64 * 128 + 128) // 2) in sizes, sizes
    assert ("reduce_scatter", 64 * 128 + 128) in sizes, sizes
    assert all(op["group"] == [0, 1] and op["duration_s"] > 0 for op in doc["ops"])

    from fabric.cli import main

    assert main(["sim", "replay", str(rec), "--workers", "4", "--no-compute"]) == 0
