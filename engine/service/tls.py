"""TLS for the engine service: the SSL contexts of its servers and clients, in one place.

A daemon serving other machines (``--allow-remote``) carries the bearer token and every prompt,
the user's code; with a certificate and its key (``--tls-cert`` / ``--tls-key``) it serves
``wss://`` (and the SSE endpoint ``https://``).  Clients verify the server's certificate against
the system's trust store, plus a CA bundle of their own (``cafile``: a team's private CA, or a
self-signed certificate), with hostname checking on.  A server logs the clients that fail its
handshake (``FailedHandshakes``).  Standard library only, so the thin language server can
import it.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from pathlib import Path

#: Environment variable naming a CA bundle (PEM) that the language server trusts for ``wss://``.
CA_ENV = "SPARK_LSP_ENGINE_CA"
_PEM_BEGIN = "-----BEGIN CERTIFICATE-----"
_PEM_END = "-----END CERTIFICATE-----"


class TLSConfigError(ValueError):
    """A certificate, key or CA bundle that cannot be used (missing, unreadable, not matching)."""


def _readable(path: str | Path, what: str) -> str:
    p = Path(path).expanduser()
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise TLSConfigError(f"{what} {p}: {e.strerror or e}") from None
    return str(p)


def server_context_for(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server context of ``--tls-cert`` / ``--tls-key``: None when neither is given, a
    TLSConfigError when only one is (or either cannot be used)."""
    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise TLSConfigError(f"{given} needs {missing} too (the certificate and its private key)")
    return server_context(cert, key) if cert and key else None


