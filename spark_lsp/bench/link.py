"""An emulated network link for `spark-lsp bench service --rtt MS`: a TCP proxy that delays each
direction by half a round trip.

On loopback a TCP handshake costs about 0.1 ms, so a client that opens a connection per request
(the HTTP+SSE baseline) pays almost nothing for it there, and a persistent WebSocket can only save
the few hundred microseconds of Python each end spends on a request.  An editor that talks to a
shared engine on another machine pays each handshake as a network round trip: one for TCP, one
more for TLS 1.3, before the request itself can travel.  The proxy puts that cost back, so the
transports are compared as a remote editor meets them.

What it emulates: propagation delay, nothing else (no bandwidth limit, no loss, no jitter).
Every chunk arrives half a round trip after the proxy read it, in order; a new connection's first
bytes wait one round trip more, the TCP handshake that ``connect()`` skipped (over a real link
``connect()`` returns after a round trip, so the client's first bytes reach the server one and a
half round trips after it began).  End of stream is forwarded the same way (``shutdown``), and a
connection ends when both directions have.  Queues are unbounded: it is a benchmark fixture for
request/response traffic, not a general proxy.

It runs in its own process (``python -m spark_lsp.bench.link --target HOST:PORT --rtt MS``, which
prints the address it listens on), so its threads do not take the GIL from the client being timed.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit, urlunsplit


class _Direction:
    """One direction of one connection: a reader that stamps each chunk with when it is due on
    the far side, and a writer that sends it then."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float, not_before: float):
        self.src, self.dst, self.delay, self.not_before = src, dst, delay, not_before
        self.chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._write, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        last = 0.0
        while True:
            try:
                data = self.src.recv(1 << 16)
            except OSError:
                data = b""
            due = max(time.monotonic(), self.not_before) + self.delay
            last = due = max(due, last)  # in order, even if the clock's reads were not
            self.chunks.put((due, data))
            if not data:
                return

    def _write(self) -> None:
        while True:
            due, data = self.chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:  # the far side went away: stop reading this side too
                with contextlib.suppress(OSError):
                    self.src.shutdown(socket.SHUT_RD)
                return


def _serve_one(client: socket.socket, target: tuple[str, int], rtt_s: float) -> None:
    accepted = time.monotonic()
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    half = rtt_s / 2
    ways = [
        _Direction(client, upstream, half, accepted + rtt_s),  # after the emulated handshake
        _Direction(upstream, client, half, 0.0),
    ]
    for way in ways:
        for t in way.threads:
            t.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, target: tuple[str, int], rtt_ms: float) -> None:
    """Accept connections on ``listener`` forever, each relayed to ``target`` with ``rtt_ms``."""
    while True:
        client, _ = listener.accept()
        threading.Thread(
            target=_serve_one, args=(client, target, rtt_ms / 1e3), daemon=True
        ).start()


def start(url: str, rtt_ms: float) -> tuple[subprocess.Popen, str]:
    """A link process in front of the server at ``url`` (ws, wss, http or https); returns the
    process and the URL to use instead (same scheme, host and path: only the port differs, so a
    TLS certificate for the host still matches)."""
    parts = urlsplit(url)
    default = 443 if parts.scheme in ("https", "wss") else 80
    host, port = parts.hostname or "127.0.0.1", parts.port or default
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, "--target", f"{host}:{port}", "--rtt", str(rtt_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"the emulated link in front of {url} did not start")
    new_port = int(line.rsplit(":", 1)[1])
    netloc = f"[{host}]:{new_port}" if ":" in host else f"{host}:{new_port}"
    return proc, urlunsplit(parts._replace(netloc=netloc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spark_lsp.bench.link", description=__doc__)
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the server to relay to")
    p.add_argument("--rtt", type=float, required=True, metavar="MS", help="round trip to add, ms")
    args = p.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    host = host.strip("[]")
    listener = socket.create_server(
        (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET
    )
    print(f"{host}:{listener.getsockname()[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        serve(listener, (host, int(port)), args.rtt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
