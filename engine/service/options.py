"""The engine daemon's command-line options, apart from the daemon so that declaring them (every
`spark-lsp` start builds the whole parser) loads neither the engine nor ONNX Runtime."""

from __future__ import annotations

import argparse

from .address import host_port

#: KV slots per model (documents kept warm) unless ``--slots`` says otherwise.
DEFAULT_SLOTS = 8
#: ``--spinning`` values -> ``Engine.load(spinning=...)``.
SPINNING = {"off": False, "on": True, "auto": None}
#: The daemon's and the Ray replicas' ``--spinning`` (the in-process engine's default is auto).
DEFAULT_SPINNING = "off"


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0 (`--idle-exit -1` exited at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ws",
        metavar="HOST:PORT",
        type=host_port,
        default=("127.0.0.1", 0),
        help="where to listen (default 127.0.0.1 and a free port; the URL goes to the record)",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        action="append",
        default=[],
        help="a model to serve: a folder, a .gguf file, a catalogue name or hf:ORG/REPO "
        "(downloaded on first use, as `serve --model`); repeat for several (default: the "
        "bundled model)",
    )
    p.add_argument(
        "--slots", type=int, default=DEFAULT_SLOTS, help="KV slots per model (documents kept warm)"
    )
    p.add_argument(
        "--precision",
        default="auto",
        help="weight precision: auto (default, as `spark-lsp serve`: the decision `spark-lsp tune` "
        "stored, else the engine's rule), fp32, int8, int8-rowq, int4",
    )
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads per model")
    p.add_argument(
        "--spinning",
        choices=sorted(SPINNING),
        default=DEFAULT_SPINNING,
        help="ONNX Runtime threads spin between steps: off (default: the threads that read "
        "the socket and write the tokens need the cores between steps), on, or auto (while the "
        "CPU is calm, as in-process); for the daemon and for --ray replicas",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --ws address (clients need the token)",
    )
    p.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve wss:// with this certificate (chain, PEM); needs --tls-key",
    )
    p.add_argument(
        "--tls-key",
        metavar="PEM",
        help="the private key (PEM, unencrypted) of --tls-cert",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="read the access token from FILE (default: a new random token in the record)",
    )
    p.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="accept browser connections from this Origin (default: none)",
    )
    p.add_argument(
        "--idle-exit",
        metavar="SECONDS",
        type=positive_seconds,
        default=None,
        help="exit after this long without a client",
    )
    p.add_argument("--log-file", metavar="FILE", help="write the log here (default: stderr)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
