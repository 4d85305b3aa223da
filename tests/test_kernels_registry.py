"""kernels/ backend registry: availability, auto choice, error messages, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kernels
from kernels import BackendInfo, BackendUnavailable, describe_backends, get_backend, gpu_info
from kernels import backends as B


def _infos(cupy: bool, cuda: str | None, numba_cpu: bool = True) -> list[BackendInfo]:
    """cuda: None (unavailable), "sim" or "gpu"."""
    return [
        BackendInfo("numpy", True, "", "cpu"),
        BackendInfo("numba-cpu", numba_cpu, "" if numba_cpu else "numba missing", "cpu"),
        BackendInfo(
            "numba-cuda",
            cuda is not None,
            B.SIMULATOR_REASON if cuda == "sim" else ("" if cuda else "no CUDA GPU found"),
            "",
        ),
        BackendInfo("cupy", cupy, "" if cupy else "cupy not installed", ""),
    ]


def test_describe_backends_lists_all_with_reasons() -> None:
    infos = describe_backends()
    assert [i.name for i in infos] == ["numpy", "numba-cpu", "numba-cuda", "cupy"]
    by = {i.name: i for i in infos}
    assert by["numpy"].available and by["numba-cpu"].available
    for i in infos:
        assert i.available or i.reason, f"{i.name}: unavailable needs a reason"
    if B.cuda_simulator_enabled():
        assert by["numba-cuda"].available and "simulator" in by["numba-cuda"].reason
        assert "never chosen by auto" in by["numba-cuda"].reason


def test_auto_prefers_gpus_and_never_the_simulator() -> None:
    assert B.choose_auto(_infos(cupy=True, cuda="gpu")) == "cupy"
    assert B.choose_auto(_infos(cupy=False, cuda="gpu")) == "numba-cuda"
    assert B.choose_auto(_infos(cupy=False, cuda="sim")) == "numba-cpu"
    assert B.choose_auto(_infos(cupy=False, cuda=None)) == "numba-cpu"
    assert B.choose_auto(_infos(cupy=False, cuda="sim", numba_cpu=False)) == "numpy"


def test_auto_here_is_not_the_simulator() -> None:
    b = get_backend("auto")
    assert b.name in ("cupy", "numba-cuda", "numba-cpu")
    if B.cuda_simulator_enabled():
        assert b.name != "numba-cuda"
    assert get_backend("auto") is b, "one shared instance"


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: auto, numpy, numba-cpu, numba-cuda, cupy"):
        get_backend("tpu")


def test_unavailable_backend_says_why_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        B._PROBES, "cupy", lambda: BackendInfo("cupy", False, "cupy not installed", "")
    )
    monkeypatch.delitem(B._INSTANCES, "cupy", raising=False)
    with pytest.raises(BackendUnavailable) as exc:
        get_backend("cupy")
    msg = str(exc.value)
    assert "'cupy'" in msg and "cupy not installed" in msg and "pip install" in msg
    assert isinstance(exc.value, ValueError)
    monkeypatch.setitem(
        B._PROBES,
        "numba-cuda",
        lambda: BackendInfo("numba-cuda", False, "no CUDA GPU found", ""),
    )
    monkeypatch.delitem(B._INSTANCES, "numba-cuda", raising=False)
    with pytest.raises(BackendUnavailable, match="no CUDA GPU found.*NUMBA_ENABLE_CUDASIM"):
        get_backend("numba-cuda")


def test_missing_or_broken_cupy_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    info = B._probe_cupy()
    assert not info.available and info.reason == "cupy not installed"


def test_gpu_info_without_gpu() -> None:
    if B._probe_cupy().available:
        pytest.skip("a GPU is present")
    if B.cuda_simulator_enabled():
        assert gpu_info() is None


def test_import_is_light_and_lazy() -> None:
    code = (
        "import sys, kernels; "
        "print(int('cupy' in sys.modules), int('numba.cuda' in sys.modules), "
        "int('numba' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0", "0"]


def test_public_api() -> None:
    for name in ("get_backend", "describe_backends", "BackendUnavailable", "BackendInfo", "DTYPES"):
        assert hasattr(kernels, name)
    info = describe_backends()[0]
    with pytest.raises(AttributeError):
        info.available = False  # type: ignore[misc]
