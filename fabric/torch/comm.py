"""One communication thread per process, and the Work objects torch waits on.

Torch calls a process group from several threads (DDP's reducer runs in the
autograd engine's), but an endpoint is one socket: every operation is queued
to one thread that runs them in the order they were issued, and completes a
``torch.futures.Future`` whose value is the operation's output tensors (DDP
needs exactly that). A fabric failure (a timeout, a dead peer) breaks the
thread: the failed operation and every one queued after it fail at once with
that error, so nothing waits on a fabric that can no longer answer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fabric.core.calls import ended_everywhere
from fabric.errors import FabricTimeout, PeerFailed, UsageError
from fabric.torch.errors import TorchCommError, TorchOpError

__all__ = ["CommThread", "FabricWork"]


class FabricWork(dist._Work):
    """A queued operation: ``wait()`` blocks until it ran (or its deadline passed),
    ``get_future()`` resolves to its output tensors."""

    def __init__(self, future: torch.futures.Future[Any], done: threading.Event,
                 deadline_s: float, rank: int, what: str) -> None:
        super().__init__()
        self._fut = future
        self._done = done
        self._deadline_s = deadline_s
        self._rank = rank
        self._what = what
        self._trigger: Callable[[], None] | None = None

    def before_wait(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (once) before anyone waits on this Work or takes its future:
        what it waits for may not be queued yet."""
        self._trigger = fn

    def _pull(self) -> None:
        fn, self._trigger = self._trigger, None
        if fn is not None:
            fn()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the operation ran; raises its error, or a timeout."""
        self._pull()
        limit = timeout.total_seconds() if timeout and timeout.total_seconds() > 0 else None
        left = self._deadline_s - time.monotonic()
        if limit is not None:
            left = min(left, limit)
        if not self._done.wait(max(left, 0.0)):
            raise TorchCommError(self._rank, self._what,
                                   "did not complete in time (its peers did not join it)")
        self._fut.wait()  # raises the operation's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """Resolves to the output tensors."""
        self._pull()
        return self._fut

    def is_completed(self) -> bool:
        """True once the operation ran (successfully or not)."""
        self._pull()
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the operation ran without error."""
        if not self._done.is_set():
            return False
        try:
            self._fut.value()
        except Exception:
            return False
        return True

    def exception(self) -> Any:
        """The operation's error, or None."""
        if not self._done.is_set():
            return None
        try:
            self._fut.value()
        except Exception as exc:
            return exc
        return None


_STOP = object()


def _typed(exc: Exception, rank: int, what: str) -> Exception:
    """``exc`` as the backend's typed error naming ``rank`` and ``what``."""
    if isinstance(exc, (TorchCommError, TorchOpError)):
        return exc
    if isinstance(exc, UsageError):
        return TorchOpError(rank, what, str(exc))
    return TorchCommError(rank, what, f"{type(exc).__name__}: {exc}")


class CommThread:
    """Runs queued operations one by one on one thread (see the module doc)."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._q: queue.Queue[Any] = queue.Queue()
        self.broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"semfab-comm-{rank}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], result: Any, what: str) -> FabricWork:
        """Queue ``fn``; its Work resolves to ``result`` (the output tensors)."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        done = threading.Event()
        # the wait covers the queue ahead of it: each operation's own waits are bounded
        deadline = time.monotonic() + self.timeout_s * (self._q.qsize() + 2) + 5.0
        self._q.put((fn, result, fut, done, what))
        return FabricWork(fut, done, deadline, self.rank, what)

    def deferred(self, result: Any, what: str) -> tuple[FabricWork, Callable[[Any], None]]:
        """A Work completed by whoever calls the returned function (with None, or
        the error) on the comm thread: the parts of a batch run as one operation."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        done = threading.Event()
        deadline = time.monotonic() + self.timeout_s * (self._q.qsize() + 2) + 5.0

        def complete(error: Any) -> None:
            if done.is_set():
                return  # completed already (the batch's error reaches each part twice)
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(_typed(error, self.rank, what))
            done.set()

        return FabricWork(fut, done, deadline, self.rank, what), complete

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the thread and return its value (setup, statistics)."""
        box: list[Any] = []
        work = self.submit(lambda: box.append(fn()), None, what)
        work.wait()
        return box[0]

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fn, result, fut, done, what = item
            try:
                if self.broken is not None:
                    raise TorchCommError(self.rank, what, "not run: an earlier operation "
                                           f"failed ({self.broken})")
                fn()
                fut.set_result(result)
            except Exception as exc:
                err = _typed(exc, self.rank, what)
                if isinstance(exc, (FabricTimeout, PeerFailed)) and not ended_everywhere(exc):
                    self.broken = err  # (a call that ended on every rank leaves it usable)
                fut.set_exception(err)
            finally:
                if not fut.done():  # something beyond Exception: still complete the Work
                    fut.set_exception(TorchCommError(self.rank, what, "interrupted"))
                done.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Let the queued operations run, then end the thread."""
        self._q.put(_STOP)
        self._thread.join(timeout_s)
