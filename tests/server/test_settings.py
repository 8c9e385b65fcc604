"""Settings are declared once (spark_lsp.settings): the editors' declarations and the docs are
generated from it, and these tests fail when one of them disagrees with the server."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from spark_lsp import editor_settings, settings
from spark_lsp.editor_settings import CONFIG_LUA, PACKAGE_JSON, ROOT, SETTINGS_TS
from spark_lsp.settings import Settings, SettingsError, declarations, json_schema, to_json, update

NAMES = [js for js, *_ in declarations()]


def test_the_generated_editor_files_are_current():
    assert editor_settings.stale() == [], "run `python -m spark_lsp.editor_settings --write`"


def test_vscode_declares_and_forwards_exactly_the_server_settings():
    props = json.loads((ROOT / PACKAGE_JSON).read_text())["contributes"]["configuration"][
        "properties"
    ]
    server = [k[len("spark.") :] for k in props if k[len("spark.") :] in NAMES]
    assert server == NAMES
    for js, _, default, spec in declarations():
        p = props[f"spark.{js}"]
        if spec.kind in ("integer", "number"):
            assert (p["type"], p["default"], p["minimum"], p["maximum"]) == (
                spec.kind,
                default,
                spec.minimum,
                spec.maximum,
            ), js
        elif spec.kind == "choice":
            assert p["enum"] == list(spec.choices()) and p["default"] == default, js
    ts = (ROOT / SETTINGS_TS).read_text()
    keys = re.search(r"const SERVER_KEYS = \[(.*?)\] as const;", ts, re.S).group(1)
    assert re.findall(r"'([A-Za-z]+)'", keys) == NAMES


def test_neovim_checks_the_server_settings_types():
    lua = (ROOT / CONFIG_LUA).read_text()
    assert re.findall(r"\{ name = '([A-Za-z]+)'", lua) == NAMES
    assert "for _, s in ipairs(M.server_settings_spec) do" in lua  # resolve() uses the table


def test_a_new_setting_is_one_declaration(tmp_path, monkeypatch):
    """Regenerating after a declaration changes every editor file; a stale copy is reported."""
    for rel in editor_settings.GENERATORS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert editor_settings.stale(tmp_path) == []
    original = declarations()
    _, _, default, spec = original[1]  # maxTokens' declaration under a new name
    more = [*original, ("newSetting", "new_setting", default, spec)]
    monkeypatch.setattr(editor_settings, "declarations", lambda: more)
    monkeypatch.setattr(settings, "declarations", lambda: more)
    assert set(editor_settings.stale(tmp_path)) == set(editor_settings.GENERATORS)
    editor_settings.write(tmp_path)
    assert editor_settings.stale(tmp_path) == []
    pkg = json.loads((tmp_path / PACKAGE_JSON).read_text())
    assert "spark.newSetting" in pkg["contributes"]["configuration"]["properties"]
    assert "'newSetting'," in (tmp_path / SETTINGS_TS).read_text()
    assert "name = 'newSetting'" in (tmp_path / CONFIG_LUA).read_text()


def test_defaults_round_trip_and_match_the_schema():
    import jsonschema

    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    defaults = to_json(Settings())
    jsonschema.validate(defaults, schema)
    assert update(Settings(), defaults) == (Settings(), [])
    jsonschema.validate({"spark": {"maxTokens": 8, "waferRegion": "4x4"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"maxTokens": 0}, schema)


@pytest.mark.parametrize("js", NAMES)
def test_every_setting_refuses_a_value_of_the_wrong_kind_naming_itself(js):
    spec = next(s for name, *_, s in declarations() if name == js)
    bad = {
        "integer": 1.5,
        "number": "fast",
        "boolean": 1,
        "string": 3,
        "choice": "fp8",
        "grid": [0, 2],
    }[spec.kind]
    with pytest.raises(SettingsError, match=js):
        update(Settings(), {js: bad})
