"""The chain's event loop: uvloop where installed, asyncio's when turned off or missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fabric.serving import eventloop


async def _which() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_runs_on_the_loop_it_names(monkeypatch) -> None:
    monkeypatch.delenv("SEMFAB_UVLOOP", raising=False)
    pytest.importorskip("uvloop")
    assert eventloop.loop_name() == "uvloop"
    assert eventloop.run(_which()) == "uvloop"


def test_semfab_uvloop_0_runs_asyncio(monkeypatch) -> None:
    monkeypatch.setenv("SEMFAB_UVLOOP", "0")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_which()) == "asyncio"


def test_without_uvloop_it_falls_back(monkeypatch) -> None:
    monkeypatch.delenv("SEMFAB_UVLOOP", raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import raises ImportError
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_which()) == "asyncio"
