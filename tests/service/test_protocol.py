"""The engine service protocol over a real WebSocket, on the bundled model.

Greedy decoding is deterministic, so every text coming over the socket is compared with what the
in-process engine generates for the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from service_support import wait_until_stalled
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from engine import Engine, GenerationParams
from engine.service import protocol as P
from engine.service import steering
from engine.service.client import EngineClient
from engine.service.client_core import EngineUnavailable
from engine.service.connection import WINDOW, Connection, Run
from engine.service.local import LocalModels
from engine.service.server import EngineServer

TOKEN = "t" * 32
PROMPT = "def fibonacci(n):\n"
LONG = GenerationParams(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine.load(slots=8)


@pytest.fixture(scope="module")
def reference(engine):
    """In-process greedy text (and stats keys) for PROMPT, 48 tokens, on its own slot."""
    gen = engine.generate(
        PROMPT, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="reference"
    )
    stream = steering.Stream()
    for chunk in gen:
        stream.push(chunk.token_id, chunk.text)
    return {
        "text": gen.text,
        "tokens": list(gen.tokens),
        "stats": set(gen.stats),
        "finish_reason": gen.finish_reason,
        "stream": stream,
    }


@pytest.fixture
async def server(engine):
    srv = await EngineServer(
        LocalModels([engine]), token=TOKEN, origins=["https://allowed.example"]
    ).start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server):
    c = await EngineClient.connect(server.url, TOKEN)
    yield c
    await c.close()


async def raw_connection(server, **kw):
    return await connect(
        server.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None, **kw
    )


async def recv_json(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 30))


# -- handshake ----------------------------------------------------------------------------------
async def test_hello_lists_models_and_capabilities(client, engine):
    h = client.hello
    assert h["protocol"] == P.PROTOCOL_VERSION
    assert [m["name"] for m in h["models"]] == [engine.name]
    m = h["models"][0]
    assert m["context"] == engine.context and m["vocab_size"] == engine.config.vocab_size
    assert h["capabilities"]["steer"] and h["capabilities"]["cancel"]
    assert "max_new_tokens" in h["capabilities"]["params"]


async def test_unsupported_version_and_messages_before_hello(server):
    ws = await raw_connection(server)
    try:
        await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "x"}))
        assert (await recv_json(ws))["code"] == P.HELLO_REQUIRED
        await ws.send(json.dumps({"type": "hello", "protocol": [99]}))
        reply = await recv_json(ws)
        assert reply["type"] == "error" and reply["code"] == P.UNSUPPORTED_VERSION
        await ws.send(json.dumps({"type": "hello", "protocol": [99, 1]}))
        assert (await recv_json(ws))["protocol"] == 1
    finally:
        await ws.close()


async def test_a_closed_connection_gives_the_heaps_free_pages_back(server, monkeypatch):
    from engine.service import server as server_module

    trims = []
    monkeypatch.setattr(server_module, "trim_heap", lambda: trims.append(1))
    c = await EngineClient.connect(server.url, TOKEN)
    gen = await c.generate(PROMPT, GenerationParams(max_new_tokens=4, ignore_eos=True), slot="t")
    async for _ in gen:
        pass
    assert trims == []
    await c.close()
    deadline = time.monotonic() + 30  # the connection's thread notices the close and ends
    while not trims and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert trims == [1]


# -- generation, multiplexing, cancel -----------------------------------------------------------
async def test_generation_matches_in_process(client, reference):
    gen = await client.generate(
        PROMPT, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="doc"
    )
    pieces = [p async for p in gen]
    assert "".join(p.text for p in pieces) == gen.text == reference["text"]
    assert gen.tokens == reference["tokens"]
    assert gen.finish_reason == reference["finish_reason"] == "length"
    assert set(gen.stats) == reference["stats"]
    assert gen.stats["new_tokens"] == 48


async def test_text_and_id_prompts_and_prefix_reuse(client, engine, reference):
    ids = engine.tokenizer.encode(PROMPT)
    first = await (
        await client.generate(ids, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="ids")
    ).wait()
    assert first.text == reference["text"]
    again = await (
        await client.generate(ids, GenerationParams(max_new_tokens=4), slot="ids")
    ).wait()
    assert again.stats["reused_tokens"] == len(ids) - 1  # the slot kept the prompt's KV


async def test_the_first_tokens_bring_the_prompt_stats(server, engine):
    """A generation's first ``tokens`` message carries its prompt and reused tokens and its TTFT
    (a client reports them before the end: most suggestions are answered or cancelled before
    it); later ones carry none; ``done`` brings them all."""
    ids = engine.tokenizer.encode(PROMPT)
    ws = await raw_connection(server)
    await ws.send(json.dumps({"type": "hello"}))
    await recv_json(ws)
    for gid in ("s1", "s2"):  # cold, then with the slot's prefix
        params = {"max_new_tokens": 6, "ignore_eos": True}
        await ws.send(
            json.dumps(
                {"type": "generate", "id": gid, "prompt": ids, "slot": "st", "params": params}
            )
        )
        msgs = []
        while not msgs or msgs[-1]["type"] != "done":
            msgs.append(await recv_json(ws))
        toks = [m for m in msgs if m["type"] == "tokens"]
        early = toks[0]["stats"]
        assert set(early) == set(P.EARLY_STATS) and early["prompt_tokens"] == len(ids)
        assert early["ttft_ms"] > 0 and all("stats" not in m for m in toks[1:])
        done = msgs[-1]["stats"]
        assert {k: done[k] for k in ("prompt_tokens", "reused_tokens")} == {
            k: early[k] for k in ("prompt_tokens", "reused_tokens")
        }
    assert early["reused_tokens"] == len(ids) - 1
    await ws.close()

    from engine.service.sync_client import SyncEngineClient

    def streaming_stats():
        c = SyncEngineClient(server.url, TOKEN)
        try:
            gen = c.generate(ids, GenerationParams(max_new_tokens=200, ignore_eos=True), slot="st")
            next(iter(gen))
            seen = dict(gen.stats)
            gen.cancel()
            list(gen)
            return seen, gen.finish_reason
        finally:
            c.close()

    seen, finish = await asyncio.to_thread(streaming_stats)
    assert finish == "cancelled"
    assert seen["prompt_tokens"] == len(ids) and seen["reused_tokens"] == len(ids) - 1


async def test_many_generations_multiplexed_on_one_socket(client, engine):
    prompts = [f"def f{i}(x):\n    return x" for i in range(6)]
    expected = [
        engine.generate(
            p, GenerationParams(max_new_tokens=24, ignore_eos=True), slot=("ref", i)
        ).result()
        for i, p in enumerate(prompts)
    ]
    gens = [
        await client.generate(p, GenerationParams(max_new_tokens=24, ignore_eos=True), slot=f"m{i}")
        for i, p in enumerate(prompts)
    ]
    await asyncio.gather(*(g.wait() for g in gens))
    assert [g.text for g in gens] == expected
    assert len({g.id for g in gens}) == len(gens)


async def test_cancel_stops_the_generation(client):
    gen = await client.generate(PROMPT, LONG, slot="cancel")
    async for _piece in gen:
        await gen.cancel()
        break
    await gen.wait()
    assert gen.finish_reason == "cancelled"
    assert gen.stats["new_tokens"] < LONG.max_new_tokens
    # the connection goes on
    after = await (
        await client.generate(PROMPT, GenerationParams(max_new_tokens=3), slot="cancel")
    ).wait()
    assert after.finish_reason in ("length", "eos")


async def test_a_generate_cancelled_while_it_is_sent_stops_on_the_service(client):
    """websockets writes a frame, then waits for the socket's buffer to drain: a task cancelled
    in that wait has sent its ``generate``, so the service must stop it too, not run it to its
    end with nobody reading (the Ray ingress cancels such tasks when an editor types)."""
    started = []
    start = client.start

    def spy(*args, **kw):
        started.append(start(*args, **kw))
        return started[-1]

    sent = asyncio.Event()
    drain = client.ws.drain

    async def stuck() -> None:  # this one write's drain never ends (a full socket buffer)
        client.ws.drain = drain
        sent.set()
        await asyncio.Event().wait()

    client.start, client.ws.drain = spy, stuck
    task = asyncio.ensure_future(client.generate(PROMPT, LONG, slot="cancel-in-send"))
    await asyncio.wait_for(sent.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gen = await asyncio.wait_for(started[0].wait(), 30)
    assert gen.finish_reason == "cancelled"
    assert gen.stats["new_tokens"] < LONG.max_new_tokens
    assert (await client.status())["generations"] == 0


async def test_cancel_of_unknown_or_finished_id_is_harmless(client):
    g = await (await client.generate(PROMPT, GenerationParams(max_new_tokens=2), slot="x")).wait()
    await g.client._send({"type": "cancel", "id": g.id})
    await g.client._send({"type": "cancel", "id": "never-started"})
    st = await client.status()
    assert st["generations"] == 0


# -- prompt deltas -----------------------------------------------------------------------------
@given(
    st.lists(st.integers(0, 4), max_size=12),
    st.lists(st.integers(0, 4), max_size=12),
    st.integers(0, 12),
    st.integers(0, 12),
)
def test_prompt_delta_spells_the_prompt_from_its_base(base, new, cut_head, cut_tail):
    ids = base[:cut_head] + new + base[len(base) - min(cut_tail, len(base)) :]
    head, middle, tail = P.prompt_delta(base, ids)
    assert head + tail <= min(len(base), len(ids))
    assert P.PromptDelta("g", head, middle, tail).apply(base) == ids
    # a server keeps its bases packed, and gets the prompt packed
    assert P.PromptDelta("g", head, middle, tail).apply(array("i", base)) == array("i", ids)
    assert len(middle) <= len(new) + max(0, len(ids) - len(base))  # the shared head/tail is kept
    # ids beyond 32 bits cannot be packed: the plain comparison finds the same delta
    big = 1 << 40
    wide = P.prompt_delta([t + big for t in base], [t + big for t in ids])
    assert wide == (head, [t + big for t in middle], tail)


def recorded(client) -> list[dict]:
    """The messages the client sends from now on (decoded)."""
    sent: list[dict] = []
    send = client.ws.send

    async def spy(data, *a, **kw):
        sent.append(json.loads(data))
        return await send(data, *a, **kw)

    client.ws.send = spy
    return sent


async def test_a_keystroke_prompt_goes_as_a_delta_and_generates_the_same(client, engine):
    ids = engine.tokenizer.encode("import os\n\n\ndef fibonacci(n):\n    if n < 2:\n" * 4)
    edited = ids[:30] + [ids[40]] + ids[30:]  # one token typed in the middle
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    expected = engine.generate(edited, params, slot="delta-ref").result()
    assert client.delta_slots == P.PROMPT_MEMORY
    sent = recorded(client)
    first = await (await client.generate(ids, params, slot="delta")).wait()
    second = await (await client.generate(edited, params, slot="delta")).wait()
    assert sent[0]["prompt"] == ids  # no base yet: the whole prompt
    delta = sent[1]["prompt"]
    assert delta == {"base": first.id, "head": 30, "ids": [ids[40]], "tail": len(ids) - 30}
    assert second.text == expected
    assert second.stats["prompt_tokens"] == len(edited)
    # another slot has its own base; a text prompt is never a delta
    await (await client.generate(ids, params, slot="other")).wait()
    await (await client.generate("def f(x):", params, slot="delta")).wait()
    assert isinstance(sent[2]["prompt"], list) and sent[3]["prompt"] == "def f(x):"


async def test_a_forgotten_base_is_refused_and_the_client_resends_the_whole_prompt(client, engine):
    ids = engine.tokenizer.encode("class Tree:\n    def __init__(self):\n" * 4)
    params = GenerationParams(max_new_tokens=6, ignore_eos=True)
    expected = engine.generate(ids[:-1], params, slot="forgot-ref").result()
    first = await (await client.generate(ids, params, slot="forgot")).wait()
    for i in range(P.PROMPT_MEMORY):  # push the first prompt out of the server's memory
        await (await client.generate([1 + i % 50], GenerationParams(max_new_tokens=1))).wait()
    sent = recorded(client)
    again = await (await client.generate(ids[:-1], params, slot="forgot")).wait()
    assert sent[0]["prompt"]["base"] == first.id and sent[1]["prompt"] == ids[:-1]
    assert again.finish_reason == "length" and again.text == expected


async def test_bad_prompt_deltas_get_error_codes(server, engine):
    ws = await raw_connection(server)
    try:
        await ws.send(json.dumps({"type": "hello"}))
        await recv_json(ws)
        await ws.send(json.dumps({"type": "generate", "id": "b", "prompt": [5, 6, 7]}))
        while (await recv_json(ws))["type"] != "done":
            pass
        cases = [
            ({"base": "nope", "ids": [1]}, P.UNKNOWN_BASE),
            ({"base": "b", "head": 2, "ids": [], "tail": 2}, P.BAD_PROMPT),  # 4 of 3 tokens
            ({"base": "b", "head": -1, "ids": []}, P.BAD_PROMPT),
            ({"base": "b", "ids": [1, True]}, P.BAD_PROMPT),
            ({"base": "b", "ids": [], "extra": 1}, P.BAD_PROMPT),
            ({"base": "b", "ids": [engine.config.vocab_size]}, P.BAD_PROMPT),
        ]
        for i, (prompt, code) in enumerate(cases):
            await ws.send(json.dumps({"type": "generate", "id": f"d{i}", "prompt": prompt}))
            reply = await recv_json(ws)
            assert (reply["type"], reply["code"], reply["id"]) == ("error", code, f"d{i}"), prompt
        params = {"max_new_tokens": 1}
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "ok",
                    "prompt": {"base": "b", "head": 1, "ids": [9], "tail": 1},
                    "params": params,
                }
            )
        )
        while (done := await recv_json(ws))["type"] != "done":
            pass
        assert done["id"] == "ok" and done["stats"]["prompt_tokens"] == 3  # [5, 9, 7]
    finally:
        await ws.close()


# -- the thread-side client -----------------------------------------------------------------------
async def test_sync_client_generates_cancels_and_reports_like_in_process(server, engine, reference):
    """SyncEngineClient from a plain thread (the language server's engine thread)."""
    from engine.service.sync_client import SyncEngineClient

    def body():
        c = SyncEngineClient(server.url, TOKEN)
        try:
            gen = c.generate(
                engine.tokenizer.encode(PROMPT),
                GenerationParams(max_new_tokens=48, ignore_eos=True),
                slot="sync",
            )
            text = "".join(ch.text for ch in gen)
            assert text == gen.text == reference["text"]
            assert gen.finish_reason == "length" and gen.done and not gen.cancelled
            long = c.generate(PROMPT, LONG, slot="sync")
            next(iter(long))
            long.cancel()
            long.result()
            assert long.finish_reason == "cancelled" and long.cancelled
        finally:
            c.close()
        with pytest.raises(EngineUnavailable):
            c.generate(PROMPT, LONG)

    await asyncio.to_thread(body)


# -- steering -----------------------------------------------------------------------------------
async def test_steer_matching_text_keeps_the_generation(client, reference):
    gen = await client.generate(
        PROMPT, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="steer-m"
    )
    typed = reference["text"][:5]
    event = await gen.steer(typed)
    assert event["state"] == P.COMMITTED and event["outcome"] == P.CONTINUED
    assert event["matched"] == len(typed)
    await gen.wait()
    assert gen.finish_reason == "length" and gen.successor is None
    assert gen.text == reference["text"]


async def test_steer_diverging_text_stops_and_a_successor_continues(client, engine, reference):
    gen = await client.generate(
        PROMPT, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="steer-d"
    )
    first = await gen.__aiter__().__anext__()
    typed = first.text + "\u00a7zz"
    event = await gen.steer(typed)
    assert event["outcome"] == P.STOPPED and event["successor"]
    await gen.wait()
    assert gen.finish_reason == "steered"
    succ = gen.successor
    assert succ is not None and succ.id == event["successor"]
    await succ.wait()
    assert succ.finish_reason == "length"
    # the successor is the in-process continuation of prompt + generated tokens + typed rest
    prompt = engine.tokenizer.encode(PROMPT)
    expected_ids = steering.successor_prompt(
        prompt, reference["stream"], typed, engine.tokenizer.encode
    )
    expected = engine.generate(
        expected_ids, GenerationParams(max_new_tokens=48, ignore_eos=True), slot="steer-ref"
    ).result()
    assert succ.text == expected
    assert succ.stats["reused_tokens"] >= len(prompt)


async def test_steer_after_the_end_fails_with_the_text_returned(client):
    gen = await (
        await client.generate(PROMPT, GenerationParams(max_new_tokens=2), slot="late")
    ).wait()
    event = await gen.steer("abc")
    assert event["state"] == P.FAILED and event["text"] == "abc"


def test_judge_and_successor_prompt():
    assert steering.judge("ab", "abc") == steering.MATCH
    assert steering.judge("abcd", "abc") == steering.PENDING
    assert steering.judge("abx", "abc") == steering.DIVERGED
    s = steering.Stream()
    for tid, text in ((10, "foo"), (11, "("), (12, "bar")):
        s.push(tid, text)
    enc = lambda t: [ord(c) for c in t]
    assert steering.successor_prompt([1, 2], s, "foo(x", enc) == [1, 2, 10, 11, ord("x")]
    assert steering.successor_prompt([1, 2], s, "fo", enc) == [1, 2, ord("f"), ord("o")]
    # healed tokens (no visible text) are kept only with the visible token that follows them
    h = steering.Stream()
    h.push(7, "")
    h.push(8, "ab")
    assert steering.successor_prompt([1], h, "x", enc, healed_prefix="q") == [1, ord("q"), ord("x")]
    assert steering.successor_prompt([1], h, "abz", enc, healed_prefix="q") == [1, 7, 8, ord("z")]


# -- bad input ----------------------------------------------------------------------------------
async def test_bad_messages_get_error_codes_and_the_socket_stays(client, server):
    ws = await raw_connection(server)
    try:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        await recv_json(ws)
        cases = [
            ("{not json", P.BAD_JSON),
            ("[1, 2]", P.BAD_MESSAGE),
            (json.dumps({"id": "x"}), P.BAD_MESSAGE),
            (json.dumps({"type": "teleport"}), P.UNKNOWN_TYPE),
            (json.dumps({"type": "generate", "prompt": "x"}), P.BAD_MESSAGE),
            (json.dumps({"type": "generate", "id": "a", "prompt": {"x": 1}}), P.BAD_PROMPT),
            (json.dumps({"type": "generate", "id": "a", "prompt": [10**9]}), P.BAD_PROMPT),
            (
                json.dumps(
                    {"type": "generate", "id": "a", "prompt": "x", "params": {"max_new_tokens": -1}}
                ),
                P.BAD_PARAMS,
            ),
            (
                json.dumps({"type": "generate", "id": "a", "prompt": "x", "params": {"warp": 9}}),
                P.BAD_PARAMS,
            ),
            (
                json.dumps({"type": "generate", "id": "a", "prompt": "x", "params": {"stop": 3}}),
                P.BAD_PARAMS,
            ),
            (
                json.dumps({"type": "generate", "id": "a", "prompt": "x", "model": "nope"}),
                P.UNKNOWN_MODEL,
            ),
            (json.dumps({"type": "steer", "id": "a", "text": 5}), P.BAD_MESSAGE),
            (b"\xff\xfe", P.BAD_JSON),
        ]
        for raw, code in cases:
            await ws.send(raw)
            reply = await recv_json(ws)
            assert reply["type"] == "error" and reply["code"] == code, (raw, reply)
        # a duplicate id while the first still runs
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "dup",
                    "prompt": PROMPT,
                    "params": {"max_new_tokens": 300, "ignore_eos": True},
                }
            )
        )
        await ws.send(json.dumps({"type": "generate", "id": "dup", "prompt": PROMPT}))
        await ws.send(json.dumps({"type": "cancel", "id": "dup"}))
        seen = []
        while True:
            m = await recv_json(ws)
            seen.append(m)
            if m["type"] == "done":
                break
        assert any(m["type"] == "error" and m["code"] == P.DUPLICATE_ID for m in seen)
        assert seen[-1]["finish_reason"] == "cancelled"
    finally:
        await ws.close()
    ok = await (
        await client.generate(PROMPT, GenerationParams(max_new_tokens=3), slot="after")
    ).wait()
    assert ok.finish_reason in ("length", "eos")


