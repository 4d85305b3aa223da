"""The token chain's pure parts, without sockets: detokenizers, OpenAI layer, SSE,
records, metrics, trace writer, corpus walk and the tokenizer cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core.frame import FrameError
from fabric.serving import api, assets, detok, metrics, prom, records, trace
from fabric.serving.metrics import ClientResult


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assets.ensure_assets(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir: Path):
    return assets.load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def table(tokenizer) -> list[bytes]:
    return detok.byte_table(tokenizer)


PURE = ["config", "records", "detok", "api", "metrics", "trace"]
IO_LIBS = {"zmq", "socket", "asyncio", "selectors", "subprocess", "threading", "time",
           "aiohttp", "http", "urllib"}


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_no_io(name: str) -> None:
    import ast
    import importlib

    path = Path(importlib.import_module(f"fabric.serving.{name}").__file__ or "")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            if node.module.startswith("fabric.serving."):
                assert node.module.rsplit(".", 1)[1] in PURE, node.module
    assert not imported & IO_LIBS, imported & IO_LIBS


# ---------------------------------------------------------------- tokenizer and cache
def test_cache_is_reused_and_keyed_by_text(tmp_path: Path, tok_dir: Path) -> None:
    again = assets.ensure_assets(tok_dir.parent)
    assert again == tok_dir
    info = json.loads((tok_dir / "info.json").read_text())
    assert info["corpus_tokens"] > 1000 and info["vocab_size"] > 1000


def test_training_text_has_every_script() -> None:
    text = assets.corpus_text()
    assert len(text.encode()) < 500_000
    for probe in ("the ", "的", "の", "는", "🦆", "def ", "fn "):
        assert probe in text, probe


def test_multibyte_characters_really_split_across_tokens(tokenizer, table) -> None:
    ids = tokenizer.encode(assets.corpus_text()).ids
    partial = sum(1 for i in ids if table[i] and (table[i][0] & 0xC0) == 0x80)
    assert partial > 50  # tokens that start in the middle of a character


def test_byte_table_matches_single_token_decode(tokenizer, table) -> None:
    for i in range(tokenizer.get_vocab_size()):
        assert table[i].decode("utf-8", "replace") == tokenizer.decode([i]), i


# ---------------------------------------------------------------- detokenizers
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_detok_equals_full_decode(tokenizer, table, data) -> None:
    vocab = tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=48))
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=10))
    full = tokenizer.decode(ids)
    for kind in ("hf", "table"):
        d = detok.make_detokenizer(kind, tokenizer, table)
        out, pos, k = [], 0, 0
        while pos < len(ids):  # feed in chunks of varying size (batched detok)
            n = sizes[k % len(sizes)]
            out.append(d.feed(ids[pos:pos + n]))
            pos += n
            k += 1
            assert d.released <= pos
        out.append(d.finish())
        assert "".join(out) == full, kind
        assert d.released == len(ids)


def test_split_character_is_held_then_released(tokenizer, table) -> None:
    text = "龘靐齉"  # rare characters: several tokens each
    ids = tokenizer.encode(text).ids
    assert len(ids) > 3
    for kind in ("hf", "table"):
        d = detok.make_detokenizer(kind, tokenizer, table)
        pieces = [d.feed([i]) for i in ids]
        assert "".join(pieces) + d.finish() == text
        assert "" in pieces  # some tokens alone are not text
        assert all("\ufffd" not in p for p in pieces)


def test_out_of_vocabulary_id_is_refused(tokenizer, table) -> None:
    for kind in ("hf", "table"):
        with pytest.raises(ValueError):
            detok.make_detokenizer(kind, tokenizer, table).feed([10**7])


def test_completion_index_points_at_the_completing_token(tokenizer, table) -> None:
    ids = tokenizer.encode("a龘b").ids
    idx = detok.completion_index(table, ids)
    assert len(idx) == len(ids) and idx == sorted(idx)
    assert all(u >= i for i, u in enumerate(idx))
    assert idx[-1] == len(ids) - 1 and any(u > i for i, u in enumerate(idx))


def test_batch_policy() -> None:
    imm = detok.BatchPolicy.of("immediate", 8, 20)
    assert imm.due(1, 0, 0) and imm.deadline(0) is None
    b = detok.BatchPolicy.of("batched", 4, 20)
    assert not b.due(3, 0, 1_000_000)
    assert b.due(4, 0, 0) and b.due(1, 0, 0, last=True) and b.due(2, 0, 20_000_000)
    assert b.deadline(5) == 20_000_005
    assert not b.due(0, 0, 10**12)
    with pytest.raises(ValueError):
        detok.BatchPolicy.of("sometimes", 1, 1)


# ---------------------------------------------------------------- corpus walk
def test_corpus_walk_gives_valid_utf8_whatever_the_toy_ids(tok_dir: Path, tokenizer, table
                                                             ) -> None:
    walk = assets.CorpusWalk.load(tok_dir)
    rng = np.random.default_rng(3)
    cursors = np.array([walk.start_for([1, 2, 3]), walk.start_for([9]), 0], dtype=np.int64)
    out = []
    for _ in range(400):
        out.append(walk.step(rng.integers(0, 512, cursors.size).astype(np.int32), cursors))
    for row in np.stack(out, axis=1):
        text = b"".join(table[i] for i in row.tolist())
        text.decode("utf-8")  # strict: a walk never cuts a character
        assert tokenizer.decode(row.tolist()) == text.decode()


# ---------------------------------------------------------------- records
def test_record_layout_round_trips() -> None:
    arr = np.zeros(3, records.RECORD_DTYPE)
    arr["rid"] = [1, 2, 3]
    arr["index"] = [7, 8, 9]
    arr["token"] = [100, 200, 300]
    arr["flags"] = [0, 0, records.LAST]
    arr["t_gen"] = 123456789012
    arr["t_sent"] = -5
    rows = list(records.iter_records(arr.tobytes()))
    assert rows[2] == (3, 9, 300, records.LAST, 0, 123456789012, -5)
    with pytest.raises(FrameError):
        records.iter_records(b"x" * 33)


def test_staged_message_round_trip_and_refusals() -> None:
    body = records.pack_staged(5, 1, 0, [[1, 0, 42, 0, 10, 11]])
    msg = records.unpack_staged(body)
    assert msg["r"] == [[1, 0, 42, 0, 10, 11]] and msg["s"] == 5
    msg["ri"] = 1
    assert records.unpack_staged(records.repack_staged(msg))["ri"] == 1
    for bad in (b"\xc1", records.repack_staged({"s": 1, "q": 0, "r": [[1, 2]]}),
                records.repack_staged({"r": []})):
        with pytest.raises(FrameError):
            records.unpack_staged(bad)


# ---------------------------------------------------------------- OpenAI layer
MODELS = ("semfab-toy",)


@pytest.mark.parametrize(("body", "status", "param"), [
    ([], 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ({"model": "semfab-toy"}, 400, "prompt"),
    ({"model": "semfab-toy", "prompt": 3}, 400, "prompt"),
    ({"model": "semfab-toy", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "semfab-toy", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "semfab-toy", "prompt": "x", "max_tokens": "9"}, 400, "max_tokens"),
    ({"model": "semfab-toy", "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "semfab-toy", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": "semfab-toy", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "semfab-toy", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "semfab-toy", "prompt": "x", "stream_options": {}}, 400, "stream_options"),
    ({"model": "semfab-toy", "prompt": "x", "stop": ["\n"]}, 400, "stop"),
    ({"model": "semfab-toy", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "semfab-toy", "prompt": "x", "seed": "7"}, 400, "seed"),
    ({"model": "semfab-toy", "prompt": "x", "seed": True}, 400, "seed"),
    ({"model": "semfab-toy", "prompt": "x", "seed": 1 << 64}, 400, "seed"),
    ({"model": "semfab-toy", "prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
])
def test_completion_request_errors(body, status, param) -> None:
    with pytest.raises(api.ApiError) as err:
        api.parse_completion(body, MODELS, 4096)
    assert err.value.status == status and err.value.param == param
    e = err.value.body()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]


def test_valid_requests() -> None:
    r = api.parse_completion({"model": "semfab-toy", "prompt": ["hi"], "stream": True,
                              "stream_options": {"include_usage": True}, "temperature": 0},
                             MODELS, 4096)
    assert (r.prompt, r.stream, r.include_usage, r.temperature, r.max_tokens) == \
        ("hi", True, True, 0.0, 16)
    r = api.parse_completion({"model": "semfab-toy", "prompt": [1, 2, 3], "stop": None},
                             MODELS, 4096)
    assert r.prompt_ids == [1, 2, 3] and r.seed is None
    r = api.parse_completion({"model": "semfab-toy", "prompt": "x", "seed": -3,
                              "ignore_eos": True}, MODELS, 4096)
    assert r.seed == -3
    c = api.parse_chat({"model": "semfab-toy", "max_completion_tokens": 5, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}, MODELS, 4096)
    assert c.max_tokens == 5 and "be brief" in (c.prompt or "") and "hello" in (c.prompt or "")
    for bad in ({"model": "semfab-toy", "messages": []},
                {"model": "semfab-toy", "messages": [{"role": "robot", "content": "x"}]},
                {"model": "semfab-toy", "messages": [{"role": "user", "content": [{"type":
                                                                                  "image"}]}]}):
        with pytest.raises(api.ApiError):
            api.parse_chat(bad, MODELS, 4096)
    with pytest.raises(api.ApiError):
        api.parse_json(b"{not json")


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(max_size=12), min_size=1, max_size=8),
       cuts=st.lists(st.integers(1, 40), min_size=1, max_size=20),
       chat=st.booleans())
def test_sse_chunks_survive_any_split(texts, cuts, chat) -> None:
    fmt = api.ChunkFormatter("chat" if chat else "completion", "cmpl-1-2", "m", created=1)
    wire = b"".join([fmt.role()] if chat else [])
    wire += b"".join(fmt.delta(t) for t in texts) + fmt.usage(3, len(texts)) + api.DONE
    dec = api.SSEDecoder()
    got: list[str] = []
    pos, k = 0, 0
    while pos < len(wire):
        n = cuts[k % len(cuts)]
        got.extend(dec.feed(wire[pos:pos + n]))
        pos += n
        k += 1
    assert got[-1] == "[DONE]" and len(got) == fmt.events + 1
    objs = [json.loads(g) for g in got[:-1]]
    pieces = [(o["choices"][0]["delta"].get("content", "") if chat else o["choices"][0]["text"])
              for o in objs if o["choices"]]
    assert "".join(pieces) == "".join(texts)
    assert objs[-1]["usage"]["completion_tokens"] == len(texts)


def test_sse_decoder_handles_crlf_comments_and_multiline() -> None:
    dec = api.SSEDecoder()
    assert dec.feed(b": keep-alive\r\n\r\ndata: a\r\ndata: b\r\n\r\nevent: x\ndata:c\n\n") == \
        ["a\nb", "c"]


def test_responses_and_errors_have_the_openai_shape() -> None:
    r = api.completion_response("id", "m", 1, "hi", "length", 2, 3, "chat")
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == "hi"
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert api.models_list(("m",), 1)["data"][0]["id"] == "m"
    ev = api.error_event(api.ApiError(503, "bye", type_="server_error"))
    assert json.loads(ev[6:])["error"]["type"] == "server_error"
    d = api.ChunkFormatter("completion", "x", "m", 1).delta("", [5, 6], "length")
    obj = json.loads(d[6:])
    assert obj["choices"][0]["token_ids"] == [5, 6]
    assert obj["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- metrics
def _client(t_send: int, events: list[int], text: str = "", ok: bool = True) -> ClientResult:
    return ClientResult(ok=ok, status=200, response_id="cmpl-1-7", t_send=t_send,
                        t_events=events, content=[True] * len(events), text=text,
                        finish_reason="length", usage={"completion_tokens": len(events)})


def test_request_metrics_follow_vllm_definitions() -> None:
    ms = 1_000_000
    cr = _client(0, [100 * ms, 110 * ms, 130 * ms, 140 * ms])
    m = metrics.request_metrics(cr)
    assert m.ttft_ms == 100 and m.e2el_ms == 140 and m.itl_ms == [10, 20, 10]
    assert m.tpot_ms == pytest.approx(40 / 3)
    assert not metrics.request_metrics(_client(0, [], ok=False)).ok
    assert metrics.parse_slo("ttft:0.2s, tpot:50, itl:500us") == \
        {"ttft": 200.0, "tpot": 50.0, "itl": 0.5}
    with pytest.raises(ValueError):
        metrics.parse_slo("speed:fast")


def _timeline(n: int, split_at: int | None = None) -> dict:
    ms = 1_000_000
    t_gen = np.array([(i + 1) * 10 * ms for i in range(n)])
    return {"rid": 7, "worker": "w0", "t_req": 0, "received": n, "client_detok": False,
            "token": np.arange(n) + 40, "t_gen": t_gen, "t_sent": t_gen + 10_000,
            "t_ri": np.zeros(n, int), "t_ro": np.zeros(n, int),
            "t_arrive": t_gen + 100_000, "t_detok": t_gen + 120_000,
            "t_write": t_gen + 150_000, "chunk": np.arange(n)}


def test_token_layers_add_up(table) -> None:
    tl = _timeline(5)
    cr = _client(0, (tl["t_gen"] + 400_000).tolist())
    layers = metrics.token_layers(tl, cr, table)
    assert layers is not None
    assert layers.generation.tolist() == [10.0] * 5
    assert layers.transport.tolist() == [0.1] * 5
    assert np.allclose(layers.interpretation, 0.02) and np.allclose(layers.presentation, 0.28)
    assert layers.held == 0


def test_level_row_counts_mismatch_and_loss(tokenizer, table) -> None:
    tl = _timeline(4)
    ids = tl["token"].tolist()
    good = _client(0, (tl["t_gen"] + 300_000).tolist(), text=tokenizer.decode(ids))
    li = metrics.LevelInput("direct", "immediate", "host", 1, [good], 0, 10**9, {(1, 7): tl},
                            {(1, 7): ids}, np.array([[5 * 10**6, 10, 10, 1, 0]]))
    row = metrics.level_row(li, tokenizer, table, {"ttft": 200, "tpot": 50})
    assert row["lost_tokens"] == 0 and row["text_mismatches"] == 0
    assert row["experience"]["completion"] == 1 and row["experience"]["compute"] == 1
    assert row["experience"]["timeliness"] == 1 and row["goodput_req_s"] == 1
    assert row["layers_ms"]["transport"]["p50"] == pytest.approx(0.1)
    bad = _client(0, (tl["t_gen"] + 300_000).tolist(), text="nope")
    li.clients = [bad]
    li.generated = {(1, 7): [*ids, 99]}
    row = metrics.level_row(li, tokenizer, table, {"itl": 5})
    assert row["text_mismatches"] == 1 and row["lost_tokens"] == 1
    assert row["experience"]["completion"] == 0
    assert row["experience"]["timeliness"] == pytest.approx(1 / 4)  # first token: no ttft SLO


def test_delivery_gaps_are_shared_by_tokens_delivered_together() -> None:
    d = np.array([5, 5, 9, 9, 9, 20])
    assert metrics.delivery_gaps(d).tolist() == [0, 0, 4, 4, 4, 11]


def test_semantic_per_token_sums_processes() -> None:
    parts = {"worker": {"transport": {"copies": 10, "crossings": 10, "hops": 10}},
             "host": {"transport": {"copies": 10, "crossings": 10},
                      "interpretation": {"encodes": 10}}}
    s = metrics.semantic_per_token(parts, 10)
    assert s["transport"] == {"copies": 2, "encodes": 0, "crossings": 2, "hops": 1}
    assert s["total"]["encodes"] == 1


# ---------------------------------------------------------------- trace writer
def test_trace_is_valid_chrome_trace_with_flows(tmp_path: Path) -> None:
    tl = _timeline(3)
    tl["t_ri"] = tl["t_gen"] + 20_000
    tl["t_ro"] = tl["t_gen"] + 30_000
    cr = _client(0, (tl["t_gen"] + 400_000).tolist())
    tb = trace.TraceBuilder()
    trace.add_chain(tb, "direct+immediate c=1", 100, [tl], {7: cr})
    doc = json.loads(tb.write(tmp_path / "t.json").read_text())
    evs = doc["traceEvents"]
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert any("w0" in n for n in names) and any("relay" in n for n in names)
    assert any("client" in n for n in names)
    flows = [e for e in evs if e["ph"] in "stf"]
    assert {e["ph"] for e in flows} == {"s", "t", "f"}
    assert len({e["id"] for e in flows}) == 3  # one arrow per token
    slices = [e for e in evs if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    by_thread: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in slices:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(
            (round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)))
    assert all(_properly_nested(v) for v in by_thread.values())
    # every flow point lies inside a slice of its track (so the arrow binds)
    for f in flows:
        assert any(s["pid"] == f["pid"] and s["tid"] == f["tid"]
                   and s["ts"] <= f["ts"] <= s["ts"] + s["dur"] for s in slices), f


def test_trace_lanes_keep_slices_properly_nested() -> None:
    tb = trace.TraceBuilder()
    tb.t0 = 0
    # a held token: released (ends) after the next token arrived (starts)
    assert tb.slice(1, "r1 interpretation", "a", 0, 50, "i") == "r1 interpretation"
    assert tb.slice(1, "r1 interpretation", "b", 40, 90, "i") == "r1 interpretation (2)"
    assert tb.slice(1, "r1 interpretation", "c", 45, 50, "i") == "r1 interpretation"  # nests
    assert tb.slice(1, "r1 interpretation", "d", 90, 95, "i") == "r1 interpretation"
    ends: dict[int, list[tuple[int, int]]] = {}
    for e in tb.events:
        if e["ph"] == "X":
            ends.setdefault(e["tid"], []).append((round(e["ts"] * 1e3),
                                                   round((e["ts"] + e["dur"]) * 1e3)))
    for spans in ends.values():  # per thread: disjoint or nested, never crossing
        assert _properly_nested(spans)


def _properly_nested(spans: list[tuple[int, int]]) -> bool:
    stack: list[int] = []
    for start, end in sorted(spans, key=lambda x: (x[0], -x[1])):
        while stack and stack[-1] <= start:
            stack.pop()
        if stack and end > stack[-1]:
            return False
        stack.append(end)
    return True


def _families(text: str) -> dict[str, Any]:
    """The exposition text parsed by prometheus_client's own parser, by family name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}


