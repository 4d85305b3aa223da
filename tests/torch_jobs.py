"""Test helper: run a torch job (torchrun or `semfab launch`) in its own session,
bounded in time, and check that it left no process behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.processes import kill_groups

ROOT = Path(__file__).resolve().parent.parent


def job_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a job whose fabric logs go under ``tmp``."""
    env = dict(os.environ)
    for key in ("SEMFAB_PATH", "SEMFAB_NUMERICS", "SEMFAB_TIMEOUT", "SEMFAB_TOPOLOGY"):
        env.pop(key, None)
    env.update(SEMFAB_RUN_DIR=str(tmp / "runs"), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore::FutureWarning", **extra)
    return env


def run_job(cmd: list[str], tmp: Path, timeout_s: float = 90.0,
            **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (from the repository root); kill its whole session at the end."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=job_env(tmp, **env), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    finally:
        kill_groups([p])
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def torchrun(script: str, nproc: int, tmp: Path, *args: str, timeout_s: float = 90.0,
             **env: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node nproc script args``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, *args]
    return run_job(cmd, tmp, timeout_s, **env)


def torchrun_nodes(script: str, nodes: int, tmp: Path, *args: str, timeout_s: float = 90.0,
                   **env: str) -> list[subprocess.CompletedProcess[str]]:
    """``nodes`` torchrun agents of one rank each, as on ``nodes`` hosts (static
    rendezvous on this one); their results by node rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
               f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
               f"--master-port={port}", script, *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=job_env(tmp, **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        kill_groups(procs)
    return results


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError(f"no JSON line in:\n{text[-3000:]}")


def leftovers(tmp: Path, wait_s: float = 5.0) -> list[str]:
    """Command lines of processes still naming ``tmp`` (a fabric's run folder)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(tmp) in cmdline:
                found.append(cmdline)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
