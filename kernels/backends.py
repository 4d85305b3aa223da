"""Backend registry: which backends exist, which work here, and why not.

``get_backend("auto")`` picks cupy, then numba-cuda on a REAL GPU, else
numba-cpu (never the CUDA simulator, which is correct but very slow).
Heavy or optional imports (numba, numba.cuda, cupy) happen only inside the
probe and factory functions, so importing :mod:`kernels` never fails because
a GPU library is missing or broken.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import reference

if TYPE_CHECKING:
    from .reference import ToyDecoder

BACKEND_NAMES: tuple[str, ...] = ("numpy", "numba-cpu", "numba-cuda", "cupy")
VALID_NAMES: tuple[str, ...] = ("auto", *BACKEND_NAMES)

SIMULATOR_REASON = (
    "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): correct but slow, never chosen by auto"
)

_HINTS = {
    "numba-cpu": "install numba (pip install numba) or use --backend numpy",
    "numba-cuda": (
        "it needs an NVIDIA GPU with a working CUDA driver; use --backend numba-cpu, "
        "or set NUMBA_ENABLE_CUDASIM=1 to run its kernels on the (slow) CUDA simulator"
    ),
    "cupy": (
        "install the GPU extra (pip install 'semfab[gpu]') on a machine with an NVIDIA GPU, "
        "or use --backend auto / numba-cpu / numpy"
    ),
}


class BackendUnavailable(ValueError):
    """The requested backend cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class BackendInfo:
    """Availability of one backend, as shown by ``semfab info``."""

    name: str
    available: bool
    reason: str
    device: str


class Backend(ABC):
    """One implementation of every kernel, with the signatures of :mod:`kernels.reference`.

    Arrays are the backend's own (NumPy for CPU backends, device arrays on a
    GPU); device backends also accept host NumPy arrays and copy as needed,
    writing results back into host outputs. On device backends bfloat16 is
    held as uint16 bit patterns (``to_host`` restores the ml_dtypes type).
    """

    name: str = ""
    device: str = ""

    # --- data movement -------------------------------------------------
    @abstractmethod
    def asarray(self, a: np.ndarray) -> Any:
        """Copy (or wrap) a host array into this backend's memory."""

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray:
        """Return a host NumPy array (bfloat16 as ml_dtypes.bfloat16)."""

    def empty(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        """Uninitialised array of a project dtype in this backend's memory."""
        from .dtypes import np_dtype

        return self.asarray(np.empty(shape, dtype=np_dtype(dtype)))

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU backends); use before timing."""
        return None

    # --- kernels ---------------------------------------------------------
    @abstractmethod
    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        """See :func:`kernels.reference.make_tensor`."""

    @abstractmethod
    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        """See :func:`kernels.reference.multicast_reduce`."""

    def reduce_into(self, acc: Any, x: Any, op: str) -> None:
        """``acc = op(acc, x)`` in place; see :func:`kernels.reference.reduce_into`."""
        self.multicast_reduce([acc, x], [acc], op)

    def choose_scale(self, max_abs: float, contributors: int, bits: int = 32) -> float:
        """See :func:`kernels.reference.choose_scale` (host arithmetic, same everywhere)."""
        return reference.choose_scale(max_abs, contributors, bits)

    @abstractmethod
    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        """See :func:`kernels.reference.quantize`."""

    @abstractmethod
    def dequantize(self, q: Any, scale: float) -> Any:
        """See :func:`kernels.reference.dequantize`."""

    @abstractmethod
    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        """See :func:`kernels.reference.moe_topk`."""

    @abstractmethod
    def decoder_step(
        self,
        weights: ToyDecoder,
        tokens: Any,
        hidden: Any,
        positions: Any,
        temperature: float,
        seed: int,
    ) -> tuple[Any, Any]:
        """See :func:`kernels.reference.decoder_step`."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------


