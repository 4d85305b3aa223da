"""DDP over the semfab backend against gloo (examples/torch_ddp.py) under two
torchrun agents, as on two hosts, with the switch's counters as proof of in-switch
reduction (`semfab launch` and the other paths: tests/test_torch_ops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs import last_json, leftovers, torchrun_nodes

pytest.importorskip("torch")

STEPS = "6"


def test_ddp_on_two_hosts_matches_gloo_bit_for_bit(tmp_path: Path) -> None:
    # two torchrun agents of one rank each, as on two hosts: the star runs over tcp
    # (torchrun --standalone runs it over ipc: the other torch tests)
    node0, node1 = torchrun_nodes("examples/torch_ddp.py", 2, tmp_path, "--steps", STEPS,
                                  "--json")
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert node0.returncode == 0, node0.stderr[-3000:]
    topo = next(tmp_path.glob("runs/*/topology.toml")).read_text()
    assert 'transport = "tcp"' in topo
    # two ranks: each sum has two terms, so any order gives gloo's bits
    s = last_json(node0.stdout)
    assert s["world"] == 2 and s["path"] == "ina"
    assert s["bit_identical"], s
    # gloo DDP with fabric.torch.allreduce_hook: the gradients alone on the fabric
    assert s["hook_bit_identical"], s
    # every bucket of every step was reduced in the switch: REDUCE frames came in
    # and chunks completed there; nothing fell back to another path
    assert s["switch_reduce_frames"] >= 2 * int(STEPS), s
    assert s["switch_completions"] >= int(STEPS), s
    assert s["fallbacks"] == []
    assert leftovers(tmp_path) == []
