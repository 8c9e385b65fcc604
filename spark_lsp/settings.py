"""Server settings, declared once: each field of `Settings` carries its editor-facing declaration.

From the one declaration come the validation of what editors send (`update`: camelCase or
snake_case keys, optionally under a "spark" section, every bad value named), the JSON schema of
`initializationOptions`, the VS Code `contributes.configuration` entries and the keys its client
forwards, and the Neovim plugin's table of server settings. `python -m spark_lsp.editor_settings
--write` regenerates those files; a test fails when they disagree with this module, so adding a
setting is one field here plus that command.

attrs rather than dataclasses: pygls already depends on it, and `attrs.fields` with field metadata
and `attrs.evolve` give the declaration and the frozen value in one class. The checks are our own
(a few lines per kind) rather than cattrs', whose structuring errors do not name the camelCase
setting the user typed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each one."""


def _precisions() -> tuple[str, ...]:
    """'auto' and the precisions the engine loads (named once, in engine.params)."""
    from engine.params import PRECISIONS

    return ("auto", *PRECISIONS)


def _fim_formats() -> tuple[str, ...]:
    """'auto' and the FIM families the engine knows (named once, in engine.fim)."""
    from engine.fim import STYLES

    return ("auto", *STYLES)


@attrs.frozen
class Spec:
    """How a setting looks to editors; `kind`: integer|number|boolean|string|choice|grid."""

    kind: str
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: Callable[[], tuple[str, ...]] | None = None
    renamed_from: str | None = None  # an older JSON name still accepted, with a warning


#: minConfidence's default, chosen from `spark-lsp eval`'s gate table on the bundled model's held-out
#: files (docs/suggestions.md): it hides the suggestions least likely to be right, few of which are
DEFAULT_MIN_CONFIDENCE = 1e-6


def setting(default: Any, kind: str, doc: str, **spec: Any) -> Any:
    return attrs.field(default=default, metadata={"spark": Spec(kind, doc, **spec)})


@attrs.frozen
class Settings:
    model: str | None = setting(
        None,
        "string",
        "Model: a folder, a .gguf file, a catalogue name (`spark-lsp models list`) or "
        "hf:ORG/REPO[:FILE.gguf], downloaded on first use. Empty: the bundled default model "
        "(with `engine` a ws:// URL: the service's first model; a name chooses another).",
    )
    max_tokens: int = setting(
        64, "integer", "New tokens for an inline suggestion.", minimum=1, maximum=4096
    )
    max_edit_tokens: int = setting(
        384, "integer", "New tokens for a code-action edit.", minimum=1, maximum=8192
    )
    temperature: float = setting(
        0.0, "number", "Sampling temperature (0 = greedy).", minimum=0.0, maximum=5.0
    )
    context_tokens: int = setting(
        1024,
        "integer",
        "Prompt budget (tokens of text before + after the cursor).",
        minimum=16,
        maximum=131072,
    )
    debounce_ms: int = setting(
        0,
        "integer",
        "Server-side wait before an automatic suggestion starts.",
        minimum=0,
        maximum=10000,
    )
    answer_ms: int = setting(
        100,
        "integer",
        "An automatic suggestion is answered as soon as its first line is complete, or at the "
        "latest this many milliseconds after the request with the whole words written so far; "
        "the model goes on writing, and typing along with the suggestion (or accepting it) gets "
        "the rest. 0: answer only whole suggestions.",
        minimum=0,
        maximum=60000,
    )
    live_edits: bool = setting(
        True,
        "boolean",
        "Stream code-action edits into the document as they are generated (typing stops them).",
    )
    live_edit_hz: float = setting(
        20.0,
        "number",
        "How often a live edit is flushed into the document (per second).",
        minimum=0.5,
        maximum=200.0,
    )
    multiline: bool = setting(
        True, "boolean", "Allow multi-line suggestions at block openers and empty lines."
    )
    speculative: bool = setting(
        True,
        "boolean",
        "Greedy generations use the engine's speculative decoding (same output, faster).",
    )
    max_lines: int = setting(
        12, "integer", "Maximum lines of a multi-line suggestion.", minimum=1, maximum=200
    )
    min_confidence: float = setting(
        DEFAULT_MIN_CONFIDENCE,
        "number",
        "Hide an automatic suggestion the model is less sure of than this: the probability it "
        "gave the suggestion's first line (0 shows every suggestion). Suggestions asked for "
        "(Invoked) are always shown.",
        minimum=0.0,
        maximum=1.0,
    )
    load_timeout_s: float = setting(
        120.0,
        "number",
        "How long requests wait for the model to load (seconds).",
        minimum=0.0,
        maximum=3600.0,
    )
    wafer_chip: str | None = setting(
        None, "string", "Chip of the projected wafer speed in the status bar (empty: wse3)."
    )
    wafer_region: tuple[int, int] | None = setting(
        None,
        "grid",
        'Region of PEs per layer for the projected wafer speed, e.g. "4x4" (empty: the fastest).',
        renamed_from="waferGrid",
    )
    precision: str = setting(
        "auto",
        "choice",
        "Weight precision; auto: the decision `spark-lsp tune` stored, else the engine's rule.",
        choices=_precisions,
    )
    tune_precision: bool = setting(
        True,
        "boolean",
        "With precision auto and no stored decision, measure one after loading in a low-priority"
        " background process (spark-lsp tune); it applies from the next load.",
    )

    neighbour_tokens: int = setting(
        0,
        "integer",
        "Prompt tokens for chunks of the other open and recently edited files (0: none), in the "
        "model's repository format.",
        minimum=0,
        maximum=32768,
    )
    fim_format: str = setting(
        "auto",
        "choice",
        "Fill-in-the-middle prompt format; auto: detected from the model's tokenizer.",
        choices=_fim_formats,
    )

    engine: str = setting(
        "local",
        "string",
        "Where the engine runs when backend is local: local (in this server), auto (your shared "
        "engine daemon for this model, started when none runs: editor windows share one model) "
        "or ws://HOST:PORT / wss://HOST:PORT (a given `spark-lsp engine serve` daemon or Ray "
        "Serve deployment; wss:// certificates are verified, a private CA's bundle named by "
        "SPARK_LSP_ENGINE_CA). See docs/service.md.",
    )
    backend: str = setting(
        "local",
        "choice",
        "Where suggestions are generated: the in-process engine (local), a llama.cpp server "
        "(llamacpp), Ollama (ollama) or an OpenAI-compatible server such as vLLM, SGLang, TGI or "
        "LM Studio (openai). See docs/backends.md.",
        choices=lambda: ("local", "llamacpp", "ollama", "openai"),
    )
    backend_url: str | None = setting(
        None,
        "string",
        "Base URL of the remote backend, e.g. http://127.0.0.1:8080 (empty: its usual local port).",
    )
    backend_model: str | None = setting(
        None,
        "string",
        "Model name on the remote backend (Ollama, OpenAI-compatible servers), "
        "e.g. qwen2.5-coder:1.5b-base.",
    )
    backend_api_key_env: str | None = setting(
        None, "string", "Environment variable holding the remote backend's API key (never logged)."
    )
    backend_api_key_file: str | None = setting(
        None,
        "string",
        "File holding the remote backend's API key on its first line (never logged).",
    )
    backend_timeout_s: float = setting(
        30.0,
        "number",
        "A remote request with no answer for this many seconds fails.",
        minimum=0.1,
        maximum=3600.0,
    )
    fim_template: str | None = setting(
        None,
        "string",
        "FIM prompt layout for remote backends: empty (the fimFormat family, else the one the model "
        "name suggests), suffix (the server's suffix parameter), a family, or a custom layout with "
        "{prefix} and {suffix}.",
    )

    def replace(self, **kw: Any) -> Settings:
        return attrs.evolve(self, **kw)