async def test_a_lone_surrogate_is_read_as_the_replacement_character(server):
    """JSON may escape a lone surrogate: a text prompt holding one was an exception out of the
    connection's reader, and the client got no reply. It is read as U+FFFD (an id too), and the
    generation is that of the text with U+FFFD."""
    ws = await raw_connection(server)

    async def run(gid: str, prompt: str) -> list[dict]:
        params = {"max_new_tokens": 4, "ignore_eos": True}
        await ws.send(
            json.dumps({"type": "generate", "id": gid, "prompt": prompt, "params": params})
        )
        out = []
        while not out or out[-1]["type"] not in ("done", "error"):
            out.append(await recv_json(ws))
        return out

    try:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        await recv_json(ws)
        got = await run("s\udc00", "def f():\n    return '\ud800")  # json.dumps escapes them
        want = await run("t", "def f():\n    return '\ufffd")
        assert {m["id"] for m in got} == {"s\ufffd"} and got[-1]["type"] == "done", got
        text = lambda ms: "".join(m.get("text", "") for m in ms)  # noqa: E731
        assert text(got) == text(want)
        assert got[-1]["stats"]["prompt_tokens"] == want[-1]["stats"]["prompt_tokens"]
    finally:
        await ws.close()


async def test_a_fault_of_the_service_fails_the_message_not_the_connection(engine):
    """An exception the service did not foresee while handling a message (here: encoding the
    prompt) is an `engine_error` for that message; the connection answers the next one."""
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    conn = Connection(LocalModels([engine]), send)

    def boom(model, prompt):
        raise RuntimeError("boom")

    conn.models.encode = boom
    try:
        await conn.handle(json.dumps({"type": "hello", "protocol": 1}))
        await conn.handle(json.dumps({"type": "generate", "id": "g", "prompt": "x"}))
        await conn.handle(json.dumps({"type": "status", "id": "s"}))
        for _ in range(200):
            if any(m.get("id") == "s" for m in sent):
                break
            await asyncio.sleep(0.01)
        [err] = [m for m in sent if m["type"] == "error"]
        assert err == {
            "type": "error",
            "code": P.ENGINE_ERROR,
            "message": "RuntimeError: boom",
            "id": "g",
        }
        assert [m["type"] for m in sent if m.get("id") == "s"] == ["status"]
    finally:
        await conn.close()