def server_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server context from a PEM certificate (chain) and its private key; TLS 1.2 or later."""
    cert_path = _readable(cert, "certificate")
    key_path = _readable(key, "private key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # no TLS 1.3 session tickets: every client keeps one connection and never resumes one, and
    # a ticket arriving while a threaded client writes its first request makes that client use
    # its TLS connection from two threads at once (engine.service.direct)
    ctx.num_tickets = 0
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"cannot use the certificate {cert_path} with the key {key_path} ({e.reason or e}): "
            "both must be PEM files, the key unencrypted and matching the certificate"
        ) from None
    return ctx


class FailedHandshakes:
    """A server's log of the TLS handshakes that failed, one line each with the peer and the
    reason (a client that does not trust the certificate, plain HTTP or ``ws://`` to a TLS port,
    a port scanner): the TLS layer drops them, and without this nothing says why a client
    cannot connect.  At most ``limit`` lines per ``window_s``; past that they are counted, and
    one line at the window's end says how many were not logged, so a scanner cannot flood the
    log.

    ``watch(ctx)`` makes every socket ``ctx`` wraps report here (its ``sslsocket_class``): the
    hook sits on the handshake itself, whoever calls it (the websockets server on the
    connection's thread, ``http.server`` through ``wrap_socket``)."""

    #: Failed handshakes logged one by one per window.
    LIMIT = 10
    #: The window, seconds.
    WINDOW_S = 60.0

    def __init__(
        self,
        log: logging.Logger,
        what: str = "engine",
        *,
        limit: int = LIMIT,
        window_s: float = WINDOW_S,
        clock=time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._start = -float("inf")  # when the window began
        self._count = 0  # failures in the window
        self._unlogged = 0  # of them, not logged one by one
        self._timer: threading.Timer | None = None

    def watch(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        """Report the failed handshakes of the sockets ``ctx`` wraps from now on (a server
        context is its server's own: another watch on it takes its reports)."""
        failures = self

        class _Watched(ssl.SSLSocket):
            def do_handshake(self, block: bool = False) -> None:
                try:
                    peer = self.getpeername()
                except OSError:  # gone already
                    peer = None
                try:
                    super().do_handshake(block)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    raise  # a non-blocking socket: not a failure
                except OSError as e:  # ssl.SSLError, a reset, the handshake timeout
                    failures.failed(peer, e)
                    raise

        ctx.sslsocket_class = _Watched
        return ctx

    def failed(self, peer: object, exc: BaseException) -> None:
        """Log (or count) one failed handshake with ``peer`` (an address tuple, or None)."""
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        with self._lock:
            now = self._clock()
            if now - self._start >= self.window_s:
                self._summarise()
                self._start, self._count = now, 0
            self._count += 1
            if self._count <= self.limit:
                self.log.warning(
                    "%s: TLS handshake with %s failed: %s", self.what, where, handshake_error(exc)
                )
                return
            self._unlogged += 1
            if self._timer is None:  # the summary at the window's end
                self._timer = threading.Timer(self._start + self.window_s - now, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Log how many failures were not logged one by one, if any (the window's end)."""
        with self._lock:
            self._summarise()

    def _summarise(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._unlogged:
            self.log.warning(
                "%s: %d more TLS handshakes failed within %.0f s (not logged one by one: at most "
                "%d are)",
                self.what,
                self._unlogged,
                self.window_s,
                self.limit,
            )
            self._unlogged = 0


def handshake_error(exc: BaseException) -> str:
    """Why a server's TLS handshake failed, in a few words: OpenSSL's reason (``http request``:
    plain HTTP or ``ws://`` to the TLS port; ``tlsv1 alert unknown ca``: the client does not trust
    the certificate), or the socket's error (``timed out``, ``connection reset by peer``)."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def client_context(cafile: str | Path | None = None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and hostname against the
    system's trust store and, if given, the CA bundle ``cafile`` (PEM)."""
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cafile:
        path = _readable(cafile, "CA bundle")
        try:
            ctx.load_verify_locations(cafile=path)
        except ssl.SSLError as e:
            raise TLSConfigError(
                f"CA bundle {path}: not a PEM certificate ({e.reason or e})"
            ) from None
    return ctx


def pinned_context(cert: str | Path) -> ssl.SSLContext:
    """A client context that trusts exactly the certificate ``cert`` (PEM), whatever host name
    it names: for a daemon found through the user's own private record, which names the
    certificate the daemon serves (its URL is its bind address, e.g. ``0.0.0.0``, which no
    certificate names).  The server must still prove it holds that certificate's key."""
    path = _readable(cert, "certificate")
    # only the file's first certificate, the daemon's own: were the chain behind it (its CA)
    # an anchor too, any certificate that CA signs would pass, with no host name to check
    text = Path(path).read_text(encoding="ascii", errors="replace")
    begin = text.find(_PEM_BEGIN)
    end = text.find(_PEM_END, begin)
    if begin < 0 or end < 0:
        raise TLSConfigError(f"certificate {path}: no PEM certificate in it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # the pinned certificate authenticates the server
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf (not only a CA) as the anchor
    try:
        ctx.load_verify_locations(cadata=text[begin : end + len(_PEM_END)])
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"certificate {path}: not a PEM certificate ({e.reason or e})"
        ) from None
    return ctx


def is_secure(url: str) -> bool:
    """Whether ``url`` asks for TLS (``wss://``, ``https://``)."""
    return url.lower().startswith(("wss://", "https://"))


def failure(url: str, exc: BaseException) -> str | None:
    """What a TLS failure while connecting to ``url`` means, for the user; None if ``exc`` is
    not one."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or str(exc)
        return (
            f"the engine service at {url} presented a certificate that could not be verified "
            f"({why}); if a private CA or a self-signed certificate signs it, give its PEM file "
            f"in ${CA_ENV} (the language server) or as cafile (the client library)"
        )
    if isinstance(exc, ssl.SSLError) or (is_secure(url) and isinstance(exc, ConnectionResetError)):
        # a server without TLS reads the ClientHello as garbage and drops the connection
        why = getattr(exc, "reason", None) or str(exc) or "the connection was reset"
        return (
            f"TLS handshake with the engine service at {url} failed ({why}); "
            "does it serve wss:// (spark-lsp engine serve --tls-cert/--tls-key)?"
        )
    return None
