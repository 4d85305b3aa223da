"""Path and numerics choices of the semfab backend (fabric.torch.options)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fabric.errors import UsageError  # noqa: E402
from fabric.torch.options import AUTO_MEM_MIN_BYTES, Options, path_for, timeout_from_env  # noqa: E402


def test_each_setting_maps_every_collective_to_a_path_it_has() -> None:
    from fabric.core.collective_programs import COLLECTIVES

    for path in ("ina", "ina-mem", "host-ring", "auto"):
        for kind, paths in COLLECTIVES.items():
            assert path_for(kind, path, 1 << 20, True) in paths, (path, kind)


def test_allreduce_paths() -> None:
    assert path_for("allreduce", "host-ring", 10, True) == "host-ring"
    assert path_for("allreduce", "ina-mem", 10, True) == "ina-mem"
    # auto: the memory plane for large tensors, and only where every rank can use it
    assert path_for("allreduce", "auto", AUTO_MEM_MIN_BYTES, True) == "ina-mem"
    assert path_for("allreduce", "auto", AUTO_MEM_MIN_BYTES - 1, True) == "ina"
    assert path_for("allreduce", "auto", 1 << 30, False) == "ina"
    assert path_for("allreduce", "ina-mem", 1 << 30, False) == "ina"


def test_options_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMFAB_PATH", "host-ring")
    monkeypatch.setenv("SEMFAB_NUMERICS", "fixed")
    monkeypatch.setenv("SEMFAB_CHECK", "1")
    assert Options().resolved() == Options("host-ring", "fixed", True)
    assert Options(path="ina", check=False).resolved() == Options("ina", "fixed", False)
    monkeypatch.setenv("SEMFAB_PATH", "nvlink")
    with pytest.raises(UsageError, match="SEMFAB_PATH=nvlink"):
        Options().resolved()
    with pytest.raises(UsageError, match="semfab numerics 'exact'"):
        Options(numerics="exact")


def test_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEMFAB_TIMEOUT", raising=False)
    assert timeout_from_env(1800.0) == 30.0  # torch's 30 minutes would hide a hang
    assert timeout_from_env(5.0) == 5.0
    monkeypatch.setenv("SEMFAB_TIMEOUT", "2.5")
    assert timeout_from_env(5.0) == 2.5
    monkeypatch.setenv("SEMFAB_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="SEMFAB_TIMEOUT=soon"):
        timeout_from_env(None)
