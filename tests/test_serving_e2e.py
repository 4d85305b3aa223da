"""The token chain end to end: real processes, the fabric, a real HTTP server and
real clients (the official ``openai`` client, a raw HTTP/1.1 client, aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.emulation.launcher import Fabric
from fabric.serving import api, metrics
from fabric.serving.client import stream_request
from fabric.serving.config import ServeConfig
from fabric.serving.detok import make_detokenizer
from fabric.serving.runner import ServingChain, launch_for

pytestmark = pytest.mark.timeout(120)

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    # switch + w0 + host0 + host1 (the relay): 4 processes beside pytest
    f = launch_for(["host-staged"], 1, run_dir=tmp_path_factory.mktemp("fab"), timeout_s=20)
    try:
        yield f
    finally:
        f.close()
    assert all(code is not None for code in f.exit_codes().values())


@contextlib.contextmanager
def chain(fab: Fabric, assets_dir: Path, **kw: Any) -> Iterator[ServingChain]:
    cfg = ServeConfig(backend="numpy", record=True, assets_dir=str(assets_dir), step_ms=3.0,
                      prefill_ms=5.0, **kw)
    ch = ServingChain(cfg, fabric=fab, timeout_s=20).start()
    try:
        yield ch
    finally:
        ch.close()  # no-op once the test called stop()


def generated(results: dict[str, Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for w in results["workers"]:
        out.update({int(k): list(v) for k, v in w["generated"].items()})
    return out


def rid_of(response_id: str) -> int:
    return int(response_id.rsplit("-", 1)[1])


def clean(counters: dict[str, Any]) -> None:
    for k in ("gap_tokens", "duplicate_tokens", "lost_frames", "reordered_frames",
              "refused_frames", "nacks", "detok_inconsistent"):
        assert counters[k] == 0, (k, counters)


@pytest.mark.parametrize("transport", ["direct", "host-staged"])
def test_openai_client_streams_exactly_the_generated_text(fab: Fabric, assets_dir: Path,
                                                          tokenizer: Any,
                                                          transport: str) -> None:
    texts: dict[int, str] = {}
    with chain(fab, assets_dir, transport=transport) as ch:
        client = openai.OpenAI(base_url=ch.url + "/v1", api_key="none", max_retries=0)
        for prompt in ("Tell me about 漢字 and 한글", "emoji 🦆 please", "def main():"):
            parts, rid = [], None
            for chunk in client.completions.create(model="semfab-toy", prompt=prompt,
                                                   max_tokens=48, stream=True):
                rid = rid_of(chunk.id)
                parts.append(chunk.choices[0].text if chunk.choices else "")
            assert rid is not None
            texts[rid] = "".join(parts)
        parts = []
        for chunk in client.chat.completions.create(
                model="semfab-toy", max_tokens=40, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "こんにちは"}]):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                rid = rid_of(chunk.id)
            else:
                assert chunk.usage is not None and chunk.usage.completion_tokens == 40
        assert rid is not None
        texts[rid] = "".join(parts)
        whole = client.completions.create(model="semfab-toy", prompt="whole", max_tokens=20)
        texts[rid_of(whole.id)] = whole.choices[0].text
        assert whole.usage is not None and whole.usage.completion_tokens == 20
        results = ch.stop()
    gen = generated(results)
    for rid, text in texts.items():
        assert text == tokenizer.decode(gen[rid]), rid
    assert sorted(len(gen[r]) for r in texts) == [20, 40, 48, 48, 48]
    counters = results["host"]["counters"]
    clean(counters)
    assert counters["completed"] == 5 and counters["open_streams"] == 0
    # semantic distance, as counted by the code that ran
    parts_sem = {"worker": {"transport": results["workers"][0]["sem"]},
                 "host": results["host"]["sem"]}
    if "relay" in results:
        parts_sem["relay"] = {"transport": results["relay"]["sem"]}
    sem = metrics.semantic_per_token(parts_sem, sum(len(v) for v in gen.values()))["transport"]
    if transport == "direct":
        # on one host with no faults the records go straight into host0's ring and
        # the header through a doorbell: one process boundary, not two
        assert results["workers"][0]["bell_frames"] > 0
        assert counters["bell_frames"] == results["workers"][0]["bell_frames"]
        assert sem == {"copies": 2, "encodes": 0, "crossings": 1, "hops": 1}
    else:
        assert sem == {"copies": 5, "encodes": 4, "crossings": 4, "hops": 2}


@pytest.mark.parametrize("bells", ["1", "0"])
def test_direct_tokens_alike_through_doorbells_or_sockets(fab: Fabric, assets_dir: Path,
                                                          tokenizer: Any, bells: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """SEMFAB_DOORBELLS=0 keeps direct's WRITEs on the sockets (through the switch);
    either way every stream is exact and nothing is lost or refused."""
    monkeypatch.setenv("SEMFAB_DOORBELLS", bells)
    with chain(fab, assets_dir, transport="direct") as ch:
        assert ch.cfg.bells is (bells == "1")

        async def run() -> list[Any]:
            async with aiohttp.ClientSession() as session:
                body = {"model": "semfab-toy", "max_tokens": 37, "stream": True}
                return list(await asyncio.gather(*[
                    stream_request(session, ch.url + "/v1/completions",
                                   {**body, "prompt": f"prompt {i}"}) for i in range(6)]))

        clients = asyncio.run(run())
        results = ch.stop()
    gen = generated(results)
    for cr in clients:
        assert cr.ok, cr.error
        assert cr.text == tokenizer.decode(gen[rid_of(cr.response_id)])
    counters = results["host"]["counters"]
    clean(counters)
    used = results["workers"][0]["bell_frames"]
    assert (used > 0) is (bells == "1") and counters["bell_frames"] == used
    assert counters["tokens"] == 6 * 37


def _raw_sse(url: str, path: str, body: dict[str, Any]) -> tuple[int, str, list[str]]:
    """A hand-written HTTP/1.1 client: POST, then read the chunked SSE body line by line."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        ctype = resp.getheader("Content-Type", "")
        data = [line[6:].decode().rstrip("\n") for line in resp if line.startswith(b"data: ")]
        return resp.status, ctype, data
    finally:
        conn.close()


