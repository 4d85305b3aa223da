"""Real-library peers: allreduce through torch.distributed (gloo) and MPI (mpi4py).

semfab's own paths are compared against collective libraries that nobody here
wrote, measured in the same run, on the same sizes and process counts
(docs/DESIGN.md section 6). This module is the parent side (launch, time-box,
clean up, turn results into :class:`~bench.report.AllreduceRow`) and also holds
the rank-side timing loop that ``bench.peer_gloo`` and ``bench.peer_mpi`` share,
so both peers follow one timing convention (written down in docs/PEERS.md):

* per size: ``warmup`` untimed iterations, then ``iters`` timed ones;
* before every iteration a barrier; each rank times only its own allreduce
  call with ``time.perf_counter_ns``;
* an iteration's time is the maximum over ranks (gathered after the loop);
  the row reports the median (``time_us``), p50, p99, min and max;
* inputs are ``kernels.reference.make_tensor(rank, step, count, dtype)``
  (generated fast by ``kernels.checking``) with ``step`` the iteration index
  (warmup included); with ``check`` every element of every rank's result of
  the last iteration is compared with the exact expected allreduce (as
  nccl-tests checks after its timed loop) and wrong elements are summed.

Nothing here imports torch or mpi4py: they are imported only in the rank
processes, so a machine without them still gets rows that say why.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from bench.report import AllreduceRow, dtype_itemsize, parse_size

#: The collectives of the set a peer runs besides allreduce (bench.nccl.KINDS).
COLLECTIVES = ("all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv")

__all__ = [
    "MPI4PY_MISSING",
    "MPIRUN_MISSING",
    "PEERS",
    "REFERENCE_MISSING",
    "TORCH_MISSING",
    "COLLECTIVES",
    "CollectiveComm",
    "PeerComm",
    "collective_loop",
    "peer_status",
    "run_gloo",
    "run_mpi",
    "run_peer",
    "run_rank",
    "worker_loop",
    "worker_parser",
]

#: Names of the peers, also the ``path`` of their rows.
PEERS = ("gloo", "mpi")

TORCH_MISSING = "torch is not installed (pip install 'semfab[peers]')"
MPI4PY_MISSING = "mpi4py is not installed (pip install 'semfab[peers]')"
MPIRUN_MISSING = (
    "mpirun not found: pip install 'semfab[peers]' (Open MPI's wheel puts mpirun beside "
    "this Python), or put an MPI's bin folder on PATH"
)
REFERENCE_MISSING = (
    "kernels.reference is not importable (it makes the inputs and the expected results)"
)

_REPO_ROOT = Path(__file__).resolve().parent.parent
_OPS = ("sum", "max", "min")

# Seconds a rank gets to leave after SIGTERM before SIGKILL; MPI launchers
# need a moment to forward the signal to their ranks.
_TERM_GRACE_S = 2.0


# --------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------


def _has_module(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (parents only)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False


def _find_mpirun() -> str | None:
    """The MPI launcher to use: the interpreter's own bin folder first, then PATH.

    A launcher beside the interpreter (a venv with a pip-installed MPI) is the
    one most likely to match the MPI library mpi4py loads.
    """
    bindir = Path(sys.executable).parent
    for name in ("mpirun", "mpiexec"):
        cand = bindir / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    return None


def peer_status() -> dict[str, str | None]:
    """For each peer, None when it can run here, else the reason it cannot.

    Cheap: looks for modules and executables, imports neither torch nor MPI.
    A peer that passes this check can still fail at run time (for example a
    torch build without gloo); that failure comes back in the rows' note.
    """
    ref_ok = _has_module("kernels.reference")
    status: dict[str, str | None] = {}
    if not _has_module("torch"):
        status["gloo"] = TORCH_MISSING
    elif not ref_ok:
        status["gloo"] = REFERENCE_MISSING
    else:
        status["gloo"] = None
    if not _has_module("mpi4py"):
        status["mpi"] = MPI4PY_MISSING
    elif _find_mpirun() is None:
        status["mpi"] = MPIRUN_MISSING
    elif not ref_ok:
        status["mpi"] = REFERENCE_MISSING
    else:
        status["mpi"] = None
    return status


# --------------------------------------------------------------------------
# Rank side: the shared timing loop
# --------------------------------------------------------------------------


class PeerComm(Protocol):
    """What a peer's rank process offers the shared timing loop."""

    rank: int
    world: int

    def barrier(self) -> None:
        """Block until every rank arrived."""

    def prepare(self, x: np.ndarray) -> Any:
        """Wrap the input (and allocate any output) before the timed call."""

    def allreduce(self, handle: Any) -> None:
        """The timed call: one allreduce of the prepared buffers."""

    def result(self, handle: Any) -> np.ndarray:
        """The reduced result as a NumPy array (after :meth:`allreduce`)."""

    def gather_times(self, times_ns: list[int]) -> list[list[int]] | None:
        """Every rank's iteration times on rank 0 (None on the other ranks)."""

    def sum_int(self, value: int) -> int:
        """Sum of ``value`` over all ranks, known to every rank."""


