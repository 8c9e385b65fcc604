"""The engine service over TLS: wss:// for the daemon, https:// for the SSE endpoint.

Certificates come from a throwaway CA made here (``trustme``); the model is the bundled one.
Greedy decoding is deterministic, so text over wss is compared with the in-process engine's.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import signal
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
import trustme
from service_support import run_dir, start_daemon, wait_until_stalled  # noqa: F401 (run_dir: a fixture)

from engine import Engine, GenerationParams
from engine.service import launch, manage, rundir, sse, tls
from engine.service.client import EngineClient
from engine.service.client_core import EngineUnavailable, direct_target
from engine.service.connection import ThreadConnection
from engine.service.local import LocalModels
from engine.service.server import EngineServer
from engine.service.sync_client import SyncEngineClient

TOKEN = "s" * 32
PROMPT = "def fibonacci(n):\n"
LONG = GenerationParams(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    """A CA, a certificate it signs for localhost / 127.0.0.1 and its key, as PEM files; and
    one for another host name only (hostname checking)."""
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    other = ca.issue_cert("engine.example")
    out = {k: str(d / f"{k}.pem") for k in ("ca", "cert", "key", "other_cert", "other_key")}
    ca.cert_pem.write_to_path(out["ca"])
    leaf.cert_chain_pems[0].write_to_path(out["cert"])
    leaf.private_key_pem.write_to_path(out["key"])
    other.cert_chain_pems[0].write_to_path(out["other_cert"])
    other.private_key_pem.write_to_path(out["other_key"])
    return out


@pytest.fixture(scope="module")
def engine():
    return Engine.load(slots=8)


@pytest.fixture(scope="module")
def reference(engine) -> str:
    gen = engine.generate(PROMPT, GenerationParams(max_new_tokens=24, ignore_eos=True), slot="r")
    for _ in gen:
        pass
    return gen.text


@pytest.fixture
def server(engine, certs):
    srv = EngineServer(
        LocalModels([engine]),
        token=TOKEN,
        ssl_context=tls.server_context(certs["cert"], certs["key"]),
    ).open()
    yield srv
    srv.close()


def test_a_pinned_file_trusts_its_first_certificate_only(engine, certs, tmp_path):
    """A chain in the pinned file (the daemon's certificate, then its CA) does not make the CA an
    anchor: another certificate the same CA signs is refused; the daemon's own is accepted."""
    ca = Path(certs["ca"]).read_text()
    srv = EngineServer(
        LocalModels([engine]),
        token=TOKEN,
        ssl_context=tls.server_context(certs["cert"], certs["key"]),
    ).open()
    try:
        theirs = tmp_path / "theirs.pem"
        theirs.write_text(Path(certs["other_cert"]).read_text() + ca)
        with pytest.raises(EngineUnavailable, match="could not be verified"):
            SyncEngineClient(srv.url, TOKEN, pinned_cert=str(theirs))
        own = tmp_path / "own.pem"
        own.write_text(Path(certs["cert"]).read_text() + ca)
        SyncEngineClient(srv.url, TOKEN, pinned_cert=str(own)).close()
        empty = tmp_path / "empty.pem"
        empty.write_text("not a certificate\n")
        with pytest.raises(EngineUnavailable, match="no PEM certificate"):
            SyncEngineClient(srv.url, TOKEN, pinned_cert=str(empty))
    finally:
        srv.close()


# -- the clients over wss ---------------------------------------------------------------------
async def test_asyncio_client_generates_over_wss(server, certs, reference):
    assert server.url.startswith("wss://127.0.0.1:")
    c = await EngineClient.connect(server.url, TOKEN, cafile=certs["ca"])
    try:
        gen = await c.generate(
            PROMPT, GenerationParams(max_new_tokens=24, ignore_eos=True), slot="a"
        )
        assert "".join([p.text async for p in gen]) == gen.text == reference
        assert gen.finish_reason == "length"
    finally:
        await c.close()


def test_sync_client_generates_and_cancels_over_wss(server, certs, reference):
    c = SyncEngineClient(server.url, TOKEN, cafile=certs["ca"])
    try:
        gen = c.generate(PROMPT, GenerationParams(max_new_tokens=24, ignore_eos=True), slot="s")
        assert "".join(p.text for p in gen) == reference
        long = c.generate(PROMPT, LONG, slot="long")
        for i, _ in enumerate(long):
            if i == 2:
                long.cancel()
        assert long.finish_reason == "cancelled" and len(long.tokens) < 400
    finally:
        c.close()


def test_threads_multiplex_generations_and_cancels_on_one_wss_connection(server, certs, engine):
    """One TLS connection read by its reading thread while several threads write requests and
    cancels on it (and the daemon's generations write their tokens): every generation ends,
    the uncancelled ones with the in-process text."""
    import random

    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    prompts = [f"def f{i}(x):\n" for i in range(4)]
    ref = {}
    for p in prompts:
        gen = engine.generate(p, params)
        for _ in gen:
            pass
        ref[p] = gen.text
    c = SyncEngineClient(server.url, TOKEN, cafile=certs["ca"])
    wrong: list[tuple] = []
    ends: list[str] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        for _ in range(12):
            p = rng.choice(prompts)
            gen = c.generate(p, params, slot=f"w{k}")
            cancel_at = rng.choice([None, 1, 4])
            for i, _ in enumerate(gen):
                if i == cancel_at:
                    gen.cancel()
            ends.append(gen.finish_reason)
            if gen.finish_reason != "cancelled" and (gen.text, gen.finish_reason) != (
                ref[p],
                "length",
            ):
                # everything needed to tell a numerical drift from a mixed-up stream, if it flakes
                wrong.append((p, gen.finish_reason, gen.text, ref[p], gen.stats, gen.error))

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not wrong, wrong
        assert len(ends) == 48 and not c.closed
        assert "cancelled" in ends and "length" in ends
    finally:
        c.close()


async def test_cancel_over_wss_stops_the_generation(server, certs):
    c = await EngineClient.connect(server.url, TOKEN, cafile=certs["ca"])
    try:
        gen = await c.generate(PROMPT, LONG, slot="c")
        seen = 0
        async for piece in gen:
            seen += len(piece.ids)
            if seen >= 3:
                break
        await gen.cancel()
        await asyncio.wait_for(gen.wait(), 10)
        assert gen.finish_reason == "cancelled" and gen.stats["new_tokens"] < 400
        # the connection goes on serving after the cancel
        again = await c.generate(PROMPT, GenerationParams(max_new_tokens=4), slot="c")
        await asyncio.wait_for(again.wait(), 30)
        assert again.finish_reason in ("length", "eos")
    finally:
        await c.close()


def test_server_close_over_wss_delivers_done_and_ends_the_stream(engine, certs):
    """close(): the generation in flight is cancelled, its `done` reaches the client over TLS,
    then the closing handshake and the end of the stream (direct.py's shutdown on the SSL
    socket) close the client's connection."""
    srv = EngineServer(
        LocalModels([engine]),
        token=TOKEN,
        ssl_context=tls.server_context(certs["cert"], certs["key"]),
    ).open()
    c = SyncEngineClient(srv.url, TOKEN, cafile=certs["ca"])
    try:
        gen = c.generate(PROMPT, LONG, slot="close")
        next(iter(gen))
        srv.close()
        for _ in gen:
            pass
        assert gen.finish_reason == "cancelled"
        deadline = time.monotonic() + 10
        while not c.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.closed and "closed" in c.close_reason
    finally:
        c.close()
        srv.close()


# -- refusals -----------------------------------------------------------------------------------
async def test_a_client_without_the_ca_is_refused_with_a_clear_error(server, certs):
    with pytest.raises(EngineUnavailable, match="could not be verified") as e:
        await EngineClient.connect(server.url, TOKEN)
    assert tls.CA_ENV in str(e.value) and server.url in str(e.value)
    with pytest.raises(EngineUnavailable, match=tls.CA_ENV):
        SyncEngineClient(server.url, TOKEN)
    with pytest.raises(EngineUnavailable, match="CA bundle"):
        SyncEngineClient(server.url, TOKEN, cafile=certs["ca"] + ".missing")


async def test_hostname_checking_stays_on(engine, certs):
    """A certificate from the trusted CA, but for another host name, is refused."""
    srv = EngineServer(
        LocalModels([engine]),
        token=TOKEN,
        ssl_context=tls.server_context(certs["other_cert"], certs["other_key"]),
    ).open()
    try:
        with pytest.raises(EngineUnavailable, match="could not be verified.*IP address mismatch"):
            await EngineClient.connect(srv.url, TOKEN, cafile=certs["ca"])
    finally:
        srv.close()


async def test_the_token_is_still_required_over_tls(server, certs):
    with pytest.raises(EngineUnavailable, match="401"):
        await EngineClient.connect(server.url, "not-the-token-not-the-token", cafile=certs["ca"])
    with pytest.raises(EngineUnavailable, match="401"):
        await EngineClient.connect(server.url, None, cafile=certs["ca"])


def handshake_failures(caplog, port: int, timeout: float = 30.0) -> list[str]:
    """The log's failed-handshake lines about the client on local ``port``, once there is one
    (the server shakes hands on a thread of its own)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [
            r.getMessage()
            for r in caplog.records
            if f"TLS handshake with 127.0.0.1:{port} failed" in r.getMessage()
        ]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


async def test_a_plain_ws_client_fails_cleanly_and_the_daemon_keeps_serving(server, certs, caplog):
    """Each client that fails the TLS handshake leaves one line in the daemon's log, with its
    address and why; the daemon goes on serving."""
    caplog.set_level(logging.WARNING, logger="engine.service.server")
    plain = server.url.replace("wss://", "ws://")
    with pytest.raises(EngineUnavailable, match="wss://"):
        await EngineClient.connect(plain, TOKEN, open_timeout=5)
    with pytest.raises(EngineUnavailable):
        SyncEngineClient(plain, TOKEN, open_timeout=5)
    # a raw TCP client that sends an HTTP request, one that sends junk, one that sends nothing
    # at all, then each leaves
    for data, why in (
        (b"GET / HTTP/1.1\r\n\r\n", "http request"),
        (b"\x00 junk junk\r\n", "wrong version number"),
        (b"", ""),
    ):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(data)
            port = s.getsockname()[1]
            if data:
                assert await asyncio.to_thread(handshake_failures, caplog, port) == [
                    f"engine: TLS handshake with 127.0.0.1:{port} failed: {why}"
                ]
        if not data:
            assert len(await asyncio.to_thread(handshake_failures, caplog, port)) == 1
    c = await EngineClient.connect(server.url, TOKEN, cafile=certs["ca"])
    try:
        gen = await c.generate(PROMPT, GenerationParams(max_new_tokens=4), slot="p")
        await asyncio.wait_for(gen.wait(), 30)
        assert gen.finish_reason in ("length", "eos")
    finally:
        await c.close()


def test_language_server_trusts_the_ca_named_by_its_environment(server, certs, monkeypatch):
    """`engine: wss://...`: the certificate is checked against $SPARK_LSP_ENGINE_CA; without
    it the connection is refused with a message that names the variable."""
    from engine.cancel import CancelToken
    from spark_lsp.backends import engine_ws

    monkeypatch.setenv(engine_ws.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(engine_ws.CA_ENV, raising=False)
    with pytest.raises(EngineUnavailable, match=engine_ws.CA_ENV):
        engine_ws.EngineServiceModel(server.url, None)
    monkeypatch.setenv(engine_ws.CA_ENV, certs["ca"])
    model = engine_ws.EngineServiceModel(server.url, None)
    try:
        assert model.status()["engine"].startswith("wss://")
        ids = model.tokenizer.encode(PROMPT)
        stream = model.generate(
            ids, GenerationParams(max_new_tokens=4, ignore_eos=True), "doc", cancel=CancelToken()
        )
        assert "".join(chunk.text for chunk in stream)  # the suggestion's text came back
    finally:
        model.close()


async def test_a_wss_client_against_a_plain_daemon_says_what_failed(engine, certs):
    srv = EngineServer(LocalModels([engine]), token=TOKEN).open()
    try:
        url = srv.url.replace("ws://", "wss://")
        with pytest.raises(EngineUnavailable, match="TLS handshake .* failed.*serve wss://"):
            await EngineClient.connect(url, TOKEN, cafile=certs["ca"], open_timeout=5)
        with pytest.raises(EngineUnavailable, match="TLS handshake"):
            SyncEngineClient(url, TOKEN, cafile=certs["ca"], open_timeout=5)
    finally:
        srv.close()


def test_failed_handshakes_are_logged_at_most_limit_a_window_then_summed_up(caplog):
    """A scanner cannot flood the log: past ``limit`` lines a window, failures are counted and
    one line at the window's end says how many; the next window logs them again."""
    logger = logging.getLogger("test.handshakes")
    caplog.set_level(logging.WARNING, logger="test.handshakes")
    now = [100.0]
    failures = tls.FailedHandshakes(logger, limit=3, window_s=60.0, clock=lambda: now[0])
    reset = ConnectionResetError(104, "Connection reset by peer")
    for i in range(5):
        failures.failed(("10.0.0.1", 4000 + i), reset)
    assert [r.getMessage() for r in caplog.records] == [
        f"engine: TLS handshake with 10.0.0.1:{4000 + i} failed: connection reset by peer"
        for i in range(3)
    ]
    assert failures._timer is not None  # the summary waits for the window's end
    caplog.clear()
    failures.flush()  # what the timer does then
    assert [r.getMessage() for r in caplog.records] == [
        "engine: 2 more TLS handshakes failed within 60 s (not logged one by one: at most 3 are)"
    ]
    caplog.clear()
    now[0] += 61.0
    failures.failed(None, TimeoutError("_ssl.c:983: The handshake operation timed out"))
    assert [r.getMessage() for r in caplog.records] == [
        "engine: TLS handshake with ? failed: timed out"
    ]


# -- the threaded connection on an SSL socket ------------------------------------------------
def _tls_pair(certs) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """Both ends of a socket pair with small buffers, after a TLS handshake."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server_ctx = tls.server_context(certs["cert"], certs["key"])
    out: list[ssl.SSLSocket] = []
    t = threading.Thread(target=lambda: out.append(server_ctx.wrap_socket(a, server_side=True)))
    t.start()
    client = tls.client_context(certs["ca"]).wrap_socket(b, server_hostname="localhost")
    t.join(10)
    return out[0], client


def test_threaded_connection_on_tls_holds_a_generation_for_a_client_that_stops_reading(
    engine, certs
):
    """``ThreadConnection._credit`` waits on the SSL socket's descriptor: a generation whose
    client reads nothing stops once the buffers are full, and when the client reads again
    every token arrives, in order (nothing stays pending in the TLS layer)."""
    server_end, client_end = _tls_pair(certs)

    def send(text: str) -> None:
        server_end.sendall(text.encode() + b"\n")

    conn = ThreadConnection(LocalModels([engine]), send, server_end)
    conn.handle(json.dumps({"type": "hello"}))
    client_end.settimeout(30)
    buf = b""
    while b"\n" not in buf:  # the hello reply, read as a client does (the buffers are small)
        buf += client_end.recv(1 << 16)
    assert json.loads(buf.split(b"\n")[0])["type"] == "hello"
    buf = buf.split(b"\n", 1)[1]
    conn.handle(
        json.dumps(
            {
                "type": "generate",
                "id": "g",
                "prompt": PROMPT,
                "slot": "tls-hold",
                "params": {"max_new_tokens": 600, "ignore_eos": True},
            }
        )
    )
    run = conn.runs["g"]
    stalled = wait_until_stalled(run)
    assert 0 < stalled < 600, "the generation never waited for the client"
    received: list[dict] = []
    while not any(m.get("type") == "done" for m in received):
        buf += client_end.recv(1 << 16)
        *lines, buf = buf.split(b"\n")
        received += [json.loads(line) for line in lines if line]
    done = [m for m in received if m["type"] == "done"][-1]
    assert done["finish_reason"] == "length" and done["stats"]["new_tokens"] == 600
    ids = [i for m in received if m["type"] == "tokens" for i in m["ids"]]
    assert ids == run.stream.ids
    conn.close()
    server_end.close()
    client_end.close()


# -- the SSE endpoint over https ----------------------------------------------------------------
def test_sse_endpoint_over_https(engine, certs, caplog):
    caplog.set_level(logging.WARNING, logger="engine.service.sse")
    srv = sse.serve(engine, ssl_context=tls.server_context(certs["cert"], certs["key"]))
    port = srv.server_address[1]
    try:
        # a plain HTTP client gets no answer, the log says why; the endpoint goes on serving
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            plain.connect()
            client_port = plain.sock.getsockname()[1]
            plain.request("POST", "/generate", body="{}")
            plain.getresponse()
        plain.close()
        assert handshake_failures(caplog, client_port) == [
            f"sse: TLS handshake with 127.0.0.1:{client_port} failed: http request"
        ]
        conn = http.client.HTTPSConnection(
            "127.0.0.1", port, context=tls.client_context(certs["ca"]), timeout=60
        )
        body = {"prompt": PROMPT, "params": {"max_new_tokens": 6, "ignore_eos": True}}
        conn.request("POST", "/generate", body=json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        events = resp.read().decode()
        conn.close()
        chunks = [
            json.loads(line[6:])
            for line in events.splitlines()
            if line.startswith("data: ") and '"ids"' in line
        ]
        assert len(chunks) == 6 and "event: done" in events
        # without the CA, the client refuses the certificate
        bare = http.client.HTTPSConnection("127.0.0.1", port, context=tls.client_context())
        with pytest.raises(ssl.SSLCertVerificationError):
            bare.request("POST", "/generate", body="{}")
        bare.close()
    finally:
        srv.shutdown()


# -- the daemon's command line --------------------------------------------------------------------
@pytest.mark.slow
def test_daemon_serves_wss_with_a_certificate_and_key(run_dir, certs, monkeypatch):
    """The daemon announces and records its wss:// URL and its certificate's file; the user's
    own clients that find it through the record (`engine: auto`) pin that certificate, so it
    need not name the bind address (here it names engine.example only), while a client given
    the URL checks the host name.  SIGTERM cancels what is in flight over TLS."""
    from engine.cancel import CancelToken
    from spark_lsp.backends import engine_ws

    proc = start_daemon("--tls-cert", certs["other_cert"], "--tls-key", certs["other_key"])
    model = None
    try:
        key = rundir.model_key(launch.resolve_models([None]))
        line = proc.stderr.readline().decode()
        while "engine service on" not in line:
            assert line, "the daemon exited before announcing its URL"
            line = proc.stderr.readline().decode()
        assert "engine service on wss://127.0.0.1:" in line
        rec = rundir.read_record(key)
        assert rec["url"].startswith("wss://127.0.0.1:") and rec["pid"] == proc.pid
        assert rec["tls_cert"] == str(Path(certs["other_cert"]).resolve())

        monkeypatch.delenv(engine_ws.CA_ENV, raising=False)
        model = engine_ws.EngineServiceModel("auto", None)  # joins it through the record
        assert model.url == rec["url"]
        stream = model.generate(
            model.tokenizer.encode(PROMPT),
            GenerationParams(max_new_tokens=4, ignore_eos=True),
            "doc",
            cancel=CancelToken(),
        )
        assert "".join(chunk.text for chunk in stream)
        with pytest.raises(EngineUnavailable, match="IP address mismatch"):
            SyncEngineClient(rec["url"], rec["token"], cafile=certs["ca"])
        with pytest.raises(EngineUnavailable, match="could not be verified"):
            SyncEngineClient(rec["url"], rec["token"], pinned_cert=certs["cert"])  # not its own
        (listed,) = [manage.check(svc) for svc in manage.services()]  # `engine list` pins it too
        assert listed.tls and listed.answers, listed.problem

        async def scenario():
            c = await EngineClient.connect(rec["url"], rec["token"], pinned_cert=rec["tls_cert"])
            gen = await c.generate(PROMPT, LONG, slot="d")
            async for _ in gen:
                break
            proc.send_signal(signal.SIGTERM)  # in flight: cancelled, its done delivered over TLS
            await asyncio.wait_for(gen.wait(), 30)
            await c.close()
            return gen

        assert asyncio.run(scenario()).finish_reason == "cancelled"
        assert proc.wait(30) == 0
    finally:
        if model is not None:
            model.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tls-cert", "CERT"], b"--tls-cert needs --tls-key"),
        (["--tls-key", "KEY"], b"--tls-key needs --tls-cert"),
        (["--tls-cert", "CERT", "--tls-key", "CERT.missing"], b"private key"),
        (["--tls-cert", "CERT", "--tls-key", "OTHER_KEY"], b"cannot use the certificate"),
        (["--ray", "--tls-cert", "CERT", "--tls-key", "OTHER_KEY"], b"cannot use the certificate"),
    ],
)
def test_daemon_refuses_bad_tls_options_before_loading(run_dir, certs, args, message):
    subs = {"CERT": certs["cert"], "KEY": certs["key"], "OTHER_KEY": certs["other_key"]}
    argv = []
    for a in args:
        for k in sorted(subs, key=len, reverse=True):
            a = a.replace(k, subs[k])
        argv.append(a)
    proc = start_daemon(*argv)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert message in err


@pytest.mark.slow
def test_allow_remote_without_tls_warns_about_clear_text(run_dir, tmp_path):
    log = tmp_path / "daemon.log"
    proc = start_daemon("--ws", "0.0.0.0:0", "--allow-remote", "--log-file", str(log))
    try:
        line = proc.stderr.readline().decode()
        assert "unencrypted" in line and "--tls-cert" in line
        assert "unencrypted" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_direct_endpoint_is_followed_only_on_the_same_scheme():
    """A service's ``direct`` capability (a Ray Serve ingress replica's own socket) moves the
    client, token included, only where the token stays as protected as it was."""

    def offer(url):
        return {"capabilities": {"direct": url}}

    assert direct_target("wss://a:1/", offer("wss://b:2/")) == "wss://b:2/"
    assert direct_target("ws://a:1/", offer("ws://b:2/")) == "ws://b:2/"
    assert direct_target("wss://a:1/", offer("ws://b:2/")) is None  # never to cleartext
    assert direct_target("ws://a:1/", offer("http://b:2/")) is None
    assert direct_target("ws://a:1/", offer("ws://a:1")) is None  # already there
    assert direct_target("ws://a:1/", offer(None)) is None
    assert direct_target("ws://a:1/", {"capabilities": {}}) is None


def test_a_wss_handshake_that_times_out_fails_in_time(certs):
    """A TLS server that never answers the WebSocket upgrade (a hung daemon, a busy proxy): the
    language server's client gives up after its open timeout.  Before, the socket's reading
    thread sat in a blocking TLS read (the server's TLS 1.3 session tickets made the socket
    readable) that closing the socket did not end, and the connect waited minutes for it."""
    ctx = tls.server_context(certs["cert"], certs["key"])
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                held.append(ctx.wrap_socket(raw, server_side=True))  # TLS, then silence
            except (OSError, ssl.SSLError):
                raw.close()

    threading.Thread(target=accept, daemon=True).start()
    url = f"wss://127.0.0.1:{listener.getsockname()[1]}/"
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="handshake"):
            SyncEngineClient(url, TOKEN, open_timeout=1.0, cafile=certs["ca"])
        assert time.monotonic() - t0 < 10  # the open timeout, not a reading thread's whims
    finally:
        listener.close()
        for s in held:
            s.close()


def test_our_servers_send_no_session_tickets(certs):
    """Clients keep one connection and never resume one; a ticket only gives a threaded client
    something to read while it writes (the next test)."""
    assert tls.server_context(certs["cert"], certs["key"]).num_tickets == 0


@pytest.mark.slow
def test_the_threaded_client_survives_a_server_that_sends_tickets(certs):
    """A TLS 1.3 server that sends session tickets (Serve's proxy, nginx in front of a daemon):
    the language server's client reads them only once its opening request is out, never while
    writing it from another thread (OpenSSL does not support that: connects stalled until their
    timeout, about one in a few hundred on a loaded machine, and with 64 tickets the heap was
    corrupted).  300 connects with both cores busy: none may fail."""
    import subprocess
    import sys

    from websockets.asyncio.server import serve

    from engine.service import protocol as P

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs["cert"], certs["key"])
    ctx.num_tickets = 64
    hello = P.encode({"type": "hello", "protocol": 1, "models": [], "capabilities": {}})
    ready = threading.Event()
    port: list[int] = []
    stop: list[asyncio.Future] = []

    async def answer(ws) -> None:
        async for _ in ws:
            await ws.send(hello)

    async def main() -> None:
        async with serve(answer, "127.0.0.1", 0, ssl=ctx, **P.SOCKET_OPTIONS) as srv:
            port.append(srv.sockets[0].getsockname()[1])
            stop.append(asyncio.get_running_loop().create_future())
            ready.set()
            await stop[0]

    loop_thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    loop_thread.start()
    assert ready.wait(10)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    failed = []
    try:
        for _ in range(300):
            try:
                SyncEngineClient(
                    f"wss://127.0.0.1:{port[0]}/", TOKEN, open_timeout=5.0, cafile=certs["ca"]
                ).close()
            except EngineUnavailable as e:
                failed.append(str(e))
    finally:
        for p in busy:
            p.kill()
            p.wait()
        fut = stop[0]
        fut.get_loop().call_soon_threadsafe(fut.set_result, None)
        loop_thread.join(10)
    assert not failed, failed