def test_raw_http_client_and_client_side_detok(fab: Fabric, assets_dir: Path,
                                               tokenizer: Any) -> None:
    with chain(fab, assets_dir, transport="direct", detok="batched", batch_tokens=4) as ch:
        status, ctype, data = _raw_sse(ch.url, "/v1/completions", {
            "model": "semfab-toy", "prompt": "raw", "max_tokens": 33, "stream": True,
            "stream_options": {"include_usage": True}})
        assert status == 200 and ctype.startswith("text/event-stream")
        assert data[-1] == "[DONE]"
        objs = [json.loads(d) for d in data[:-1]]
        text = "".join(o["choices"][0]["text"] for o in objs if o["choices"])
        assert objs[-1]["usage"]["completion_tokens"] == 33
        assert objs[-2]["choices"][0]["finish_reason"] == "length"
        assert len(objs) <= 33 // 4 + 3  # batched: about one event per 4 tokens
        rid = rid_of(objs[0]["id"])

        async def client_side() -> Any:  # the host streams ids; this client decodes them
            async with aiohttp.ClientSession() as s:
                return await stream_request(
                    s, ch.url + "/v1/completions",
                    {"model": "semfab-toy", "prompt": "ids", "max_tokens": 30, "stream": True,
                     "detokenize": False},
                    detokenizer=lambda: make_detokenizer("table", tokenizer))

        cr = asyncio.run(client_side())
        assert cr.ok and len(cr.token_ids) == 30 and len(cr.t_detok) == 30
        results = ch.stop()
    gen = generated(results)
    assert text == tokenizer.decode(gen[rid])
    assert cr.token_ids == gen[cr.rid] and cr.text == tokenizer.decode(gen[cr.rid])
    clean(results["host"]["counters"])
    tl = results["host"]["timelines"][rid]
    assert (tl["t_gen"] < tl["t_arrive"]).all() and (tl["t_arrive"] <= tl["t_detok"]).all()
    assert (tl["t_detok"] <= tl["t_write"]).all()


