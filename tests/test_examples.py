"""The README's examples run as scripts: a workload defined in the script itself is
passed to the workers as an argument (run_in_emulation, work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_both_worlds_example_runs_as_a_script() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "both_worlds.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "emulated, 4 workers: [10, 10, 10, 10]" in out.stdout


def test_moe_example_is_exact_in_both_worlds() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "moe_ep.py")],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("wrong elements: 0") == 4, out.stdout