def worker_parser(prog: str) -> argparse.ArgumentParser:
    """Command-line arguments common to both peers' rank processes."""
    p = argparse.ArgumentParser(prog=prog, description="semfab peer rank (started by bench.peers)")
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--op", default="sum", choices=_OPS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check", type=int, default=1, help="1: count wrong elements, 0: do not")
    p.add_argument("--world", type=int, required=True, help="expected number of ranks")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for any one wait")
    p.add_argument("--result", required=True, help="JSON-lines file rank 0 appends to")
    p.add_argument("--collective", default="allreduce", choices=("allreduce", *COLLECTIVES),
                   help="what to time (sizes as swept, see bench.nccl)")
    p.add_argument("--root", type=int, default=0, help="root rank (broadcast, reduce)")
    return p


def worker_loop(comm: PeerComm, args: argparse.Namespace) -> None:
    """Run the sweep on one rank; rank 0 appends one JSON line per size to ``args.result``.

    Each line: ``{"size_bytes", "count", "samples_us" (max over ranks per
    timed iteration), "wrong" (-1 when not checked)}``. A line is written as
    soon as its size is done, so a later failure keeps the earlier sizes.
    """
    from kernels.checking import expected_allreduce, make_input
    from kernels.reference import count_wrong

    if comm.world != args.world:
        # The classic cause: mpi4py loaded a different MPI than the launcher's,
        # so every rank believes it is alone.
        raise RuntimeError(
            f"expected {args.world} ranks, this rank sees {comm.world}: the launcher and "
            "the communication library do not match"
        )
    itemsize = dtype_itemsize(args.dtype)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    for size in sizes:
        count = size // itemsize
        times_ns: list[int] = []
        wrong = 0
        for step in range(args.warmup + args.iters):
            x = make_input(comm.rank, step, count, args.dtype)
            handle = comm.prepare(x)
            comm.barrier()
            t0 = time.perf_counter_ns()
            comm.allreduce(handle)
            t1 = time.perf_counter_ns()
            if step < args.warmup:
                continue
            times_ns.append(t1 - t0)
            if args.check and step == args.warmup + args.iters - 1:
                # nccl-tests style: every element of the last iteration's result
                expected = expected_allreduce(comm.world, step, count, args.dtype, args.op)
                wrong += int(count_wrong(comm.result(handle), expected))
        gathered = comm.gather_times(times_ns)
        total_wrong = comm.sum_int(wrong) if args.check else -1
        if comm.rank == 0 and gathered is not None:
            per_iter = np.max(np.asarray(gathered, dtype=np.int64), axis=0)
            line = {
                "size_bytes": count * itemsize,
                "count": count,
                "samples_us": [float(t) / 1e3 for t in per_iter],
                "wrong": total_wrong,
            }
            with open(args.result, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")


class CollectiveComm(Protocol):
    """What a peer's rank process offers :func:`collective_loop` (besides barrier,
    gather_times and sum_int of :class:`PeerComm`)."""

    rank: int
    world: int

    def barrier(self) -> None:
        """Block until every rank arrived."""

    def prepare_collective(self, kind: str, x: np.ndarray, out: np.ndarray | None,
                           root: int) -> tuple[Callable[[], None], np.ndarray | None]:
        """The timed call of ``kind`` on these buffers (wrapped beforehand, so the call
        itself is all that is timed), and the array that holds this rank's result
        after it (None: no result here, as reduce off the root)."""

    def gather_times(self, times_ns: list[int]) -> list[list[int]] | None:
        """Every rank's iteration times on rank 0 (None on the other ranks)."""

    def sum_int(self, value: int) -> int:
        """Sum of ``value`` over all ranks, known to every rank."""


def collective_loop(comm: CollectiveComm, args: argparse.Namespace) -> None:
    """:func:`worker_loop` for the collective set: the same timing convention, the
    buffers, inputs and exact expected outputs of :mod:`bench.nccl`; rank 0 appends
    one JSON line per swept size (``"swept"``) with the row's size and count."""
    from bench import nccl
    from kernels.reference import count_wrong

    if comm.world != args.world:
        raise RuntimeError(
            f"expected {args.world} ranks, this rank sees {comm.world}: the launcher and "
            "the communication library do not match"
        )
    kind, W, r = args.collective, comm.world, comm.rank
    itemsize = dtype_itemsize(args.dtype)
    for swept in (int(s) for s in args.sizes.split(",") if s):
        count = nccl.per_rank_count(kind, swept, itemsize, W)
        _n_in, n_out = nccl.buffer_counts(kind, count, W, r, args.root)
        out = None
        times_ns: list[int] = []
        wrong = 0
        last = args.warmup + args.iters - 1
        for step in range(args.warmup + args.iters):
            x = np.array(nccl.make_collective_input(kind, r, step, count, W, args.dtype))
            if out is None and n_out:
                out = np.empty(n_out, x.dtype)  # once per size: its pages are mapped
            call, result = comm.prepare_collective(kind, x, out, args.root)
            comm.barrier()
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            if step < args.warmup:
                continue
            times_ns.append(t1 - t0)
            if args.check and step == last:
                want = nccl.expected_output(kind, r, step, count, W, args.dtype, args.op,
                                            args.root)
                if want is not None and result is not None:
                    wrong += int(count_wrong(result, want))
        gathered = comm.gather_times(times_ns)
        total_wrong = comm.sum_int(wrong) if args.check else -1
        if comm.rank == 0 and gathered is not None:
            per_iter = np.max(np.asarray(gathered, dtype=np.int64), axis=0)
            line = {
                "swept": swept,
                "size_bytes": nccl.row_size(kind, count, itemsize, W),
                "count": count,
                "samples_us": [float(t) / 1e3 for t in per_iter],
                "wrong": total_wrong,
            }
            with open(args.result, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")


def run_rank(comm: Any, args: argparse.Namespace) -> None:
    """A peer rank's sweep: allreduce (:func:`worker_loop`) or another collective
    (:func:`collective_loop`)."""
    if args.collective == "allreduce":
        worker_loop(comm, args)
    else:
        collective_loop(comm, args)


# --------------------------------------------------------------------------
# Parent side: processes that always end
# --------------------------------------------------------------------------


def _session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``, from /proc (Linux).

    Every launched process starts its own session, and everything it starts
    stays in that session even after being orphaned (Open MPI puts each rank
    in its own process group, so a process-group kill would miss them).
    """
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited meanwhile
        # Fields after the parenthesised command name: state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 4 and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _signal_session(leader: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to every live process in the leader's session."""
    targets = set(_session_members(leader.pid)) if sys.platform.startswith("linux") else set()
    if leader.returncode is None:
        targets.add(leader.pid)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if not sys.platform.startswith("linux"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader.pid, sig)


def _exited(proc: subprocess.Popen[bytes]) -> int | None:
    """Exit code without reaping the process, or None while it runs.

    Not reaping keeps the leader's pid (the session id) reserved until the
    cleanup has signalled its session, so the id cannot be reused meanwhile.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # killed by a signal, as Popen reports it


def _cleanup(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """End every launched process and everything it started; reap the leaders."""
    for p in procs:
        _signal_session(p, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE_S
    while time.monotonic() < deadline:
        alive = [p for p in procs if _exited(p) is None or _session_members(p.pid)]
        if not alive:
            break
        time.sleep(0.05)
    for p in procs:
        _signal_session(p, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def _log_tail(path: Path, lines: int = 4, limit: int = 400) -> str:
    """What a failed rank said, on one line, for a note.

    The last Python exception line when there is one (launchers such as
    mpirun add help text after it), else the last few non-empty lines.
    """
    try:
        text = path.read_bytes()[-16384:].decode("utf-8", errors="replace")
    except OSError:
        return ""
    all_lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in all_lines if _EXC_LINE.match(ln)]
    out = errors[-1] if errors else " | ".join(all_lines[-lines:])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _run_processes(
    cmds: Sequence[Sequence[str]],
    env: dict[str, str],
    logdir: Path,
    timeout_s: float,
    names: Sequence[str],
) -> str | None:
    """Run the commands side by side; None when all exit 0, else what went wrong.

    Output goes to files (a full pipe could block a rank); every process is
    ended on return, on timeout, on error and on KeyboardInterrupt.
    """
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    handles: list[IO[bytes]] = []
    try:
        for name, cmd in zip(names, cmds, strict=True):
            log = logdir / f"{name}.log"
            fh = open(log, "wb")  # closed in the finally below
            handles.append(fh)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    cwd=_REPO_ROOT,
                    env=env,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [_exited(p) for p in procs]
            for name, code, log in zip(names, codes, logs, strict=True):
                if code is not None and code != 0:
                    tail = _log_tail(log)
                    return f"{name} exited with code {code}" + (f": {tail}" if tail else "")
            if all(c == 0 for c in codes):
                return None
            if time.monotonic() > deadline:
                tail = _log_tail(logs[0], lines=2)
                return f"timed out after {timeout_s:g} s" + (
                    f" ({names[0]} last said: {tail})" if tail else ""
                )
            time.sleep(0.02)
    finally:
        _cleanup(procs)
        for handle in handles:
            handle.close()


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    """Environment for rank processes.

    One compute thread per rank unless the user chose otherwise: MPI ranks
    are single-threaded, and on a small host extra OpenMP threads per rank
    only fight each other; idle ones sleep instead of spinning. Unbuffered
    output keeps logs useful after a kill.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # idle OpenMP threads of the input generator (numba) would otherwise spin on
    # the cores the ranks need: gloo's 4 KiB allreduce took 2.3-2.9 ms, not
    # 0.22-0.33 ms, on this 2-core host (semfab's own workers get the same setting)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"
    # Make `python -m bench.peer_*` work from a source checkout too.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


@functools.lru_cache(maxsize=8)
def _mpi_flavour(mpirun: str) -> str:
    """'openmpi', 'mpich' or 'unknown', from ``mpirun --version``."""
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open rte" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _mpi_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the MPI launcher: as root, Open MPI's own opt-in variables too.

    They cover a launcher whose flavour was not recognised (so it gets no
    ``--allow-run-as-root``) and the daemons it starts; other MPIs ignore them.
    """
    if _is_root():
        env = {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


def _mpi_launch(mpirun: str, workers: int) -> list[str]:
    """Launcher prefix for ``workers`` local ranks, with the flags this flavour needs."""
    flavour = _mpi_flavour(mpirun)
    if flavour == "openmpi":
        # More ranks than cores must be allowed, binding would pin several
        # ranks onto one core, and containers often run as root.
        cmd = [mpirun, "-np", str(workers), "--oversubscribe", "--bind-to", "none"]
        if _is_root():
            cmd.append("--allow-run-as-root")
        return cmd
    if flavour == "mpich":
        return [mpirun, "-n", str(workers), "-bind-to", "none"]
    return [mpirun, "-np", str(workers)]


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _rows_for_failure(
    path: str, workers: int, sizes: Sequence[int], dtype: str, op: str, note: str
) -> list[AllreduceRow]:
    return [AllreduceRow.unavailable(path, workers, s, dtype, note, redop=op) for s in sizes]


def _launch_ranks(
    peer: str, workers: int, sizes: Sequence[str], dtype: str, op: str, warmup: int,
    iters: int, check: bool, timeout_s: float, extra: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], str | None]:
    """Run the peer's ranks over ``sizes``; the result lines rank 0 wrote, and what went
    wrong (None when every process exited 0). ``extra``: more rank arguments."""
    with tempfile.TemporaryDirectory(prefix=f"semfab-{peer}-") as tmp:
        tmpdir = Path(tmp)
        result = tmpdir / "result.jsonl"
        common = [
            "--sizes", ",".join(sizes),
            "--dtype", dtype,
            "--op", op,
            "--warmup", str(warmup),
            "--iters", str(iters),
            "--check", "1" if check else "0",
            "--world", str(workers),
            "--timeout", f"{timeout_s:g}",
            "--result", str(result),
            *extra,
        ]
        env = _child_env()
        if peer == "gloo":
            init = f"tcp://127.0.0.1:{_free_port()}"
            # Keep gloo on loopback: resolving the hostname to an interface
            # fails or picks a real NIC on hosts with odd network setups.
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            cmds = [
                [sys.executable, "-m", "bench.peer_gloo", "--rank", str(r), "--init", init,
                 *common]
                for r in range(workers)
            ]
            names = [f"gloo rank {r}" for r in range(workers)]
        else:
            mpirun = _find_mpirun()
            assert mpirun is not None  # peer_status said it exists
            cmds = [[*_mpi_launch(mpirun, workers), sys.executable, "-m", "bench.peer_mpi",
                     *common]]
            names = ["mpirun"]
            env = _mpi_env(env)
        error = _run_processes(cmds, env, tmpdir, timeout_s, names)
        lines: list[dict[str, Any]] = []
        if result.exists():
            for raw in result.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    lines.append(json.loads(raw))
    return lines, error


def dtype_unsupported(peer: str, collective: str, dtype: str) -> str | None:
    """None when ``peer`` can run ``collective`` in ``dtype``, else the reason.

    MPI has no bfloat16 datatype: a collective that only moves data moves its
    bits as 16-bit integers (exact), one that reduces cannot run.
    """
    from bench import nccl

    if peer == "mpi" and dtype == "bfloat16" and collective in nccl.REDUCING:
        return (f"MPI has no bfloat16 datatype to reduce ({collective} with MPI.SUM/MAX/MIN "
                "needs one; mpi4py does not know ml_dtypes' bfloat16)")
    return None


def _run_collective_peer(
    peer: str, workers: int, sizes: Sequence[int | str], dtype: str, warmup: int, iters: int,
    check: bool, timeout_s: float, op: str, collective: str, root: int,
) -> list[AllreduceRow]:
    """:func:`run_peer` for the collective set: one row per swept size."""
    from bench import nccl

    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: allreduce, "
                         f"{', '.join(COLLECTIVES)}")
    if collective == "sendrecv" and workers < 2:
        raise ValueError("sendrecv needs at least 2 workers")
    if collective in nccl.ROOTED and not 0 <= root < workers:
        raise ValueError(f"root {root} is not a rank of {workers} workers")
    itemsize = dtype_itemsize(dtype)
    swept = [parse_size(s) for s in sizes]
    for given, s in zip(sizes, swept, strict=True):
        if nccl.per_rank_count(collective, s, itemsize, workers) == 0:
            raise ValueError(f"size {given!r} gives no element per rank of {collective} "
                             f"over {workers} ranks in {dtype}")
    if not swept:
        return []

    def failed(note: str) -> list[AllreduceRow]:
        return [nccl.unavailable_row(collective, peer, workers, s, dtype, op, root, note)
                for s in swept]

    reason = peer_status()[peer] or dtype_unsupported(peer, collective, dtype)
    if reason is not None:
        return failed(f"unavailable: {reason}")
    lines, error = _launch_ranks(peer, workers, [str(s) for s in swept], dtype, op, warmup,
                                 iters, check, timeout_s,
                                 ["--collective", collective, "--root", str(root)])
    by_size = {int(line["swept"]): line for line in reversed(lines)}
    rows: list[AllreduceRow] = []
    for s in swept:
        got = by_size.get(s)
        if got is None:
            why = error or "no result came back for this size"
            rows += [nccl.unavailable_row(collective, peer, workers, s, dtype, op, root,
                                          f"failed: {peer} with {workers} workers: {why}")]
            continue
        rows.append(nccl.make_row(collective, peer, workers, int(got["size_bytes"]),
                                  int(got["count"]), dtype, op, root, got["samples_us"],
                                  int(got["wrong"])))
    return rows


def run_peer(
    peer: str,
    workers: int,
    sizes: Sequence[int | str],
    dtype: str = "float32",
    warmup: int = 3,
    iters: int = 10,
    check: bool = True,
    timeout_s: float = 300,
    op: str = "sum",
    collective: str = "allreduce",
    root: int = 0,
) -> list[AllreduceRow]:
    """Measure one peer's allreduce (or another ``collective`` of the set, with
    ``root`` for broadcast and reduce); one row per size, in the order given.

    Never raises for a missing or failing peer: those rows carry
    ``note="unavailable: <reason>"`` or ``note="failed: <what happened>"``.
    Arguments that can never work (workers < 1, iters < 1, unknown peer or
    op, a size smaller than one element) raise ValueError.

    For the collective set, sizes are swept sizes and rows are
    :class:`~bench.report.CollectiveRow` with nccl-tests' size and count
    (:mod:`bench.nccl`).
    """
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(_OPS)}")
    if collective != "allreduce":
        return _run_collective_peer(peer, workers, sizes, dtype, warmup, iters, check,
                                    timeout_s, op, collective, root)
    itemsize = dtype_itemsize(dtype)
    # nccl-tests rounds a size down to whole elements; so do we, and the row
    # reports the bytes that actually moved.
    byte_sizes = [parse_size(s) // itemsize * itemsize for s in sizes]
    for given, s in zip(sizes, byte_sizes, strict=True):
        if s == 0:
            raise ValueError(f"size {given!r} is smaller than one {dtype} element")
    if not byte_sizes:
        return []

    reason = peer_status()[peer]
    if reason is not None:
        return _rows_for_failure(peer, workers, byte_sizes, dtype, op, f"unavailable: {reason}")

    lines, error = _launch_ranks(peer, workers, [str(s) for s in byte_sizes], dtype, op,
                                 warmup, iters, check, timeout_s)

    by_size: dict[int, dict[str, Any]] = {}
    for line in lines:
        by_size.setdefault(int(line["size_bytes"]), line)
    rows: list[AllreduceRow] = []
    for s in byte_sizes:
        got = by_size.get(s)
        if got is None:
            why = error or "no result came back for this size"
            rows.append(AllreduceRow.unavailable(
                peer, workers, s, dtype, f"failed: {peer} with {workers} workers: {why}",
                redop=op))
            continue
        rows.append(AllreduceRow.from_samples(
            peer, workers, s, dtype, op, got["samples_us"], int(got["wrong"])))
    return rows


def run_gloo(
    workers: int,
    sizes: Sequence[int | str],
    dtype: str = "float32",
    warmup: int = 3,
    iters: int = 10,
    check: bool = True,
    timeout_s: float = 300,
    op: str = "sum",
) -> list[AllreduceRow]:
    """Allreduce with ``torch.distributed`` (gloo backend, CPU tensors), ``workers`` processes.

    Rendezvous over tcp://127.0.0.1 on a free port. See :func:`run_peer`.
    """
    return run_peer("gloo", workers, sizes, dtype, warmup, iters, check, timeout_s, op)


def run_mpi(
    workers: int,
    sizes: Sequence[int | str],
    dtype: str = "float32",
    warmup: int = 3,
    iters: int = 10,
    check: bool = True,
    timeout_s: float = 300,
    op: str = "sum",
) -> list[AllreduceRow]:
    """Allreduce with mpi4py's ``Comm.Allreduce`` on NumPy buffers under ``mpirun -np workers``.

    See :func:`run_peer`.
    """
    return run_peer("mpi", workers, sizes, dtype, warmup, iters, check, timeout_s, op)