def test_prometheus_histogram_counter_and_gauge_render_the_text_format() -> None:
    r = prom.Registry()
    h = r.add(prom.Histogram("x_seconds", "a histogram", [0.1, 1.0], ("layer",)))
    h.observe(0.05, "a")
    h.observe(0.1, "a")  # le: a value on a bound counts in that bucket
    h.observe(5.0, "a", count=2)
    c = r.add(prom.Counter("y_total", 'counts "quoted"\nthings', ("kind",)))
    c.inc(2, 'a"b')
    r.add(prom.Counter("z_total", "read when rendered", fn=lambda: 7))
    r.add(prom.Gauge("g", "a gauge", fn=lambda: 1.5))
    r.add(prom.Histogram("e_seconds", "never observed", prom.REQUEST_BUCKETS))
    text = r.render()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert lines[:2] == ["# HELP x_seconds a histogram", "# TYPE x_seconds histogram"]
    assert '# HELP y_total counts "quoted"\\nthings' in lines  # HELP escapes the newline
    assert 'y_total{kind="a\\"b"} 2.0' in lines  # a label value escapes the quote
    fams = _families(text)
    assert list(fams) == ["x_seconds", "y", "z", "g", "e_seconds"]  # registration order
    assert [f.type for f in fams.values()] == ["histogram", "counter", "counter", "gauge",
                                               "histogram"]
    assert fams["y"].documentation == 'counts "quoted"\nthings'
    a = (("layer", "a"),)
    assert _samples(fams["x_seconds"]) == {
        ("x_seconds_bucket", (*a, ("le", "0.1"))): 2, ("x_seconds_bucket", (*a, ("le", "1.0"))): 2,
        ("x_seconds_bucket", (*a, ("le", "+Inf"))): 4,
        ("x_seconds_sum", a): pytest.approx(10.15), ("x_seconds_count", a): 4}
    assert _samples(fams["y"]) == {("y_total", (("kind", 'a"b'),)): 2}
    assert _samples(fams["z"]) == {("z_total", ()): 7}
    assert _samples(fams["g"]) == {("g", ()): 1.5}
    assert fams["e_seconds"].samples == []  # no series until the first observation
    assert h.count("a") == 4 and h.count("b") == 0
    with pytest.raises(ValueError):
        c.inc(-1, "a")
    with pytest.raises(ValueError):
        h.observe(1.0)  # the label is missing
    with pytest.raises(ValueError):
        r.add(prom.Gauge("g", "twice"))
    with pytest.raises(ValueError):
        prom.Counter("tokens", "the exposition would call it tokens_total")
    with pytest.raises(ValueError):
        prom.Histogram("h", "no finite bucket", [float("inf")])


