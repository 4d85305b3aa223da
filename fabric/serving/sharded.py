"""The generator of a sharded model: a group of workers that is one generator.

With ``--model tiny --tp 2 --ep 2`` every group of ``tp x ep x pp`` workers
runs :class:`fabric.core.decode_workload.DecodeShard`, one rank each, and the
groups are the data-parallel replicas host0 balances requests over.

* The group's first rank, the **leader**, takes host0's requests (ADD, ABORT).
  Before each step it sends every other rank the step's **plan**: who joins
  (prompt, limits, seed, which attention replica), who was aborted, or stop.
  The plan is a reliable stream (a 16-byte header, and a body when the batch
  changes), so every rank changes its copy of the batch alike.
* Then every rank takes the step together: attention over its heads, the TP
  allreduces, MoE dispatch and combine across the replicas, the stages' sends.
  A joining prompt is prefilled in its first step (all its tokens at once).
* Each attention replica's first rank (stage 0, TP rank 0), the **emitter**,
  sends its sequences' new tokens to host0 as the toy generator does (direct
  WRITEs into the token ring, or host-staged). Finishing is decided from
  ``max_tokens`` alone, so every rank retires the same sequences.

Tokens are exactly the unsharded model's (fixed point, :mod:`fabric.core.decoder`):
`semfab serve --model tiny` and `--model tiny --tp 2 --ep 2` answer a greedy
request with the same text.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import msgpack
import numpy as np

from fabric.core.decode_workload import DecodeShard
from fabric.core.frame import Op
from fabric.core.model import get_model
from fabric.core.workload import Context, Recv, Send, Together
from fabric.emulation.workloads import drive, perform
from fabric.errors import UsageError
from fabric.serving import records as rec
from fabric.serving.clock import now_ns
from fabric.serving.config import ServeConfig
from fabric.serving.generator import MAX_STEP_LOG, PROBE_INTERVAL_MS, Generator, _Batch, retire
from fabric.serving.generator import generate as _generate

__all__ = ["NET_PARTS", "ShardedGenerator", "generate_sharded"]

log = logging.getLogger("semfab.serving.sharded")

#: Plan header: (body bytes, step number).
PLAN_HEADER = 2
#: Rows of a joining prompt prefilled (its last ones), as the toy decoder does.
PREFILL_TOKENS = 256
#: A step's waits on the network (the rest of the step is the rank's own work).
NET_PARTS = ("tp", "dispatch", "combine", "pp", "plan")


class ShardedGenerator(Generator):
    """One rank of a sharded model's generator group (see the module docstring)."""

    def _load_model(self) -> str:
        ep, cfg = self.ep, self.cfg
        size = cfg.group_size
        if ep.world % size:
            raise UsageError(f"{ep.world} workers do not split into groups of tp {cfg.tp} x "
                             f"ep {cfg.ep} x pp {cfg.pp} = {size}")
        self.model = get_model(cfg.model)
        self.gbase = ep.rank - ep.rank % size  # the group's first world rank
        self.lrank = ep.rank - self.gbase
        kernels = self._kernels()  # the attention's (the rest of the model is NumPy)
        self.shard = DecodeShard(Context(ep.rank, ep.world, ep.name), self.model, cfg.tp,
                                 cfg.ep, cfg.pp, self.lrank, base=self.gbase,
                                 weights_seed=cfg.seed, variant=cfg.moe, path=cfg.tp_path,
                                 attention=kernels.attention_fixed)
        self.leader = self.lrank == 0
        self.leader_id = int(ep.worker_ids[self.gbase])
        self.followers = list(range(self.gbase + 1, self.gbase + size))
        self.emitter = self.shard.s == 0 and self.shard.r == 0
        # every rank's copy of every replica's batch (its own replica's tokens alone
        # are real on it): the plan changes them alike
        self.replicas = [_Batch(cfg.max_batch, 1) for _ in range(cfg.ep)]
        self.parts: deque[dict[str, float]] = deque(maxlen=MAX_STEP_LOG)
        self.plan_hdr = np.zeros(PLAN_HEADER, np.int64)
        self.step_no = 0
        self.abort_next: list[int] = []
        self._probed = 0.0
        self._due = 0  # ns: when the leader may start the next step
        return str(kernels.name)

    def __init__(self, ep: Any, cfg: ServeConfig) -> None:
        from fabric.serving.assets import local_assets, model_vocab

        super().__init__(ep, cfg)
        self.batch = self.replicas[self.shard.e]
        # the model's ids are the tokenizer's most common whole-character tokens: the
        # text is the model's own output (no corpus walk)
        self.vocab = model_vocab(local_assets(cfg.assets_dir), self.model.vocab) \
            if self.emitter else np.zeros(0, np.int32)

    def text_ids(self, n: int) -> np.ndarray:
        return self.vocab[self.batch.toy[:n] % self.model.vocab]

    # ------------------------------------------------------------------ control
    def warm_up(self) -> None:
        """Nothing to compile: the tiny model's arithmetic is NumPy."""

    def ready_fields(self) -> dict[str, Any]:
        return {"admits": self.leader, "group": self.leader_id}

    def on_control(self, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == rec.STOP and not self.leader:
            self._ctrl(rec.STOPPED)  # the leader's last plan ends this rank
            return
        if t == rec.ABORT and self.leader:
            rid = int(msg["rid"])
            before = len(self.pending)
            self.pending = deque(m for m in self.pending if m["rid"] != rid)
            if len(self.pending) != before:
                self.aborted.append(rid)
            elif any(b.find(rid) is not None for b in self.replicas):
                self.abort_next.append(rid)  # leaves the batch with the next plan
            return
        super().on_control(msg)

    def _launcher_gone(self) -> bool:
        if os.getppid() != self._parent:
            log.warning("%s: launcher went away", self.ep.name)
            return True
        return False

    def _probe_idle(self) -> None:
        """An idle emitter's tail-loss probe, every PROBE_INTERVAL_MS."""
        now = time.monotonic()
        if self.emitter and now - self._probed >= PROBE_INTERVAL_MS / 1000:
            self._probed = now
            self._probe()

    # ------------------------------------------------------------------ plans
    def _lead(self) -> dict[str, Any] | None:
        """The leader: wait for work, choose who joins, send the plan (None: stop)."""
        cap = self.cfg.max_batch
        while True:
            busy = any(b.n for b in self.replicas)
            self.poll_control(0 if busy else PROBE_INTERVAL_MS)
            if self.stop or self._launcher_gone():
                self._send_plan({"stop": True})
                return None
            adds = []
            sizes = [b.n for b in self.replicas]
            while self.pending:
                q = int(np.argmin(sizes))
                if sizes[q] >= cap:
                    break
                m = self.pending.popleft()
                temp = self.cfg.temperature if m.get("temperature") is None else \
                    float(m["temperature"])
                prompt = [int(t) for t in m["prompt"]][-PREFILL_TOKENS:] or [0]
                adds.append([q, int(m["rid"]), prompt, int(m["max_tokens"]), temp,
                             m.get("seed"), int(m["start"])])
                sizes[q] += 1
            if busy or adds or self.abort_next:
                rest = self._due - now_ns()  # --step-ms / --prefill-ms: the least a step takes
                if busy and rest > 0:
                    time.sleep(rest / 1e9)
                plan = {"add": adds, "abort": self.abort_next}
                self.abort_next = []
                self._send_plan(plan)
                return plan
            self._probe_idle()

    def _send_plan(self, plan: dict[str, Any]) -> None:
        if not self.followers:
            return
        body = msgpack.packb(plan) if plan.get("add") or plan.get("abort") or \
            plan.get("stop") else b""
        self.plan_hdr[:] = (len(body), self.step_no)
        perform(self.ep, Together(tuple(Send(f, self.plan_hdr) for f in self.followers)))
        if body:
            arr = np.frombuffer(body, np.uint8)
            perform(self.ep, Together(tuple(Send(f, arr) for f in self.followers)))

    def _plan_coming(self) -> bool:
        """The leader has started sending the next plan (its frames wait in the stash)."""
        return any(f.src == self.leader_id and f.op is Op.WRITE for f in self.ep.stash)

    def _follow(self) -> dict[str, Any] | None:
        """A follower: wait (answering host0) until the leader's plan comes; None: stop."""
        while True:
            self.poll_control(0)
            if self._plan_coming():
                break
            if self.stop or self._launcher_gone():
                return None
            self._probe_idle()
            self.ep.wait(PROBE_INTERVAL_MS)
        perform(self.ep, Recv(self.gbase, self.plan_hdr))
        size, step = (int(v) for v in self.plan_hdr)
        if step != self.step_no:
            raise RuntimeError(f"{self.ep.name}: the leader's plan is for step {step}, "
                               f"this rank is at {self.step_no}")
        if not size:
            return {}
        body = np.empty(size, np.uint8)
        perform(self.ep, Recv(self.gbase, body))
        plan: dict[str, Any] = msgpack.unpackb(body.tobytes())
        return None if plan.get("stop") else plan

    def _apply(self, plan: dict[str, Any]) -> None:
        """Change every replica's batch as the plan says (alike on every rank)."""
        mine = self.shard.e
        for rid in plan.get("abort", ()):
            for q, b in enumerate(self.replicas):
                j = b.find(int(rid))
                if j is not None:
                    b.remove(j)
                    if q == mine:
                        self.shard.cache.drop(int(rid))
                    if self.leader:
                        self.aborted.append(int(rid))
        for q, rid, prompt, max_tokens, temp, seed, start in plan.get("add", ()):
            self.replicas[q].add(rid, prompt, max_tokens, temp, start,
                                 None if seed is None else int(seed))
            if self.cfg.record and q == mine and self.emitter:
                self.generated[rid] = []

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve in step with the group until the leader's plan says stop."""
        drive(self.ep, self.shard.open())
        while True:
            t0 = now_ns()
            plan = self._lead() if self.leader else self._follow()
            if plan is None:
                break
            t_plan = now_ns()
            self._apply(plan)
            if any(b.n for b in self.replicas):
                prefill = self._step(t0, t_plan)
                least = self.cfg.prefill_ms if prefill else self.cfg.step_ms
                self._due = t0 + int(least * 1e6)
            self.step_no += 1
        drive(self.ep, self.shard.close())

    def _step(self, t0: int, t_plan: int) -> bool:
        """One step of the group; this rank's replica's tokens out (emitter). Whether
        a prompt was prefilled in it."""
        cfg, b, shard = self.cfg, self.batch, self.shard
        n = b.n
        fresh = b.fresh[:n].copy()
        first = sum(int(r.fresh[:r.n].sum()) for r in self.replicas)  # first tokens (TTFT)
        prefill = first > 0
        counts = np.array([len(b.prompts[j]) if fresh[j] else 1 for j in range(n)], np.int64)
        feed = np.array([t for j in range(n)
                         for t in (b.prompts[j] if fresh[j] else [int(b.toy[j])])], np.int64)
        own_seed = b.seeded[:n] & (b.temp[:n] > 0)
        new = drive(self.ep, shard.step(
            counts, feed, b.rid[:n].tolist(),
            np.where(own_seed, 0, b.rid[:n]).astype(np.int64), b.pos[:n] + counts - 1,
            b.temp[:n].copy(), np.where(b.seeded[:n], b.seed[:n], np.uint64(cfg.seed)),
            index=self.step_no, batch=int(counts.sum()), prefill=prefill))
        if new is not None:
            b.toy[:n] = new
        b.pos[:n] += counts
        for r in self.replicas:  # every replica's joining prompts were prefilled
            r.fresh[:r.n] = False
            for i in range(r.n):
                r.prompts[i] = []
        t_gen = now_ns()
        part = shard.clock.steps.pop()
        part["plan"] = (t_plan - t0) / 1e9
        part["step"] = (t_gen - t0) / 1e9  # the plan and the bookkeeping included (the
        # emit below is added to it)
        waits = sum(part.get(k, 0.0) for k in NET_PARTS)
        part["compute"] = part["step"] - waits  # this rank's own work: the rest
        part["rows"] = float(sum(r.n for r in self.replicas))  # tokens the step gave...
        part["first"] = float(first)  # ...of which first tokens of their sequences
        part["t"] = float(t_gen)
        self.parts.append(part)
        # (t_gen, compute ns, step ns, rows, prefill): compute over step is the
        # compute-throughput factor of the effective experience
        self.steps.append((t_gen, int(part["compute"] * 1e9), t_gen - t0, n, prefill))
        gone = self._emit() if self.emitter and n else retire(b)
        part["emit"] = (now_ns() - t_gen) / 1e9  # the tokens handed to the transport
        for rid in gone:
            shard.cache.drop(rid)
        for r in self.replicas:
            if r is not b:
                retire(r)
        part["step"] += part["emit"]
        return prefill

    def result(self) -> dict[str, Any]:
        out = super().result()
        out.update(role={"leader": self.leader, "emitter": self.emitter,
                         "stage": self.shard.s, "replica": self.shard.e,
                         "tp_rank": self.shard.r, "group": self.gbase // self.cfg.group_size},
                   parts=list(self.parts))
        return out


def generate_sharded(ep: Any, cfg: ServeConfig) -> dict[str, Any]:
    """Worker task of a sharded model: one rank of its group's generator."""
    return _generate(ep, cfg, ShardedGenerator)