async def test_oversized_message_is_refused_and_oversized_frame_closes_cleanly(server):
    ws = await raw_connection(server, max_size=None)
    try:
        await ws.send(json.dumps({"type": "hello"}))
        await recv_json(ws)
        await ws.send(
            json.dumps({"type": "steer", "id": "a", "text": "x" * (P.MAX_MESSAGE_BYTES + 10)})
        )
        reply = await recv_json(ws)
        assert reply["code"] == P.TOO_LARGE
        await ws.send(json.dumps({"type": "status"}))
        assert (await recv_json(ws))["type"] == "status"  # still open
        await ws.send("x" * (P.MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionClosed) as info:
            await recv_json(ws)
        assert (
            info.value.rcvd is not None and info.value.rcvd.code == 1009
        )  # a close frame, not a drop
    finally:
        if ws.state.name == "OPEN":
            await ws.close()


async def test_wrong_or_missing_token_is_refused(server):
    with pytest.raises(EngineUnavailable, match="401"):
        await EngineClient.connect(server.url, "wrong-token-wrong-token")
    with pytest.raises(EngineUnavailable, match="401"):
        await EngineClient.connect(server.url, None)


async def test_browser_origin_refused_unless_allowed(server):
    with pytest.raises(EngineUnavailable, match="403"):
        await EngineClient.connect(server.url, TOKEN, origin="https://evil.example")
    c = await EngineClient.connect(server.url, TOKEN, origin="https://allowed.example")
    await c.close()


# -- backpressure -------------------------------------------------------------------------------
async def test_a_client_that_stops_reading_holds_its_generation(engine):
    """A sender that never completes: the generation stops after WINDOW undelivered tokens, and
    the outbox holds them in one merged message; releasing the client lets it finish."""
    unblock = asyncio.Event()
    sent: list[str] = []

    async def slow_send(data: str) -> None:
        await unblock.wait()
        sent.append(data)

    conn = Connection(LocalModels([engine]), slow_send)
    await conn.handle(json.dumps({"type": "hello"}))
    await conn.handle(
        json.dumps(
            {
                "type": "generate",
                "id": "g",
                "prompt": PROMPT,
                "slot": "bp",
                "params": {"max_new_tokens": 300, "ignore_eos": True},
            }
        )
    )
    run = conn.runs["g"]
    for _ in range(3000):
        if len(run.stream.ids) >= WINDOW:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # give a runaway generation the chance to show itself
    assert len(run.stream.ids) == WINDOW
    assert len(conn.outbox.items) <= 2  # the hello reply being sent + one merged tokens message
    unblock.set()
    for _ in range(3000):
        if "g" not in conn.runs:
            break
        await asyncio.sleep(0.01)
    await conn.close()
    done = [json.loads(s) for s in sent if '"done"' in s]
    assert done and done[-1]["stats"]["new_tokens"] == 300
    assert sum(len(json.loads(s).get("ids", ())) for s in sent) == 300


async def test_acredit_waits_for_a_release_without_polling(engine):
    """The event-loop form of credit (the Ray ingress's): with no credit left it waits, and a
    credit given back from another thread, or the generation stopped, wakes it at once."""

    async def send(data: str) -> None:
        pass

    conn = Connection(LocalModels([engine]), send)
    run = Run(conn, "g", None, [], None, None)
    for _ in range(WINDOW):
        await run.acredit()
    waiting = asyncio.ensure_future(run.acredit())
    await asyncio.sleep(0.05)
    assert not waiting.done() and run._credit_waiter is not None  # a future, not a sleep loop
    threading.Thread(target=run.release).start()
    await asyncio.wait_for(waiting, 1.0)
    waiting = asyncio.ensure_future(run.acredit())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    run.stop()  # a cancel: the generation's wait ends so that it can see it
    await asyncio.wait_for(waiting, 1.0)
    assert run._credit_waiter is None
    await conn.close()


_EARLY = {"prompt_tokens": 3, "reused_tokens": 2, "ttft_ms": 1.5}


class _Burst:
    """A models backend whose generations deliver a scripted burst of tokens from a thread:
    ``script`` is a list of (seconds to wait, tokens to deliver at once), then the end."""

    def __init__(self, script) -> None:
        self.script = script

    def describe(self):
        return [{"name": "burst", "vocab_size": 100, "context": 1000}]

    def encode(self, name, prompt):
        return [1, 2, 3]

    def start(self, name, ids, params, slot, sink):
        import threading

        class Handle:
            def cancel(self) -> None:
                pass

        def run() -> None:
            n = 0
            for wait, count in self.script:
                time.sleep(wait)
                for _ in range(count):
                    sink.chunk(n, f"t{n} ", dict(_EARLY) if n == 0 else None)
                    n += 1
            sink.finish("length", {"new_tokens": n}, None)

        threading.Thread(target=run, daemon=True).start()
        return Handle()


async def test_tokens_leave_at_once_then_coalesced_and_never_after_done():
    """The asyncio connection (the Ray ingress) sends a generation's first token at once, with
    its early stats, and the rest at most every COALESCE_S: a burst goes as one message; tokens
    that wait are sent by a timer, not held until the end; everything reaches the client in
    order, before `done`."""
    from engine.service.connection import COALESCE_S

    sent: list[dict] = []
    loop = asyncio.get_running_loop()

    async def send(data: str) -> None:
        sent.append({**json.loads(data), "at": loop.time()})

    pause = 100 * COALESCE_S  # long enough that a loaded machine's late timer still shows
    conn = Connection(_Burst([(0, 1), (0.05, 20), (0, 0), (pause, 0)]), send)
    await conn.handle(json.dumps({"type": "hello"}))
    await conn.handle(json.dumps({"type": "generate", "id": "g", "prompt": "x"}))
    for _ in range(500):
        if any(m.get("type") == "done" for m in sent):
            break
        await asyncio.sleep(0.01)
    await conn.close()
    msgs = [m for m in sent if m.get("id") == "g"]
    kinds = [m["type"] for m in msgs]
    assert kinds[-1] == "done" and kinds.count("done") == 1
    tokens = [m for m in msgs if m["type"] == "tokens"]
    assert tokens[0]["ids"] == [0]  # the first token at once, alone
    assert tokens[0]["stats"] == _EARLY and all("stats" not in m for m in tokens[1:])
    assert [i for m in tokens for i in m["ids"]] == list(range(21))
    assert "".join(m["text"] for m in tokens) == "".join(f"t{i} " for i in range(21))
    # the burst of 20 is coalesced: messages after the first leave at least COALESCE_S apart
    # (how many depends on how the burst's thread was scheduled: on a busy machine it can stall)
    gaps = [b["at"] - a["at"] for a, b in zip(tokens, tokens[1:])]
    assert all(g >= COALESCE_S - 1e-4 for g in gaps), gaps
    assert max(len(m["ids"]) for m in tokens) > 1
    # the burst's last tokens were sent by the timer during the pause, not held for the `done`
    assert msgs[-1]["at"] - tokens[-1]["at"] > pause / 2
    assert conn._held == {}


def test_generation_workers_are_reused_never_starve_and_retire():
    import threading

    from engine.service.local import Workers

    def wait_for(cond):
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    pool = Workers(idle_s=60.0)
    names = []
    for _ in range(5):  # one after another: one thread does them all
        done = threading.Event()
        pool.submit(lambda d=done: (names.append(threading.current_thread().ident), d.set()))
        done.wait(30)
        wait_for(lambda: pool._idle == 1)
    assert len(set(names)) == 1 and pool.threads == 1
    release = threading.Event()
    started = []
    for _ in range(3):  # three held at once (a stalled client each): each gets its own thread
        pool.submit(lambda: (started.append(1), release.wait(30)))
    wait_for(lambda: len(started) == 3)
    assert pool.threads == 3
    release.set()
    quick = Workers(idle_s=0.05)
    quick.submit(lambda: None)
    wait_for(lambda: quick.threads == 0)  # idle threads exit
    ran = threading.Event()
    quick.submit(ran.set)  # and a new one starts for the next job
    assert ran.wait(30)


async def test_cancel_ends_a_generation_held_by_a_client_that_stopped_reading(engine):
    unblock = asyncio.Event()
    sent: list[str] = []

    async def slow_send(data: str) -> None:
        await unblock.wait()
        sent.append(data)

    conn = Connection(LocalModels([engine]), slow_send)
    await conn.handle(json.dumps({"type": "hello"}))
    await conn.handle(
        json.dumps(
            {"type": "generate", "id": "g", "prompt": PROMPT, "params": {"ignore_eos": True}}
        )
    )
    run = conn.runs["g"]
    for _ in range(3000):
        if len(run.stream.ids) >= WINDOW:
            break
        await asyncio.sleep(0.01)
    await conn.handle(json.dumps({"type": "cancel", "id": "g"}))
    for _ in range(3000):  # it ends while the client still reads nothing
        if "g" not in conn.runs:
            break
        await asyncio.sleep(0.01)
    assert "g" not in conn.runs and not sent
    unblock.set()
    await conn.close()
    done = [json.loads(s) for s in sent if '"done"' in s]
    assert (
        done[-1]["finish_reason"] == "cancelled" and done[-1]["stats"]["new_tokens"] <= WINDOW + 1
    )


async def test_a_keystroke_on_a_warm_slot_generates_what_in_process_does(client, engine):
    """The second request finds all but its last token in the slot (a keystroke): the service
    reuses the KV and generates the in-process engine's text for the same two steps."""
    ids = engine.tokenizer.encode("def mean(xs):\n    total = 0\n    for x in xs:\n")
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    local = [engine.generate(p, params, slot="warm-ref").result() for p in (ids, ids + ids[-1:])]
    remote = []
    for p in (ids, ids + ids[-1:]):
        gen = await client.generate(p, params, slot="warm")
        remote.append(await gen.result())
    assert remote == local
    assert gen.stats["reused_tokens"] == len(ids) and gen.stats["new_tokens"] == 24


# -- the daemon's threaded connection: generations write their own tokens --------------------
def _socket_connection(engine):
    """A ThreadConnection writing newline-separated messages into one end of a socket pair with
    small buffers (the client end, which the test reads or not)."""
    import socket

    from engine.service.connection import ThreadConnection

    server_end, client_end = socket.socketpair()
    server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    def send(text: str) -> None:
        server_end.sendall(text.encode() + b"\n")

    conn = ThreadConnection(LocalModels([engine]), send, server_end)
    return conn, server_end, client_end


def _read_all(sock) -> list[dict]:
    sock.setblocking(False)
    data = b""
    while True:
        try:
            part = sock.recv(1 << 16)
        except BlockingIOError:
            break
        if not part:
            break
        data += part
    return [json.loads(line) for line in data.splitlines() if line]


def _wait(cond, timeout: float = 30.0) -> None:

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_threaded_a_client_that_stops_reading_holds_its_generation(engine):
    """The generation writes its own tokens; when the client reads nothing, it stops once the
    socket's buffers are full (nothing queues in the server), and goes on when the client
    reads again, delivering every token."""

    conn, server_end, client_end = _socket_connection(engine)
    conn.handle(json.dumps({"type": "hello"}))
    conn.handle(
        json.dumps(
            {
                "type": "generate",
                "id": "g",
                "prompt": PROMPT,
                "slot": "tbp",
                "params": {"max_new_tokens": 600, "ignore_eos": True},
            }
        )
    )
    run = conn.runs["g"]
    stalled = wait_until_stalled(run)
    assert 0 < stalled < 600, "the generation never waited for the client"
    assert "g" in conn.runs
    received: list[dict] = []
    client_end.settimeout(30)
    buf = b""
    while not any(m.get("type") == "done" for m in received):
        buf += client_end.recv(1 << 16)
        *lines, buf = buf.split(b"\n")
        received += [json.loads(line) for line in lines if line]
    done = [m for m in received if m["type"] == "done"][-1]
    assert done["finish_reason"] == "length" and done["stats"]["new_tokens"] == 600
    tokens = [m for m in received if m["type"] == "tokens"]
    assert len(tokens[0]["ids"]) == 1  # the first token leaves alone, at once
    assert [i for m in tokens for i in m["ids"]] == run.stream.ids  # all, in order
    assert "".join(m["text"] for m in tokens) == run.stream.text
    conn.close()
    server_end.close()
    client_end.close()


def test_threaded_cancel_ends_a_generation_held_by_a_client_that_stopped_reading(engine):

    conn, server_end, client_end = _socket_connection(engine)
    conn.handle(json.dumps({"type": "hello"}))
    conn.handle(
        json.dumps(
            {"type": "generate", "id": "g", "prompt": PROMPT, "params": {"ignore_eos": True}}
        )
    )
    run = conn.runs["g"]
    while True:  # held by the full socket
        n = len(run.stream.ids)
        time.sleep(0.3)
        if n and len(run.stream.ids) == n:
            break
    conn.handle(json.dumps({"type": "cancel", "id": "g"}))
    _wait(lambda: run.handle.gen is not None and run.handle.gen.done)  # stopped, unread
    assert run.handle.gen.finish_reason == "cancelled"
    client_end.settimeout(30)
    buf = b""
    while b'"done"' not in buf:
        buf += client_end.recv(1 << 16)
    done = [json.loads(x) for x in buf.splitlines() if b'"done"' in x][-1]
    assert done["finish_reason"] == "cancelled"
    _wait(lambda: "g" not in conn.runs)
    conn.close()
    server_end.close()
    client_end.close()


def test_threaded_held_tokens_and_their_done_leave_in_one_write(engine, monkeypatch):
    """A cancelled generation's held tokens and its `done` go to the transport as one batch
    (one socket write: the client gets both at one wake-up), in that order, and with nothing
    else written in between; without a batch function they are written one by one."""
    import socket

    from engine.service import connection
    from engine.service.connection import ThreadConnection

    monkeypatch.setattr(connection, "COALESCE_S", 60.0)  # every token after the first is held
    for batched in (True, False):
        server_end, client_end = socket.socketpair()
        writes: list[list[dict]] = []

        def send(text: str) -> None:
            writes.append([json.loads(text)])

        def send_batch(texts) -> None:
            writes.append([json.loads(t) for t in texts])

        conn = ThreadConnection(
            LocalModels([engine]), send, server_end, send_batch=send_batch if batched else None
        )
        conn.handle(json.dumps({"type": "hello"}))
        conn.handle(
            json.dumps(
                {
                    "type": "generate",
                    "id": "g",
                    "prompt": PROMPT,
                    "params": {"max_new_tokens": 600, "ignore_eos": True},
                }
            )
        )
        run = conn.runs["g"]
        _wait(lambda: len(run.stream.ids) >= 4)
        conn.handle(json.dumps({"type": "cancel", "id": "g"}))
        _wait(lambda: "g" not in conn.runs)
        time.sleep(0.05)
        gen_writes = [w for w in writes if w[0].get("id") == "g"]
        assert len(gen_writes[0]) == 1 and len(gen_writes[0][0]["ids"]) == 1  # the first token
        if batched:
            assert len(gen_writes) == 2
            held, done = gen_writes[1]
        else:
            assert len(gen_writes) == 3 and all(len(w) == 1 for w in gen_writes)
            (held,), (done,) = gen_writes[1:]
        assert held["type"] == "tokens" and len(held["ids"]) >= 3
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        assert [gen_writes[0][0]["ids"][0], *held["ids"]] == run.stream.ids
        conn.close()
        server_end.close()
        client_end.close()


def test_direct_connection_joins_what_it_sends_into_one_write():
    """DirectServerConnection.send_data: the protocol's frames in one `sendall`, then the end
    of the stream when the protocol asks for it (an empty chunk), then what follows."""
    from types import SimpleNamespace

    from engine.service.direct import DirectServerConnection

    calls: list[tuple[str, bytes | None]] = []
    sock = SimpleNamespace(
        sendall=lambda data: calls.append(("sendall", data)),
        shutdown=lambda how: calls.append(("shutdown", None)),
        settimeout=lambda t: None,
    )
    conn = SimpleNamespace(
        protocol=SimpleNamespace(data_to_send=lambda: [b"ab", b"cd", b"", b"ef"]),
        socket=sock,
        close_deadline=None,
        _may_read=threading.Event(),
    )
    conn._write_joined = lambda chunks: DirectServerConnection._write_joined(conn, chunks)
    DirectServerConnection.send_data(conn)
    assert calls == [("sendall", b"abcd"), ("shutdown", None), ("sendall", b"ef")]
    assert conn._may_read.is_set()  # what a client wrote first is out: it may read now


def test_threaded_close_cancels_and_delivers_done(engine):
    """close(): every generation is cancelled and its `done` written before it returns."""
    import threading

    conn, server_end, client_end = _socket_connection(engine)
    received: list[dict] = []

    def reader() -> None:  # the client reads all along
        client_end.settimeout(60)
        buf = b""
        while buf.count(b'"type":"done"') < 2:
            part = client_end.recv(1 << 16)
            if not part:
                break
            buf += part
        received.extend(json.loads(x) for x in buf.splitlines() if x)

    t = threading.Thread(target=reader)
    t.start()
    conn.handle(json.dumps({"type": "hello"}))
    for gid in ("a", "b"):
        conn.handle(
            json.dumps(
                {
                    "type": "generate",
                    "id": gid,
                    "prompt": PROMPT,
                    "slot": gid,
                    "params": {"max_new_tokens": 400, "ignore_eos": True},
                }
            )
        )
    runs = list(conn.runs.values())
    _wait(lambda: all(len(r.stream.ids) >= 2 for r in runs))
    conn.close(drain_s=30)
    assert not conn.runs
    t.join(60)
    done = {m["id"]: m["finish_reason"] for m in received if m["type"] == "done"}
    assert done == {"a": "cancelled", "b": "cancelled"}
    server_end.close()
    client_end.close()


class _Offering(LocalModels):
    """LocalModels whose ``hello`` offers a direct endpoint (as a Ray Serve ingress does)."""

    def __init__(self, engines, direct: str) -> None:
        super().__init__(engines)
        self.direct = direct

    def capabilities(self) -> dict:
        return {"direct": self.direct}


async def test_clients_move_to_an_offered_endpoint_and_stay_when_it_fails(engine, caplog):
    """A ``direct`` capability moves both clients (token and all) to the endpoint it names; one
    that cannot be reached leaves them where they are, with a warning."""
    import logging

    from engine.service.sync_client import SyncEngineClient

    target = await EngineServer(LocalModels([engine]), token=TOKEN).start()
    closed = await EngineServer(LocalModels([engine]), token=TOKEN).start()
    front = await EngineServer(_Offering([engine], target.url), token=TOKEN).start()
    broken = await EngineServer(_Offering([engine], closed.url), token=TOKEN).start()
    # its port no longer listens (stopped after the others started, none of which can take it)
    await closed.stop()
    try:
        moved = await EngineClient.connect(front.url, TOKEN)
        assert moved.url == target.url and "direct" not in moved.hello["capabilities"]
        text = await (await moved.generate(PROMPT, LONG)).result()
        await moved.close()
        stay = await EngineClient.connect(front.url, TOKEN, direct=False)
        assert stay.url == front.url
        assert await (await stay.generate(PROMPT, LONG)).result() == text
        await stay.close()
        with caplog.at_level(logging.WARNING, logger="engine.service"):
            kept = await EngineClient.connect(broken.url, TOKEN)
            assert kept.url == broken.url  # the endpoint is gone: still served here
            await kept.close()
            sync = await asyncio.to_thread(SyncEngineClient.open, broken.url, TOKEN)
            assert sync.url == broken.url
            sync.close()
        assert sum("its direct endpoint failed" in r.message for r in caplog.records) == 2
        sync = await asyncio.to_thread(SyncEngineClient.open, front.url, TOKEN)
        assert sync.url == target.url
        sync.close()
    finally:
        for srv in (front, broken, target):
            await srv.stop()


def test_the_server_model_says_once_when_the_service_answers_again(engine, monkeypatch):
    """A connection lost under a generation is told to the editor (``on_health(False)``); the
    next request reconnects at once, and the editor is told it answers again, not left with the
    failure (the daemon restarted by ``auto``, a new Ray ingress replica)."""
    import socket

    from engine.cancel import CancelToken
    from spark_lsp.backends import engine_ws
    from spark_lsp.backends.base import BackendError

    srv = EngineServer(LocalModels([engine]), token=TOKEN).open()
    monkeypatch.setenv(engine_ws.TOKEN_ENV, TOKEN)
    model = engine_ws.EngineServiceModel(srv.url, None)
    health = []
    model.on_health = lambda up, message: health.append(up)
    ids = model.tokenizer.encode(PROMPT)
    try:
        stream = model.generate(ids, LONG, "doc", cancel=CancelToken())
        next(stream)
        model._client.ws.socket.shutdown(socket.SHUT_RDWR)  # the connection drops mid-stream
        with pytest.raises(BackendError, match="lost"):
            for _ in stream:
                pass
        params = GenerationParams(max_new_tokens=4, ignore_eos=True)
        text = "".join(c.text for c in model.generate(ids, params, "doc", cancel=CancelToken()))
        assert text and health == [False, True]
    finally:
        model.close()
        srv.close()