def test_prometheus_buckets_and_counters_read_when_rendered() -> None:
    """The host's layout: every bucket bound is an ``le``; ``fn`` is read on each render."""
    r = prom.Registry()
    h = r.add(prom.Histogram("lat_seconds", "layer times", prom.LAYER_BUCKETS, ("layer",)))
    outcomes = {("completed",): 3, ("aborted",): 1}
    r.add(prom.Counter("req_total", "by outcome", ("outcome",), fn=lambda: outcomes))
    running = [2]
    r.add(prom.Gauge("running", "in flight", fn=lambda: running[0]))
    for v in (1e-5, 3e-4, 0.7, 42.0):
        h.observe(v, "transport", count=3)
    fams = _families(r.render())
    buckets = {float(s.labels["le"]): s.value for s in fams["lat_seconds"].samples
               if s.name == "lat_seconds_bucket"}
    assert list(buckets) == [*prom.LAYER_BUCKETS, float("inf")]
    assert buckets[2e-5] == 3 and buckets[5e-4] == 6 and buckets[1.0] == 9
    assert buckets[10.0] == 9 and buckets[float("inf")] == 12
    got = _samples(fams["lat_seconds"])
    t = (("layer", "transport"),)
    assert got[("lat_seconds_count", t)] == 12
    assert got[("lat_seconds_sum", t)] == pytest.approx(3 * (1e-5 + 3e-4 + 0.7 + 42.0))
    assert _samples(fams["req"]) == {("req_total", (("outcome", "aborted"),)): 1,
                                     ("req_total", (("outcome", "completed"),)): 3}
    outcomes[("completed",)] = 5
    running[0] = 0
    fams = _families(r.render())
    assert _samples(fams["req"])[("req_total", (("outcome", "completed"),))] == 5
    assert _samples(fams["running"]) == {("running", ()): 0}


