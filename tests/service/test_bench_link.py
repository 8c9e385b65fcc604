"""The emulated network link of `bench service --rtt`: bytes relayed intact and in order both ways,
end of stream forwarded, and the delay a link of that round trip imposes (lower bounds only: the
proxy sleeps at least that long, a busy machine can only add to it)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from spark_lsp.bench import link as bench_link


@pytest.fixture()
def echo():
    """A TCP server that echoes each connection until the client ends its side, then closes."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def one(conn: socket.socket) -> None:
        got = bytearray()
        while data := conn.recv(1 << 16):
            got += data
            conn.sendall(data)
        seen.append(bytes(got))
        conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/path", seen
    server.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = s.recv(n - len(buf))
        assert data, "the link ended the stream early"
        buf += data
    return bytes(buf)


def test_relays_bytes_in_order_and_forwards_the_end_of_each_direction(echo):
    url, seen = echo
    proc, via = bench_link.start(url, 2)
    try:
        assert via.startswith("http://127.0.0.1:") and via.endswith("/path") and via != url
        port = int(via.split(":")[2].split("/")[0])
        payload = bytes(range(256)) * 4096  # 1 MiB, in many chunks
        with socket.create_connection(("127.0.0.1", port)) as s:
            sender = threading.Thread(target=s.sendall, args=(payload,))
            sender.start()
            back = _recv_exactly(s, len(payload))
            sender.join()
            s.shutdown(socket.SHUT_WR)  # the server sees the end, then closes: we see ours
            assert s.recv(1) == b""
        assert back == payload
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [payload]
    finally:
        proc.kill()
        proc.wait()


def test_a_new_connection_pays_the_handshake_then_every_exchange_a_round_trip(echo):
    url, _ = echo
    rtt = 0.08
    proc, via = bench_link.start(url, rtt * 1e3)
    try:
        port = int(via.split(":")[2].split("/")[0])
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"ping")
            assert _recv_exactly(s, 4) == b"ping"
            first = time.monotonic() - t0
            t1 = time.monotonic()
            s.sendall(b"pong")
            assert _recv_exactly(s, 4) == b"pong"
            second = time.monotonic() - t1
        assert first >= 2 * rtt  # the TCP handshake's round trip, then the request's
        assert second >= rtt  # an open connection: one round trip
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_is_gone_closes_the_client_connection():
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    proc, via = bench_link.start(f"ws://127.0.0.1:{port}", 1)
    try:
        with socket.create_connection(("127.0.0.1", int(via.rsplit(":", 1)[1]))) as s:
            s.settimeout(10)
            assert s.recv(1) == b""
    finally:
        proc.kill()
        proc.wait()
