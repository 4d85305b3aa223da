"""Bring a serving chain up and down from the launcher's side.

    from fabric.serving.config import ServeConfig
    from fabric.serving.runner import ServingChain

    with ServingChain(ServeConfig(transport="direct"), workers=1) as chain:
        print(chain.url)          # http://127.0.0.1:PORT
        ...                       # any OpenAI client
    print(chain.results["host"]["counters"])

A chain is three kinds of fabric task: :func:`~fabric.serving.generator.generate`
on every worker, :func:`~fabric.serving.generator.relay` on ``host1`` (only
for ``host-staged``), and :func:`~fabric.serving.http.serve` on ``host0``.
The chain launches its own fabric (a star with one or two hosts) unless given
one, so a benchmark can run strategy after strategy on the same processes.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fabric.core.topology import star
from fabric.emulation.launcher import Fabric, Task, launch
from fabric.errors import FabricTimeout, PeerFailed, UsageError
from fabric.serving.assets import ensure_assets
from fabric.serving.config import ServeConfig

log = logging.getLogger("semfab.serving.runner")


def hosts_needed(transports: list[str] | tuple[str, ...]) -> int:
    """Host nodes a fabric needs for these transports (host-staged needs the relay)."""
    return 2 if "host-staged" in transports else 1


def launch_for(transports: list[str] | tuple[str, ...], workers: int = 1,
               **kwargs: Any) -> Fabric:
    """A star fabric with the hosts the given transports need (its run folder gets
    the ``fabric.json`` every launched fabric writes, so `semfab stats` finds it)."""
    return launch(topology=star(workers, hosts=hosts_needed(transports)), **kwargs)


class ServingChain:
    """One strategy's tasks on a fabric; ``url`` once started."""

    def __init__(self, cfg: ServeConfig, *, fabric: Fabric | None = None, workers: int = 1,
                 run_dir: str | Path | None = None, timeout_s: float = 30.0,
                 ready_timeout_s: float = 180.0) -> None:
        self.cfg = cfg.replace()
        self.cfg.check()
        self.fab = fabric
        self._own = fabric is None
        self.workers = workers
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.url = ""
        self.tasks: dict[str, Task] = {}
        self.results: dict[str, Any] = {}

    def start(self) -> ServingChain:
        """Launch (if needed), start every task, wait until the HTTP server answers."""
        cfg = self.cfg
        if not cfg.assets_dir:
            cfg.assets_dir = str(ensure_assets())
        try:
            if self.fab is None:
                self.fab = launch_for([cfg.transport], self.workers, run_dir=self.run_dir,
                                      timeout_s=self.timeout_s)
            fab = self.fab
            names = {n.name for n in fab.topo.hosts}
            if "host0" not in names:
                raise UsageError("the serving chain needs a host node named host0")
            if cfg.transport == "host-staged" and cfg.relay not in names:
                raise UsageError(f"host-staged needs a second host node {cfg.relay!r} "
                                 "(launch with hosts=2)")
            cfg.session = secrets.randbelow(1 << 31) + 1
            cfg.secret = secrets.token_hex(16)
            ready = Path(fab.run_dir) / f"serve-{cfg.session:x}.json"
            shared = getattr(fab, "shared_files", True)
            if shared:
                cfg.ready_file = str(ready.resolve())
            else:  # host0 on another host: it listens on its address, and is asked
                placed: Any = fab  # a fabric.emulation.rendezvous.PlacedFabric
                cfg.host, cfg.port = placed.serve_address
                cfg.ready_file = ""
            from fabric.serving import generator, http

            cfg.bells = _bells_fit(fab, cfg)
            if cfg.transport == "host-staged":
                self.tasks["relay"] = fab.submit(generator.relay, cfg, nodes=[cfg.relay])
            if cfg.runs_model:
                from fabric.serving import sharded

                if len(fab.topo.workers) % cfg.group_size:
                    raise UsageError(f"{len(fab.topo.workers)} workers do not split into "
                                     f"groups of tp {cfg.tp} x ep {cfg.ep} x pp {cfg.pp}; "
                                     f"use a multiple of {cfg.group_size} workers")
                self.tasks["workers"] = fab.submit(sharded.generate_sharded, cfg)
            else:
                self.tasks["workers"] = fab.submit(generator.generate, cfg)
            self.tasks["host"] = fab.submit(http.serve, cfg, nodes=["host0"])
            self.url = self._wait_ready(ready if shared else None)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, ready: Path | None) -> str:
        """The server's URL once it answers: from the file host0 writes, or (``ready``
        None: host0 on another host) by asking it at its address."""
        assert self.fab is not None
        deadline = time.monotonic() + self.ready_timeout_s
        asked = f"http://{self.cfg.host}:{self.cfg.port}"
        while True:
            if ready is None:
                if _answers(asked + "/v1/models"):
                    return asked
            elif ready.is_file():
                info = json.loads(ready.read_text())
                if info.get("error"):  # e.g. the port is taken: the host said so
                    raise UsageError(str(info["error"]))
                return str(info["url"])
            if time.monotonic() > deadline:
                raise FabricTimeout(f"the serving chain did not come up within "
                                    f"{self.ready_timeout_s:g}s (logs in {self.fab.run_dir})")
            for name, task in list(self.tasks.items()):
                try:
                    got = self.fab.wait(task, timeout_s=0.05)
                except FabricTimeout:
                    continue
                del self.tasks[name]  # its result is in hand: stop() must not wait for it
                self.results[name] = got if name == "workers" else got[0]
                if ready is None and name == "host" and got[0].get("error"):
                    raise UsageError(str(got[0]["error"]))
                if ready is not None and ready.is_file() and \
                        json.loads(ready.read_text()).get("error"):
                    break  # the host failed with a reason, and stopped the others
                raise PeerFailed(f"the {name} task of the serving chain ended before it "
                                 f"was ready (logs in {self.fab.run_dir})")

    def wait_host(self, timeout_s: float) -> bool:
        """True when the host task has ended (raises TaskFailed if it failed)."""
        if self.fab is None or "host" not in self.tasks:
            return True
        try:
            self.results["host"] = self.fab.wait(self.tasks["host"], timeout_s=timeout_s)[0]
        except FabricTimeout:
            return False
        del self.tasks["host"]
        return True

    def _known_url(self, wait_s: float) -> str:
        """The server's URL, also when start() was interrupted (Ctrl-C) before it
        learnt it: a host left running would hold stop() for its whole timeout."""
        if self.url or "host" not in self.tasks:
            return self.url
        if not self.cfg.ready_file:  # host0 on another host, at a fixed address
            return f"http://{self.cfg.host}:{self.cfg.port}"
        ready = Path(self.cfg.ready_file)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if ready.is_file():
                try:
                    return str(json.loads(ready.read_text()).get("url") or "")
                except (OSError, ValueError, AttributeError):
                    return ""
            time.sleep(0.05)
        return ""

    def request_stop(self) -> bool:
        """Ask the host to shut the chain down; False if it did not answer."""
        url = self._known_url(wait_s=5.0)
        if not url:
            return False
        req = urllib.request.Request(url + "/semfab/shutdown", data=b"", method="POST",
                                     headers={"X-Semfab-Secret": self.cfg.secret})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError) as exc:
            log.warning("shutdown request failed: %s", exc)
            return False

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Stop every task and collect their results (``host``, ``workers``, ``relay``)."""
        if self.fab is None or not self.tasks:
            return self.results
        self.request_stop()
        errors = []
        for name in ("host", "workers", "relay"):
            task = self.tasks.pop(name, None)
            if task is None:
                continue
            try:
                got = self.fab.wait(task, timeout_s=timeout_s)
                self.results[name] = got if name == "workers" else got[0]
            except Exception as exc:
                errors.append(f"{name}: {exc}")
        if errors:
            raise PeerFailed("the serving chain did not stop cleanly: " + "; ".join(errors))
        return self.results

    def close(self) -> None:
        """Stop the tasks (best effort) and close the fabric if this chain launched it."""
        try:
            if self.tasks:
                try:
                    self.stop(timeout_s=10.0)
                except Exception as exc:
                    log.warning("%s", exc)
        finally:
            if self._own and self.fab is not None:
                self.fab.close()

    def __enter__(self) -> ServingChain:
        return self.start() if not self.url else self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            try:
                self.stop()
            finally:
                self.close()
        else:
            self.close()


def _answers(url: str) -> bool:
    """True when ``url`` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _bells_fit(fab: Any, cfg: ServeConfig) -> bool:
    """``direct`` may skip the sockets (fabric.emulation.doorbell) when every generator shares
    host0's host and no link on the way is shaped, delays or drops: the doorbell
    has no switch on it to shape or fault its frames."""
    from fabric.emulation import doorbell as db

    if cfg.transport != "direct" or not db.enabled() or bool(getattr(fab, "faults", "")):
        return False
    topo = fab.topo
    home = topo.host_address("host0")
    for w in topo.workers:
        if topo.host_address(w.name) != home:
            return False
        for link in topo.path_links(w.name, "host0"):
            p = link.params
            if p.shaped or p.latency_us > 0 or p.loss > 0:
                return False
    return True
