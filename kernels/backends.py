"""Backend registry: which backends exist, which work here, and why not.

``get_backend("auto")`` picks cupy, then numba-cuda on a REAL GPU, else
numba-cpu (never the CUDA simulator, which is correct but very slow).
Heavy or optional imports (numba, numba.cuda, cupy) happen only inside the
probe and factory functions, so importing :mod:`kernels` never fails because
a GPU library is missing or broken.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Backend, BackendInfo, BackendUnavailable, cuda_simulator_enabled

__all__ = ["BACKEND_NAMES", "VALID_NAMES", "Backend", "BackendInfo", "BackendUnavailable",
           "choose_auto", "cuda_simulator_enabled", "describe_backends", "get_backend",
           "gpu_info"]

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


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------


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