def test_client_that_disconnects_frees_its_sequence(fab: Fabric, assets_dir: Path,
                                                    tokenizer: Any) -> None:
    with chain(fab, assets_dir, transport="host-staged") as ch:
        url = ch.url + "/v1/completions"

        async def run() -> list[Any]:
            async with aiohttp.ClientSession() as s:
                body = {"model": "semfab-toy", "stream": True}
                return list(await asyncio.gather(
                    stream_request(s, url, {**body, "prompt": "a", "max_tokens": 60}),
                    stream_request(s, url, {**body, "prompt": "b", "max_tokens": 2000},
                                   stop_after_events=3),
                    stream_request(s, url, {**body, "prompt": "c", "max_tokens": 60})))

        keep1, gone, keep2 = asyncio.run(run())
        assert keep1.ok and keep2.ok and not gone.ok
        deadline = time.monotonic() + 10
        while True:  # the host notices at its next write, then frees the worker's row
            with contextlib.closing(http.client.HTTPConnection(
                    "127.0.0.1", urllib.parse.urlsplit(ch.url).port, timeout=5)) as c:
                c.request("GET", "/semfab/stats")
                stats = json.loads(c.getresponse().read())
            if stats["open_streams"] == 0 and stats["aborted"] == 1:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["load"] == {"w0": 0}
        results = ch.stop()
    worker = results["workers"][0]
    assert worker["aborted"] == [gone.rid]
    gen = generated(results)
    assert len(gen[gone.rid]) < 2000  # it stopped generating
    for cr in (keep1, keep2):
        assert cr.text == tokenizer.decode(gen[cr.rid]) and len(gen[cr.rid]) == 60
    assert results["host"]["counters"]["completed"] == 2


def test_bad_requests_get_openai_errors(fab: Fabric, assets_dir: Path) -> None:
    with chain(fab, assets_dir) as ch:
        client = openai.OpenAI(base_url=ch.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["semfab-toy"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-none", prompt="x")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="semfab-toy", prompt="x", max_tokens=0)
        assert "max_tokens" in str(err.value)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="semfab-toy", messages=[])
        port = urllib.parse.urlsplit(ch.url).port
        for method, path, body, status in [
                ("POST", "/v1/completions", b"{nope", 400),
                ("POST", "/v1/chat/completions", b'{"model": "semfab-toy"}', 400),
                ("POST", "/v1/completions", b'{"model": "semfab-toy", "prompt": "\\ud800"}',
                 400),
                ("POST", "/v1/completions", b"[" * 100_000, 400),
                ("GET", "/v1/completions", None, 405),
                ("GET", "/v1/nothing", None, 404),
                ("POST", "/semfab/shutdown", b"", 403)]:
            with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port,
                                                               timeout=5)) as c:
                c.request(method, path, body=body)
                resp = c.getresponse()
                assert resp.status == status, (path, resp.status)
                assert resp.getheader("Content-Type", "").startswith("application/json")
                err_body = json.loads(resp.read())["error"]
                assert err_body["message"] and "type" in err_body
        # the server still works after all that
        ok = client.completions.create(model="semfab-toy", prompt="still", max_tokens=3)
        assert ok.choices[0].finish_reason == "length"
        results = ch.stop()
    assert results["host"]["counters"]["completed"] == 1
    assert api.ApiError(400, "x").body()["error"]["type"] == "invalid_request_error"


def test_a_chain_stopped_before_it_knew_its_url_still_stops_its_host(
        fab: Fabric, assets_dir: Path) -> None:
    """Ctrl-C while start() waited for the server: stop() finds the URL itself
    and asks the host to stop, rather than waiting out every task's timeout."""
    with chain(fab, assets_dir) as ch:
        ch.url = ""  # as if start() was interrupted before it read the ready file
        results = ch.stop(timeout_s=10)
    assert results["host"]["counters"]["completed"] == 0
    assert "workers" in results


@pytest.mark.parametrize("transport", ["direct", "host-staged"])
def test_lost_token_frames_are_asked_for_and_resent(tmp_path: Path, assets_dir: Path,
                                                    tokenizer: Any, transport: str) -> None:
    # 5% loss on every link: token frames, their NACKs, ADDs, CONFIG and STOP alike
    lossy = launch_for([transport], 1, run_dir=tmp_path, timeout_s=20, faults="loss=0.05",
                       seed=5)
    texts: dict[int, str] = {}
    with lossy:
        with chain(lossy, assets_dir, transport=transport) as ch:
            client = openai.OpenAI(base_url=ch.url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)
            for i in range(6):
                parts, rid = [], None
                for chunk in client.completions.create(model="semfab-toy", prompt=f"p{i}",
                                                       max_tokens=48, stream=True):
                    rid = rid_of(chunk.id)
                    parts.append(chunk.choices[0].text if chunk.choices else "")
                assert rid is not None
                texts[rid] = "".join(parts)
            results = ch.stop()
    gen = generated(results)
    for rid, text in texts.items():
        assert text == tokenizer.decode(gen[rid]), rid  # every token, in order
    c = results["host"]["counters"]
    assert c["completed"] == 6 and c["gap_tokens"] == 0 and c["unrecovered_frames"] == 0, c
    assert c["lost_frames"] > 0 and c["recovered_frames"] > 0, c
    assert sum(w["resent_frames"] for w in results["workers"]) >= c["recovered_frames"]