def test_each_prometheus_registry_is_its_own() -> None:
    """Two servers in one process: same names, separate values, none in the global registry."""
    from prometheus_client import REGISTRY

    one, two = prom.Registry(), prom.Registry()
    a = one.add(prom.Counter("semfab_units_total", "counted"))
    two.add(prom.Counter("semfab_units_total", "counted"))
    a.inc(4)
    assert _samples(_families(one.render())["semfab_units"]) == {("semfab_units_total", ()): 4}
    assert _samples(_families(two.render())["semfab_units"]) == {("semfab_units_total", ()): 0}
    assert REGISTRY.get_sample_value("semfab_units_total") is None
    assert prom.CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_the_token_clock_takes_the_measured_offset_off() -> None:
    """A placed process stamps on rank 0's timeline: its clock minus its offset."""
    import time

    from fabric.serving import clock

    before = clock.offset_ns()
    try:
        clock.set_offset_ns(7_000_000_000)  # this host's clock runs 7 s ahead of rank 0's
        a = time.perf_counter_ns()
        t = clock.now_ns()
        b = time.perf_counter_ns()
        assert a - 7_000_000_000 <= t <= b - 7_000_000_000
        assert clock.offset_ns() == 7_000_000_000
    finally:
        clock.set_offset_ns(before)
    assert clock.offset_ns() == before
