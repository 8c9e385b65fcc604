"""The engine service's wire protocol: JSON text messages over one WebSocket.

This module only parses and builds messages (no I/O), so the daemon, the Ray Serve ingress and
the client share one definition of the protocol.  docs/engine-protocol.md is its reference.

Every message is a JSON object with a ``type``.  Client → server: ``hello``, ``generate``,
``cancel``, ``steer``, ``status``, ``model_files``.  Server → client: ``hello``, ``tokens``,
``done``, ``steer``, ``status``, ``model_file``, ``model_files``, ``error``.  A bad message is answered with an ``error`` carrying a code; the socket
stays open.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .. import wire_text
from ..params import GenerationParams

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

#: Messages larger than this are refused with ``error`` code ``too_large`` (the socket stays open).
MAX_MESSAGE_BYTES = 1 << 20
#: Frames larger than this are not even read: the socket is closed with 1009 (message too big).
MAX_FRAME_BYTES = 16 << 20
#: The WebSocket options of every endpoint and client of the service: no compression (small JSON
#: frames: deflate costs latency and buys nothing), frames up to MAX_FRAME_BYTES, a ping every
#: 20 s that must be answered within 60, 2 s for the closing handshake.
SOCKET_OPTIONS = {
    "compression": None,
    "max_size": MAX_FRAME_BYTES,
    "ping_interval": 20,
    "ping_timeout": 60,
    "close_timeout": 2,
}
#: Longest generation id / slot key accepted.
MAX_ID_CHARS = 256
#: Longest steer text in one message.
MAX_STEER_CHARS = 1 << 16
#: Prompts of a connection's most recent generations kept as bases for prompt deltas.
PROMPT_MEMORY = 64

# Error codes (stable: clients branch on them).
BAD_JSON = "bad_json"
BAD_MESSAGE = "bad_message"
UNKNOWN_TYPE = "unknown_type"
HELLO_REQUIRED = "hello_required"
UNSUPPORTED_VERSION = "unsupported_version"
BAD_PARAMS = "bad_params"
UNKNOWN_MODEL = "unknown_model"
DUPLICATE_ID = "duplicate_id"
TOO_LARGE = "too_large"
TOO_MANY = "too_many_generations"
BAD_PROMPT = "bad_prompt"
ENGINE_ERROR = "engine_error"
SHUTTING_DOWN = "shutting_down"
UNAVAILABLE = "unavailable"
UNKNOWN_BASE = "unknown_base"

# Steer states and outcomes (docs/engine-protocol.md, "Steering").
ACCEPTED = "accepted"
COMMITTED = "committed"
FAILED = "failed"
CONTINUED = "continued"
STOPPED = "stopped"

#: Generation parameters a client may set; the rest of GenerationParams stays at its default.
PARAM_NAMES = tuple(f.name for f in fields(GenerationParams))


class ProtocolError(Exception):
    """A message the server (or client) refuses: becomes an ``error`` message with ``code``."""

    def __init__(self, code: str, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id


@dataclass(frozen=True)
class Hello:
    versions: tuple[int, ...]
    client: str
    cancel_flags: bool = False  # asks for shared cancel flags (a client on the same machine)


@dataclass(frozen=True)
class PromptDelta:
    """A prompt given as an edit of an earlier prompt on the same connection: the first ``head``
    tokens of generation ``base``'s prompt, then ``ids``, then its last ``tail`` tokens."""

    base: str
    head: int
    ids: list[int]
    tail: int

    def apply(self, base: Sequence[int]) -> list[int] | array:
        """The whole prompt, from the base prompt's ids (ValueError when they do not fit): an
        ``array('i')`` from an array base (a server keeps its prompts so: the copies are
        memcpy), else a list."""
        if self.head + self.tail > len(base):
            raise ValueError(
                f"prompt delta keeps {self.head} + {self.tail} tokens of a {len(base)}-token base"
            )
        if isinstance(base, array):
            out: list[int] | array = base[: self.head]
            out += array("i", self.ids)
        else:
            out = list(base[: self.head])
            out += self.ids
        if self.tail:
            out += base[len(base) - self.tail :]
        return out