def json_name(field_name: str) -> str:
    """The camelCase name editors use: max_tokens -> maxTokens, load_timeout_s -> loadTimeoutS."""
    head, *rest = field_name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def declarations() -> list[tuple[str, str, Any, Spec]]:
    """(JSON name, field name, default, Spec) of every setting, in declaration order."""
    return [
        (json_name(f.name), f.name, f.default, f.metadata["spark"]) for f in attrs.fields(Settings)
    ]


# -- validation ----------------------------------------------------------------------------------
def _number(name: str, v: Any, spec: Spec, integer: bool) -> int | float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and int(v) != v):
        raise SettingsError(
            f"setting {name!r} must be {'an integer' if integer else 'a number'}, got {v!r}"
        )
    if not spec.minimum <= v <= spec.maximum:
        lo, hi = (int(spec.minimum), int(spec.maximum)) if integer else (spec.minimum, spec.maximum)
        raise SettingsError(f"setting {name!r} must be between {lo} and {hi}, got {v!r}")
    return int(v) if integer else float(v)


def _grid(name: str, v: Any) -> tuple[int, int] | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):
        try:
            v = [int(p) for p in v.lower().replace(" ", "").split("x")]
        except ValueError:
            raise SettingsError(
                f"setting {name!r} must look like '4x4' or [4, 4], got {v!r}"
            ) from None
    if (
        not isinstance(v, (list, tuple))
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 4096 for x in v)
    ):
        raise SettingsError(
            f"setting {name!r} must be two positive integers like [4, 4], got {v!r}"
        )
    return (int(v[0]), int(v[1]))


def check(name: str, v: Any, spec: Spec) -> Any:
    """The value of setting `name` (its JSON name) from what an editor sent, or SettingsError."""
    if spec.kind in ("integer", "number"):
        return _number(name, v, spec, spec.kind == "integer")
    if spec.kind == "boolean":
        if not isinstance(v, bool):
            raise SettingsError(f"setting {name!r} must be true or false, got {v!r}")
        return v
    if spec.kind == "string":
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise SettingsError(f"setting {name!r} must be a string, got {v!r}")
        return v
    if spec.kind == "choice":
        options = spec.choices()
        if v not in options:
            raise SettingsError(f"setting {name!r} must be one of {', '.join(options)}, got {v!r}")
        return v
    return _grid(name, v)


