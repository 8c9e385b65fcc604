"""Listening addresses, shared by the engine daemon and the language server's network transports:
`HOST:PORT` parsing for the command line, and whether a host is loopback (a bind beyond it needs
an explicit flag)."""

from __future__ import annotations

import argparse
import ipaddress
import socket


def host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (host 127.0.0.1); IPv6 hosts may be bracketed (``[::1]:2088``)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    try:
        p = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or PORT, got {value!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port {p} is outside 0..65535")
    return (host.strip("[]") or "127.0.0.1"), p


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (a name is resolved)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos
    )