def prompt_delta(
    base: Sequence[int], ids: Sequence[int], packed: tuple[bytes, bytes] | None = None
) -> tuple[int, list[int], int]:
    """(head, middle, tail): ``ids`` as ``base[:head] + middle + base[-tail:]``, keeping the
    longest common prefix and then the longest common suffix of what remains.  ``packed``: both
    as ``pack_ids`` bytes, when the caller has them (a client keeps its last prompts so)."""
    n = min(len(base), len(ids))
    a, b = packed if packed is not None else (pack_ids(base), pack_ids(ids))
    if a is None or b is None:  # ids beyond 32 bits: the server refuses them anyway
        head = _common(lambda k: base[:k] == ids[:k], n)
        tail = _common(lambda k: base[len(base) - k :] == ids[len(ids) - k :], n - head)
    else:  # slices of bytes compare with memcmp: the search costs a few microseconds
        head = _common(lambda k: a[: 4 * k] == b[: 4 * k], n)
        tail = _common(lambda k: a[len(a) - 4 * k :] == b[len(b) - 4 * k :], n - head)
    return head, list(ids[head : len(ids) - tail]), tail


def pack_ids(ids: Sequence[int]) -> bytes | None:
    """Token ids as 32-bit machine integers (None if one does not fit): what ``prompt_delta``
    compares."""
    try:
        return array("i", ids).tobytes()
    except (OverflowError, TypeError):
        return None


def _common(equal, n: int) -> int:
    """The largest k <= n with equal(k) (equal is monotone: true up to some k, then false);
    binary search over slice comparisons, which run in C."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if equal(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Generate:
    id: str
    model: str | None
    slot: str | None
    prompt: str | list[int] | PromptDelta
    params: GenerationParams
    cancel_flag: int | None = None  # the client's shared cancel flag for it, if any


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Steer:
    id: str
    text: str
    steer: str | None


@dataclass(frozen=True)
class Status:
    id: str | None


@dataclass(frozen=True)
class ModelFiles:
    """A request for a model's prompt files (``engine.service.model_files``)."""

    id: str
    model: str | None


def encode(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)