def cuda_simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is (or will be) active in this process."""
    try:
        from numba import config
    except Exception:
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    return bool(getattr(config, "ENABLE_CUDASIM", 0))


def _probe_numpy() -> BackendInfo:
    return BackendInfo("numpy", True, "", "cpu (NumPy reference)")


def _probe_numba_cpu() -> BackendInfo:
    try:
        import numba
    except Exception as exc:  # ImportError, or a broken llvmlite
        return BackendInfo("numba-cpu", False, f"numba cannot be imported: {exc}", "")
    return BackendInfo("numba-cpu", True, "", f"cpu ({numba.get_num_threads()} threads)")


def _probe_numba_cuda() -> BackendInfo:
    try:
        from numba import cuda
    except Exception as exc:
        return BackendInfo("numba-cuda", False, f"numba.cuda cannot be imported: {exc}", "")
    if cuda_simulator_enabled():
        return BackendInfo("numba-cuda", True, SIMULATOR_REASON, "cuda-simulator (cpu)")
    try:
        ok = cuda.is_available()
    except Exception as exc:
        return BackendInfo("numba-cuda", False, f"CUDA driver error: {exc}", "")
    if not ok:
        return BackendInfo(
            "numba-cuda", False, "no CUDA GPU found (numba.cuda.is_available() is False)", ""
        )
    try:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    except Exception as exc:
        return BackendInfo("numba-cuda", False, f"CUDA device error: {exc}", "")
    return BackendInfo("numba-cuda", True, "", f"cuda:0 {name}")


def _probe_cupy() -> BackendInfo:
    try:
        import cupy
    except ImportError:
        return BackendInfo("cupy", False, "cupy not installed", "")
    except Exception as exc:  # e.g. a cupy wheel built for another CUDA
        return BackendInfo("cupy", False, f"cupy fails to import: {exc}", "")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return BackendInfo("cupy", False, f"no CUDA GPU found (cupy: {exc})", "")
    if count < 1:
        return BackendInfo("cupy", False, "no CUDA GPU found", "")
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception:
        name = "GPU"
    return BackendInfo("cupy", True, "", f"cuda:0 {name}")


_PROBES = {
    "numpy": _probe_numpy,
    "numba-cpu": _probe_numba_cpu,
    "numba-cuda": _probe_numba_cuda,
    "cupy": _probe_cupy,
}


def describe_backends() -> list[BackendInfo]:
    """Availability of every backend (for ``semfab info``), in preference order."""
    return [_PROBES[name]() for name in BACKEND_NAMES]


def gpu_info() -> str | None:
    """One line about the CUDA GPU (name, compute capability, memory), or None."""
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gib = props["totalGlobalMem"] / 2**30
        return f"{name} (compute {props['major']}.{props['minor']}, {gib:.1f} GiB)"
    except Exception:
        pass
    if cuda_simulator_enabled():
        return None
    try:
        from numba import cuda

        if not cuda.is_available():
            return None
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        major, minor = dev.compute_capability
        _, total = cuda.current_context().get_memory_info()
        return f"{name} (compute {major}.{minor}, {total / 2**30:.1f} GiB)"
    except Exception:
        return None


# --------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------

_INSTANCES: dict[str, Backend] = {}


def _create(name: str) -> Backend:
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "numba-cpu":
        from .numba_cpu import NumbaCpuBackend

        return NumbaCpuBackend()
    if name == "numba-cuda":
        from .numba_cuda import NumbaCudaBackend

        return NumbaCudaBackend()
    from .cupy_backend import CupyBackend

    return CupyBackend()


def choose_auto(infos: Sequence[BackendInfo] | None = None) -> str:
    """The backend ``auto`` resolves to: cupy, real-GPU numba-cuda, numba-cpu, numpy.

    Probes lazily in that order (so a CPU-only run never initialises CUDA
    more than needed); ``infos`` replaces the probes, for tests.
    """
    table = {i.name: i for i in infos} if infos is not None else None

    def info(name: str) -> BackendInfo:
        return table[name] if table is not None else _PROBES[name]()

    if info("cupy").available:
        return "cupy"
    cuda_info = info("numba-cuda")
    if cuda_info.available and cuda_info.reason != SIMULATOR_REASON:
        return "numba-cuda"
    if info("numba-cpu").available:
        return "numba-cpu"
    return "numpy"


def get_backend(name: str = "auto") -> Backend:
    """Return the backend called ``name`` (one shared instance per name).

    Raises :class:`BackendUnavailable` (a ValueError) when it cannot run
    here, and ValueError listing the valid names for an unknown name.
    """
    if name not in VALID_NAMES:
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(VALID_NAMES)}")
    if name == "auto":
        name = choose_auto()
    if name in _INSTANCES:
        return _INSTANCES[name]
    info = _PROBES[name]()
    if not info.available:
        raise BackendUnavailable(
            f"backend {name!r} is not available: {info.reason}; {_HINTS.get(name, '')}"
        )
    backend = _create(name)
    _INSTANCES[name] = backend
    return backend
