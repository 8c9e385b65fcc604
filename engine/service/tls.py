"""TLS for the engine service: the SSL contexts of its servers and clients, in one place.

A daemon serving other machines (``--allow-remote``) carries the bearer token and every prompt,
the user's code; with a certificate and its key (``--tls-cert`` / ``--tls-key``) it serves
``wss://`` (and the SSE endpoint ``https://``).  Clients verify the server's certificate against
the system's trust store, plus a CA bundle of their own (``cafile``: a team's private CA, or a
self-signed certificate), with hostname checking on.  Standard library only, so the thin
language server can import it.
"""

from __future__ import annotations

import ssl
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
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"cannot use the certificate {cert_path} with the key {key_path} ({e.reason or e}): "
            "both must be PEM files, the key unencrypted and matching the certificate"
        ) from None
    return ctx


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
