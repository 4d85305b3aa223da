"""Chrome Trace Event JSON of the token delivery chain (pure builder + one writer).

The file opens in the Perfetto UI (or chrome://tracing). Layout, per
strategy and concurrency level:

* one process per node: the generator (worker), the relay (host-staged
  only), the host, the client;
* tracks (threads): ``generation`` (one slice per decode step) and
  ``transport: send`` on the generator; ``transport: relay`` on the relay;
  ``r<N> interpretation`` and ``r<N> presentation`` per request on the host;
  ``r<N>`` per request on the client (each event received, with the
  client's detokenization when it does it);
* a flow arrow per token, from the step that generated it through every
  layer to the client.

Timestamps are microseconds from the earliest event in the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fabric.serving.metrics import ClientResult


class TraceBuilder:
    """Collects trace events; :meth:`to_json` renders them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._threads: dict[tuple[int, str], int] = {}
        self._procs: set[int] = set()
        self._flow = 0
        self._lanes: dict[tuple[int, str], list[list[int]]] = {}  # open slice ends per lane
        self.t0: int | None = None

    def _us(self, t_ns: int) -> float:
        assert self.t0 is not None
        return (t_ns - self.t0) / 1e3

    def process(self, pid: int, name: str, sort: int | None = None) -> None:
        """Name process ``pid`` (once)."""
        if pid in self._procs:
            return
        self._procs.add(pid)
        self.events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                            "args": {"name": name}})
        if sort is not None:
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                                "tid": 0, "args": {"sort_index": sort}})

    def thread(self, pid: int, name: str) -> int:
        """The tid of track ``name`` in process ``pid`` (created and named on first use)."""
        key = (pid, name)
        tid = self._threads.get(key)
        if tid is None:
            tid = 1 + sum(1 for p, _ in self._threads if p == pid)
            self._threads[key] = tid
            self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                "args": {"name": name}})
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                                "tid": tid, "args": {"sort_index": tid}})
        return tid

    def _lane(self, pid: int, track: str, start: int, end: int) -> str:
        """The first lane of ``track`` where [start, end) nests or fits after the rest.

        Trace viewers need the slices of one thread to nest properly; tokens of
        one request can overlap partially (a held half-character is released
        by a later token), so such a slice goes to a second lane,
        ``"<track> (2)"``. Slices of a track must come in order of start.
        """
        lanes = self._lanes.setdefault((pid, track), [])
        for k, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()  # ended before this one starts
            if not stack or end <= stack[-1]:
                stack.append(end)
                return track if k == 0 else f"{track} ({k + 1})"
        lanes.append([end])
        return track if len(lanes) == 1 else f"{track} ({len(lanes)})"

    def slice(self, pid: int, track: str, name: str, start_ns: int, end_ns: int,
              cat: str, args: dict[str, Any] | None = None) -> str:
        """A complete ("X") event; returns the track (lane) it went to.

        Zero-length slices get 1 ns so arrows can bind to them.
        """
        end_ns = max(end_ns, start_ns + 1)
        lane = self._lane(pid, track, start_ns, end_ns)
        ev: dict[str, Any] = {"ph": "X", "name": name, "cat": cat, "pid": pid,
                              "tid": self.thread(pid, lane), "ts": self._us(start_ns),
                              "dur": (end_ns - start_ns) / 1e3}
        if args:
            ev["args"] = args
        self.events.append(ev)
        return lane

    def flow(self, points: Sequence[tuple[int, str, int]], name: str = "token") -> None:
        """An arrow through ``(pid, track, t_ns)`` points (each inside a slice)."""
        if len(points) < 2:
            return
        self._flow += 1
        for i, (pid, track, t) in enumerate(points):
            ph = "s" if i == 0 else "f" if i == len(points) - 1 else "t"
            ev: dict[str, Any] = {"ph": ph, "id": self._flow, "name": name, "cat": "flow",
                                  "pid": pid, "tid": self.thread(pid, track),
                                  "ts": self._us(t)}
            if ph != "s":
                ev["bp"] = "e"  # bind to the enclosing slice
            self.events.append(ev)

    def to_json(self) -> dict[str, Any]:
        """The Trace Event Format object."""
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write the trace file (JSON)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        return out


def _first_time(timelines: Sequence[Mapping[str, Any]]) -> int | None:
    starts = [int(tl["t_req"]) for tl in timelines]
    return min(starts) if starts else None