def decode(raw: str | bytes) -> dict[str, Any]:
    """A received frame as a message object; ProtocolError for anything that is not one."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(TOO_LARGE, f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(BAD_JSON, f"not JSON: {e}") from None
    if wire_text.may_hold_surrogates(raw):  # a lone one is no text to tokenize or send back
        msg = wire_text.clean(msg)
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_MESSAGE, "a message must be a JSON object")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(BAD_MESSAGE, "a message needs a string 'type'", _id_of(msg))
    return msg


def _id_of(msg: dict[str, Any]) -> str | None:
    v = msg.get("id")
    return v if isinstance(v, str) and len(v) <= MAX_ID_CHARS else None


def _req_id(msg: dict[str, Any]) -> str:
    v = msg.get("id")
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        raise ProtocolError(
            BAD_MESSAGE, f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters"
        )
    return v


def parse(msg: dict[str, Any]) -> Hello | Generate | Cancel | Steer | Status | ModelFiles:
    """A decoded client message as its typed form; ProtocolError when it is malformed."""
    kind = msg["type"]
    if kind == "hello":
        v = msg.get("protocol", PROTOCOL_VERSION)
        versions = tuple(v) if isinstance(v, list) else (v,)
        if not versions or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in versions
        ):
            raise ProtocolError(BAD_MESSAGE, "'protocol' must be an integer or a list of integers")
        client = msg.get("client", "")
        return Hello(
            versions, client if isinstance(client, str) else "", msg.get("cancel_flags") is True
        )
    if kind == "generate":
        gid = _req_id(msg)
        try:
            return Generate(
                gid,
                _opt_str(msg, "model"),
                _opt_str(msg, "slot"),
                _prompt(msg),
                params_from_json(msg.get("params")),
                _cancel_flag(msg),
            )
        except ProtocolError as e:
            e.id = gid
            raise
    if kind == "cancel":
        return Cancel(_req_id(msg))
    if kind == "steer":
        gid = _req_id(msg)
        text = msg.get("text")
        if not isinstance(text, str) or len(text) > MAX_STEER_CHARS:
            raise ProtocolError(
                BAD_MESSAGE,
                f"steer 'text' must be a string of at most {MAX_STEER_CHARS} characters",
                gid,
            )
        sid = msg.get("steer")
        if sid is not None and (not isinstance(sid, str) or len(sid) > MAX_ID_CHARS):
            raise ProtocolError(BAD_MESSAGE, "steer 'steer' must be a short string", gid)
        return Steer(gid, text, sid)
    if kind == "status":
        return Status(_id_of(msg))
    if kind == "model_files":
        gid = _req_id(msg)
        try:
            return ModelFiles(gid, _opt_str(msg, "model"))
        except ProtocolError as e:
            e.id = gid
            raise
    raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {kind!r}", _id_of(msg))


def _cancel_flag(msg: dict[str, Any]) -> int | None:
    v = msg.get("cancel_flag")
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError(BAD_MESSAGE, "'cancel_flag' must be a non-negative integer")
    return v


def _opt_str(msg: dict[str, Any], key: str) -> str | None:
    v = msg.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > MAX_ID_CHARS:
        raise ProtocolError(
            BAD_MESSAGE, f"{key!r} must be a string of at most {MAX_ID_CHARS} characters"
        )
    return v


def is_ids(v: Any) -> bool:
    """A JSON list of integers (not booleans); the type set is built in C, not per element."""
    return isinstance(v, list) and set(map(type, v)) <= {int}


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _prompt(msg: dict[str, Any]) -> str | list[int] | PromptDelta:
    p = msg.get("prompt")
    if isinstance(p, str) or is_ids(p):
        return p
    if isinstance(p, dict):
        base, head, ids, tail = p.get("base"), p.get("head", 0), p.get("ids", []), p.get("tail", 0)
        if (
            isinstance(base, str)
            and 0 < len(base) <= MAX_ID_CHARS
            and _count(head)
            and _count(tail)
            and is_ids(ids)
            and set(p) <= {"base", "head", "ids", "tail"}
        ):
            return PromptDelta(base, head, ids, tail)
        raise ProtocolError(
            BAD_PROMPT,
            "a prompt delta is {'base': generation id, 'head': n, 'ids': [token ids], 'tail': n}",
        )
    raise ProtocolError(BAD_PROMPT, "'prompt' must be text, a list of token ids or a prompt delta")


def params_from_json(raw: Any) -> GenerationParams:
    """GenerationParams from the ``params`` object (unknown names are refused, not ignored)."""
    if raw is None:
        return GenerationParams()
    if not isinstance(raw, dict):
        raise ProtocolError(BAD_PARAMS, "'params' must be an object")
    unknown = sorted(set(raw) - set(PARAM_NAMES))
    if unknown:
        raise ProtocolError(
            BAD_PARAMS, f"unknown generation parameter(s) {unknown}; known: {list(PARAM_NAMES)}"
        )
    kw = dict(raw)
    for key in ("stop", "stop_ids"):
        if key in kw and kw[key] is not None and not isinstance(kw[key], (list, str)):
            raise ProtocolError(BAD_PARAMS, f"{key!r} must be a list")
    if isinstance(kw.get("stop"), list):
        kw["stop"] = tuple(kw["stop"])
    if isinstance(kw.get("stop_ids"), list):
        kw["stop_ids"] = (
            frozenset(kw["stop_ids"])
            if all(isinstance(i, int) for i in kw["stop_ids"])
            else kw["stop_ids"]
        )
    try:
        return GenerationParams(**kw)
    except (TypeError, ValueError) as e:
        raise ProtocolError(BAD_PARAMS, str(e)) from None


def params_to_json(params: GenerationParams) -> dict[str, Any]:
    """The ``params`` object for a GenerationParams (only the fields that differ from the default)."""
    default = GenerationParams()
    out: dict[str, Any] = {}
    for name in PARAM_NAMES:
        v = getattr(params, name)
        if v == getattr(default, name):
            continue
        out[name] = (
            sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v
        )
    return out


# -- server → client messages ---------------------------------------------------------------------
def error(code: str, message: str, id: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if id is not None:
        msg["id"] = id
    return msg


#: The stats a daemon's first ``tokens`` message of a generation carries (the rest come with
#: ``done``): a client reports prefix reuse and TTFT without waiting for the end.
EARLY_STATS = ("prompt_tokens", "reused_tokens", "ttft_ms")


def early_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``EARLY_STATS`` of a generation's stats (a copy: the generation goes on)."""
    return {k: stats[k] for k in EARLY_STATS if k in stats}


def tokens(id: str, text: str, ids: list[int]) -> dict[str, Any]:
    return {"type": "tokens", "id": id, "text": text, "ids": ids}


def done(
    id: str,
    finish_reason: str,
    stats: dict[str, Any],
    *,
    successor: str | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "done", "id": id, "finish_reason": finish_reason, "stats": stats}
    if successor is not None:
        msg["successor"] = successor
    if error is not None:
        msg["error"] = error
    return msg


def steer_event(id: str, steer: str | None, state: str, **extra: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "steer", "id": id, "steer": steer, "state": state}
    msg.update(extra)
    return msg
