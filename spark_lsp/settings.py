"""Server settings from `initializationOptions` and `workspace/didChangeConfiguration`.

Editors send camelCase JSON, sometimes nested under a "spark" section; every value is validated
here so a typo becomes a message naming the setting instead of a crash deep in a handler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each one."""


@dataclass(frozen=True)
class Settings:
    model: str | None = None           # model folder; None -> the bundled default model
    max_tokens: int = 64               # new tokens for an inline completion
    max_edit_tokens: int = 384         # new tokens for a code-action edit
    temperature: float = 0.0           # 0 = greedy for the first item (extra Invoked items sample)
    context_tokens: int = 1024         # prompt budget for prefix + suffix
    debounce_ms: int = 0               # wait before starting an Automatic completion
    live_edits: bool = True            # stream code-action edits with workspace/applyEdit
    live_edit_hz: float = 20.0         # how often a streamed edit is flushed
    multiline: bool = True             # allow multi-line completions at block openers / empty lines
    speculative: bool = True           # greedy generations use the engine's speculative decoding
    max_lines: int = 12                # cap on lines of a multi-line completion
    load_timeout_s: float = 120.0      # requests wait this long for the model to load
    wafer_chip: str | None = None      # chip name for the projected wafer speed in spark/status
    wafer_grid: tuple[int, int] | None = None  # (rows, cols) of the emulated mesh
    precision: str = "auto"            # weights: auto (stored `spark-lsp tune` decision, else a rule) | fp32 | int8 | int4 | int8-rowq

    def replace(self, **kw: Any) -> "Settings":
        return dataclasses.replace(self, **kw)


# JSON name -> (field, validator)
def _int(lo: int, hi: int):
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise SettingsError(f"setting {name!r} must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise SettingsError(f"setting {name!r} must be between {lo} and {hi}, got {v!r}")
        return int(v)
    return check


def _float(lo: float, hi: float):
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SettingsError(f"setting {name!r} must be a number, got {v!r}")
        if not lo <= v <= hi:
            raise SettingsError(f"setting {name!r} must be between {lo} and {hi}, got {v!r}")
        return float(v)
    return check


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise SettingsError(f"setting {name!r} must be true or false, got {v!r}")
    return v


def _opt_str(name: str, v: Any) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise SettingsError(f"setting {name!r} must be a string, got {v!r}")
    return v


def _grid(name: str, v: Any) -> tuple[int, int] | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):
        parts = v.lower().replace(" ", "").split("x")
        try:
            v = [int(p) for p in parts]
        except ValueError:
            raise SettingsError(f"setting {name!r} must look like '4x4' or [4, 4], got {v!r}") from None
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 4096 for x in v)):
        raise SettingsError(f"setting {name!r} must be two positive integers like [4, 4], got {v!r}")
    return (int(v[0]), int(v[1]))


def _choice(*options: str):
    def check(name: str, v: Any) -> str:
        if v not in options:
            raise SettingsError(f"setting {name!r} must be one of {', '.join(options)}, got {v!r}")
        return v
    return check


_FIELDS = {
    "model": ("model", _opt_str),
    "maxTokens": ("max_tokens", _int(1, 4096)),
    "maxEditTokens": ("max_edit_tokens", _int(1, 8192)),
    "temperature": ("temperature", _float(0.0, 5.0)),
    "contextTokens": ("context_tokens", _int(16, 131072)),
    "debounceMs": ("debounce_ms", _int(0, 10000)),
    "liveEdits": ("live_edits", _bool),
    "liveEditHz": ("live_edit_hz", _float(0.5, 200.0)),
    "multiline": ("multiline", _bool),
    "speculative": ("speculative", _bool),
    "maxLines": ("max_lines", _int(1, 200)),
    "loadTimeoutS": ("load_timeout_s", _float(0.0, 3600.0)),
    "waferChip": ("wafer_chip", _opt_str),
    "waferGrid": ("wafer_grid", _grid),
    "precision": ("precision", _choice("auto", "fp32", "int8", "int4", "int8-rowq")),
}
_SNAKE = {f: (js, check) for js, (f, check) in _FIELDS.items()}


def update(current: Settings, raw: Any) -> tuple[Settings, list[str]]:
    """(settings with the values in `raw` applied, warnings about unknown keys); raises SettingsError
    listing every bad value and leaves `current` untouched. Accepts camelCase or snake_case keys,
    optionally under a "spark" section (then other sections, e.g. an editor's, are ignored)."""
    if raw is None:
        return current, []
    if not isinstance(raw, dict):
        raise SettingsError(f"settings must be a JSON object, got {type(raw).__name__}")
    if "spark" in raw:
        if not isinstance(raw["spark"], dict):
            raise SettingsError(f"settings section 'spark' must be a JSON object, got {raw['spark']!r}")
        raw = raw["spark"]
    changes: dict[str, Any] = {}
    errors: list[str] = []
    unknown: list[str] = []
    for key, value in raw.items():
        if key in _FIELDS:
            fname, check = _FIELDS[key]
            name = key
        elif key in _SNAKE:
            fname, (name, check) = key, _SNAKE[key]
        else:
            unknown.append(key)
            continue
        try:
            changes[fname] = check(name, value)
        except SettingsError as exc:
            errors.append(str(exc))
    if errors:
        raise SettingsError("; ".join(errors))
    warnings = []
    if unknown:
        warnings.append(f"ignored unknown setting(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(_FIELDS)}")
    return current.replace(**changes), warnings


def to_json(s: Settings) -> dict[str, Any]:
    """The settings as the camelCase JSON an editor would send."""
    out = {}
    for js, (f, _) in _FIELDS.items():
        v = getattr(s, f)
        out[js] = list(v) if isinstance(v, tuple) else v
    return out