def add_chain(tb: TraceBuilder, label: str, pid_base: int,
              timelines: Sequence[Mapping[str, Any]], clients: Mapping[int, ClientResult],
              max_tokens: int | None = None) -> None:
    """Add the requests ``timelines`` (host timelines with their client results).

    ``pid_base`` .. ``pid_base + 9`` are used: generators, relay, host, client.
    """
    if not timelines:
        return
    t0 = _first_time(timelines)
    if tb.t0 is None or (t0 is not None and t0 < tb.t0):
        if tb.events:
            raise ValueError("add the earliest chain first (timestamps are relative to it)")
        tb.t0 = t0
    relay_pid, host_pid, client_pid = pid_base + 7, pid_base + 8, pid_base + 9
    workers = sorted({str(tl["worker"]) for tl in timelines})
    wpid = {w: pid_base + i for i, w in enumerate(workers[:7])}
    for w, pid in wpid.items():
        tb.process(pid, f"{label} · {w} (generator)", pid)
    tb.process(host_pid, f"{label} · host0", host_pid)
    tb.process(client_pid, f"{label} · client", client_pid)
    steps: dict[str, dict[int, int]] = {w: {} for w in workers}  # t_gen -> t_sent
    relays: set[tuple[int, int]] = set()
    for tl in timelines:
        n = int(tl["received"]) if max_tokens is None else min(int(tl["received"]), max_tokens)
        for i in range(n):
            steps[str(tl["worker"])][int(tl["t_gen"][i])] = int(tl["t_sent"][i])
            if int(tl["t_ri"][i]):
                relays.add((int(tl["t_ri"][i]), int(tl["t_ro"][i])))
    send_lane: dict[tuple[str, int], str] = {}
    relay_lane: dict[int, str] = {}
    for w, by_gen in steps.items():
        wp = wpid.get(w)
        if wp is None:
            continue
        pid = wp
        prev = None
        for t_gen in sorted(by_gen):
            if prev is not None:
                tb.slice(pid, "generation", "step", prev, t_gen, "generation")
            send_lane[(w, t_gen)] = tb.slice(pid, "transport: send", "send", t_gen,
                                             by_gen[t_gen], "transport")
            prev = t_gen
    if relays:
        tb.process(relay_pid, f"{label} · host1 (relay)", relay_pid)
        for ri, ro in sorted(relays):
            relay_lane[ri] = tb.slice(relay_pid, "transport: relay", "relay", ri, ro,
                                      "transport")
    for tl in timelines:
        rid = int(tl["rid"])
        cr = clients.get(rid)
        n = int(tl["received"]) if max_tokens is None else min(int(tl["received"]), max_tokens)
        events = cr.t_events if cr is not None else []
        client_detok = bool(tl.get("client_detok"))
        for i in range(n):
            tok = int(tl["token"][i])
            t_gen, t_arr = int(tl["t_gen"][i]), int(tl["t_arrive"][i])
            t_det, t_wr = int(tl["t_detok"][i]), int(tl["t_write"][i])
            chunk = int(tl["chunk"][i])
            args = {"rid": rid, "index": i, "token": tok}
            pts: list[tuple[int, str, int]] = []
            wpid_i = wpid.get(str(tl["worker"]))
            if wpid_i is not None:
                pts.append((wpid_i, send_lane[(str(tl["worker"]), t_gen)], t_gen))
            if int(tl["t_ri"][i]):
                pts.append((relay_pid, relay_lane[int(tl["t_ri"][i])], int(tl["t_ri"][i])))
            if client_detok:
                if t_wr:
                    lane = tb.slice(host_pid, f"r{rid} presentation", "ids -> SSE", t_arr,
                                    t_wr, "presentation", args)
                    pts.append((host_pid, lane, t_arr))
            else:
                if t_det:
                    lane = tb.slice(host_pid, f"r{rid} interpretation", "detokenize", t_arr,
                                    t_det, "interpretation", args)
                    pts.append((host_pid, lane, t_arr))
                if t_det and t_wr:
                    lane = tb.slice(host_pid, f"r{rid} presentation", "SSE write", t_det, t_wr,
                                    "presentation", args)
                    pts.append((host_pid, lane, t_det))
            if t_wr and 0 <= chunk < len(events):
                t_recv = events[chunk]
                if client_detok and cr is not None and i < len(cr.t_detok):
                    lane = tb.slice(client_pid, f"r{rid}", "receive + detokenize", t_recv,
                                    cr.t_detok[i], "interpretation", args)
                else:
                    lane = tb.slice(client_pid, f"r{rid}", "receive", t_recv, t_recv + 1,
                                    "presentation", args)
                pts.append((client_pid, lane, t_recv))
            tb.flow(pts)
