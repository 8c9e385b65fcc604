"""The editors' copies of the server settings, generated from `spark_lsp.settings`.

`python -m spark_lsp.editor_settings --write` rewrites them; `--check` (and
tests/server/test_settings.py) fails when one is stale:

- editors/vscode/package.json: the server settings in `contributes.configuration`;
- editors/vscode/src/settings.ts: `SERVER_KEYS`, the settings the VS Code client forwards;
- editors/neovim/lua/spark/config.lua: `M.server_settings_spec`, which `resolve()` type-checks;
- docs/settings.schema.json (the JSON schema of initializationOptions) and docs/settings.md.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from .settings import Spec, declarations, json_schema, json_schema_of

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_JSON = Path("editors/vscode/package.json")
SETTINGS_TS = Path("editors/vscode/src/settings.ts")
CONFIG_LUA = Path("editors/neovim/lua/spark/config.lua")
SCHEMA = Path("docs/settings.schema.json")
DOC = Path("docs/settings.md")
COMMAND = "python -m spark_lsp.editor_settings --write"
LUA_BEGIN, LUA_END = "-- BEGIN server settings", "-- END server settings"


def _num(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


def vscode_property(spec: Spec, default: Any) -> dict[str, Any]:
    """A `contributes.configuration` property: VS Code shows a text box for a string, "" = unset."""
    if spec.kind in ("integer", "number"):
        return {
            "type": spec.kind,
            "default": _num(default),
            "minimum": _num(spec.minimum),
            "maximum": _num(spec.maximum),
            "description": spec.doc,
        }
    if spec.kind == "boolean":
        return {"type": "boolean", "default": default, "description": spec.doc}
    if spec.kind == "choice":
        return {
            "type": "string",
            "enum": list(spec.choices()),
            "default": default,
            "description": spec.doc,
        }
    return {"type": "string", "default": "", "description": spec.doc}


def package_json(text: str) -> str:
    """package.json with the server settings regenerated; the client's own settings keep their
    place (those before the first server setting, then the server's, then the rest)."""
    pkg = json.loads(text)
    props: dict[str, Any] = pkg["contributes"]["configuration"]["properties"]
    server = {
        f"spark.{js}": vscode_property(spec, default) for js, _, default, spec in declarations()
    }
    old_names = {f"spark.{spec.renamed_from}" for *_, spec in declarations() if spec.renamed_from}
    keys = list(props)
    first = next((i for i, k in enumerate(keys) if k in server or k in old_names), len(keys))
    client = [k for k in keys if k not in server and k not in old_names]
    before = [k for k in client if keys.index(k) < first]
    after = [k for k in client if keys.index(k) > first]
    new = {**{k: props[k] for k in before}, **server, **{k: props[k] for k in after}}
    pkg["contributes"]["configuration"]["properties"] = new
    return json.dumps(pkg, indent=2) + "\n"  # ASCII with \\u escapes, as npm writes it


def _wrap(items: list[str], indent: str, width: int = 100) -> list[str]:
    lines, line = [], indent
    for item in items:
        if len(line) + len(item) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += item + " "
    return [*lines, line.rstrip()]


def settings_ts(text: str) -> str:
    """settings.ts with SERVER_KEYS listing every server setting."""
    names = [f"'{js}'," for js, *_ in declarations()]
    block = "\n".join(
        [
            f"// Generated from spark_lsp/settings.py by `{COMMAND}`.",
            "const SERVER_KEYS = [",
            *_wrap(names, "  "),
            "] as const;",
        ]
    )
    pattern = re.compile(
        r"(// Generated from [^\n]*\n)?const SERVER_KEYS = \[.*?\] as const;", re.S
    )
    if not pattern.search(text):
        raise ValueError(f"{SETTINGS_TS}: no `const SERVER_KEYS = [...] as const;` to regenerate")
    return pattern.sub(lambda m: block, text, count=1)


def _lua(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(_num(v))


LUA_TYPES = {
    "integer": "number",
    "number": "number",
    "boolean": "boolean",
    "string": "string",
    "choice": "string",
}


def lua_block() -> str:
    rows = []
    for js, _, default, spec in declarations():
        typ = _lua(LUA_TYPES[spec.kind]) if spec.kind in LUA_TYPES else "{ 'string', 'table' }"
        row = f"  {{ name = {_lua(js)}, type = {typ}"
        row += f", default = {_lua(default)} }}," if default is not None else " },"
        rows.append(row)
    return "\n".join(
        [
            LUA_BEGIN,
            f"-- Generated from spark_lsp/settings.py by `{COMMAND}`; do not edit.",
            "-- The server's settings (`settings` above), their types and server-side defaults.",
            "M.server_settings_spec = {",
            *rows,
            "}",
            LUA_END,
        ]
    )


def config_lua(text: str) -> str:
    """config.lua with the generated block replaced (or inserted after M.defaults)."""
    begin, end = text.find(LUA_BEGIN), text.find(LUA_END)
    if begin >= 0 and end > begin:
        return text[:begin] + lua_block() + text[end + len(LUA_END) :]
    anchor = text.find("\nlocal function check(")
    if anchor < 0:
        raise ValueError(
            f"{CONFIG_LUA}: no generated block and no `local function check(` to put one before"
        )
    return text[:anchor] + "\n" + lua_block() + "\n" + text[anchor:]


def schema_json(_: str = "") -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def _shown(spec: Spec, default: Any) -> tuple[str, str]:
    """(default, values) for the settings table."""
    sch = json_schema_of(spec, default)
    if spec.kind in ("integer", "number"):
        return f"`{_num(default)}`", f"{_num(spec.minimum)} – {_num(spec.maximum)}"
    if spec.kind == "boolean":
        return f"`{str(default).lower()}`", "`true`, `false`"
    if spec.kind == "choice":
        return f"`{default}`", ", ".join(f"`{c}`" for c in sch["enum"])
    if spec.kind == "grid":
        return "unset", '`"RxC"` or `[R, C]`'
    return "unset", "a string"


def settings_md(_: str = "") -> str:
    rows = [
        f"| `{js}` | {' | '.join(_shown(spec, default))} | {spec.doc} |"
        for js, _, default, spec in declarations()
    ]
    return "\n".join(
        [
            "# Server settings",
            "",
            f"Generated from `spark_lsp/settings.py` by `{COMMAND}`; do not edit.",
            "",
            "Editors send these in `initializationOptions` and",
            "`workspace/didChangeConfiguration` (camelCase or snake_case, optionally under a",
            '`"spark"` key); `spark.configure` takes the same object. VS Code shows them as',
            "`spark.<name>`; Neovim takes them in `require('spark').setup({ settings = { ... } })`.",
            "A bad value is refused with a message naming the setting; an unknown one is ignored",
            "with a warning in the log.",
            "The JSON schema: [settings.schema.json](settings.schema.json).",
            "",
            "| setting | default | values | what |",
            "|---|---|---|---|",
            *rows,
            "",
            "## One process for every editor: `--shared` (not a setting)",
            "",
            "`spark-lsp serve --stdio --shared` (or `SPARK_LSP_SHARED=1` in the environment of",
            "`serve --stdio`) makes the editor's server process a small bridge to your session",
            "host, one process that runs every editor's session with one copy of each model",
            "([service.md](service.md#one-process-for-every-editor-serve---stdio---shared)).",
            "It is a command-line flag, not a setting: the process is a bridge or a full server",
            "before the editor sends any settings. Each session's settings (`model`, `engine`,",
            "`precision` and the rest) work as without it; sessions with the same `model` and",
            "`precision` share one engine. To opt in: VS Code",
            '`"spark.server.shared": true`; Neovim',
            "`require('spark').setup({ shared = true })`.",
            "",
        ]
    )


GENERATORS = {
    PACKAGE_JSON: package_json,
    SETTINGS_TS: settings_ts,
    CONFIG_LUA: config_lua,
    SCHEMA: schema_json,
    DOC: settings_md,
}


def _outputs(root: Path) -> dict[Path, tuple[str, str]]:
    """path -> (current text, generated text)."""
    out = {}
    for rel, gen in GENERATORS.items():
        path = root / rel
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        out[rel] = (current, gen(current))
    return out


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files that differ from what the settings declaration gives."""
    return [rel for rel, (cur, new) in _outputs(root).items() if cur != new]


def write(root: Path = ROOT) -> list[Path]:
    """Regenerate the stale files; returns them."""
    changed = []
    for rel, (cur, new) in _outputs(root).items():
        if cur != new:
            (root / rel).write_text(new, encoding="utf-8")
            changed.append(rel)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spark_lsp.editor_settings", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write", action="store_true", help="rewrite the stale files")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a file is stale (the default)"
    )
    args = parser.parse_args(argv)
    if args.write:
        for rel in write():
            print(f"wrote {rel}")
        return 0
    paths = stale()
    for rel in paths:
        print(f"stale: {rel} (run `{COMMAND}`)")
    return 1 if paths else 0


if __name__ == "__main__":
    raise SystemExit(main())