def _lookup() -> dict[str, tuple[str, str, Spec]]:
    """Every accepted key -> (JSON name, field name, Spec): camelCase, snake_case, former names."""
    out = {}
    for js, fname, _, spec in declarations():
        out[js] = out[fname] = (js, fname, spec)
        if spec.renamed_from:
            out[spec.renamed_from] = (js, fname, spec)
    return out


def update(current: Settings, raw: Any, trusted: bool = True) -> tuple[Settings, list[str]]:
    """(settings with the values in `raw` applied, warnings about unknown or renamed keys); raises
    SettingsError listing every bad value and leaves `current` untouched. Accepts camelCase or
    snake_case keys, optionally under a "spark" section (then other sections are ignored).
    An untrusted client (a network session, not the editor that started the server) may not
    change the model folder or name a chip spec file: either would make the server read files."""
    if raw is None:
        return current, []
    if not isinstance(raw, dict):
        raise SettingsError(f"settings must be a JSON object, got {type(raw).__name__}")
    if "spark" in raw:
        if not isinstance(raw["spark"], dict):
            raise SettingsError(
                f"settings section 'spark' must be a JSON object, got {raw['spark']!r}"
            )
        raw = raw["spark"]
    known = _lookup()
    changes: dict[str, Any] = {}
    errors: list[str] = []
    warnings: list[str] = []
    unknown: list[str] = []
    for key, value in raw.items():
        if key not in known:
            unknown.append(key)
            continue
        js, fname, spec = known[key]
        if key == spec.renamed_from:
            warnings.append(f"setting {key!r} is now called {js!r}")
        try:
            changes[fname] = check(key if key == spec.renamed_from else js, value, spec)
        except SettingsError as exc:
            errors.append(str(exc))
    if not trusted:
        errors.extend(_untrusted(current, changes))
    if errors:
        raise SettingsError("; ".join(errors))
    if unknown:
        names = ", ".join(js for js, *_ in declarations())
        warnings.append(
            f"ignored unknown setting(s) {', '.join(map(repr, unknown))}; known: {names}"
        )
    return current.replace(**changes), warnings


def _untrusted(current: Settings, changes: dict[str, Any]) -> list[str]:
    """What a network client may not change: the model folder, and chip specs read from files."""
    errors = []
    if "model" in changes and changes["model"] != current.model:
        errors.append(
            "setting 'model' cannot be changed over a network connection "
            "(start the server with --model)"
        )
    if "engine" in changes and changes["engine"] != current.engine:
        errors.append(
            "setting 'engine' cannot be changed over a network connection "
            "(start the server with --engine)"
        )
    chip = changes.get("wafer_chip")
    if chip is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", chip):
        errors.append(
            f"setting 'waferChip' must name a built-in chip over a network connection, got {chip!r}"
        )
    return errors


def to_json(s: Settings) -> dict[str, Any]:
    """The settings as the camelCase JSON an editor would send."""
    out = {}
    for js, fname, _, _ in declarations():
        v = getattr(s, fname)
        out[js] = list(v) if isinstance(v, tuple) else v
    return out


# -- what editors are told -----------------------------------------------------------------------
def json_schema_of(spec: Spec, default: Any) -> dict[str, Any]:
    """The JSON schema of one setting's value."""
    if spec.kind in ("integer", "number"):
        out = {
            "type": spec.kind,
            "default": default,
            "minimum": spec.minimum,
            "maximum": spec.maximum,
        }
        return (
            out
            if spec.kind == "number"
            else {**out, "minimum": int(spec.minimum), "maximum": int(spec.maximum)}
        )
    if spec.kind == "boolean":
        return {"type": "boolean", "default": default}
    if spec.kind == "choice":
        return {"type": "string", "enum": list(spec.choices()), "default": default}
    if spec.kind == "grid":
        pair = {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 4096},
            "minItems": 2,
            "maxItems": 2,
        }
        return {
            "oneOf": [
                {"type": "string", "pattern": r"^\s*\d+\s*[xX]\s*\d+\s*$"},
                pair,
                {"type": "null"},
            ],
            "default": None,
        }
    return {"type": ["string", "null"], "default": default}


def json_schema() -> dict[str, Any]:
    """The JSON schema of `initializationOptions` (and of workspace/didChangeConfiguration)."""
    props = {
        js: {**json_schema_of(spec, default), "description": spec.doc}
        for js, _, default, spec in declarations()
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "spark-lsp settings",
        "type": "object",
        "description": 'Also accepted: snake_case names, and the same object under a "spark" key.',
        "properties": {**props, "spark": {"$ref": "#"}},
    }
