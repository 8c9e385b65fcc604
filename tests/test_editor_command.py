"""`spark-lsp editor`: the shipped editor parts, the install command line it runs, the Neovim lines it
prints, and the check that the shipped .vsix is the one the sources build. (The real editors run
them in tests/editors: the VS Code end-to-end test installs through `spark-lsp editor vscode`, the
Neovim test loads the printed lines with Neovim started outside the virtual environment.)"""

from __future__ import annotations

import os
import re
import subprocess
import zipfile
from pathlib import Path

from spark_lsp import editor_setup
from spark_lsp.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert re.fullmatch(r"spark-lsp \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_neovim_lines_name_this_installation_absolutely(capsys):
    assert main(["editor", "neovim", "--model", "/models/qwen"]) == 0
    out = capsys.readouterr().out
    rtp = re.search(r"vim\.opt\.runtimepath:append\('([^']+)'\)", out).group(1)
    assert (Path(rtp) / "lua" / "spark" / "init.lua").is_file() and Path(rtp).is_absolute()
    cmd = re.findall(r"'([^']*)'", re.search(r"cmd = \{ (.*) \},", out).group(1))
    assert Path(cmd[0]).is_absolute() and cmd[-2:] == ["serve", "--stdio"]
    assert "model = '/models/qwen'," in out
    # the command runs without the virtual environment on PATH
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    version = subprocess.run(
        [*cmd[:-2], "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout.startswith("spark-lsp "), version.stderr


def _fake_code(tmp_path: Path, name: str = "code", rc: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/args"\necho "Extension installed."\nexit {rc}\n'
    )
    script.chmod(0o755)
    return bin_dir


def test_vscode_installs_the_shipped_vsix_with_the_code_on_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(_fake_code(tmp_path, "codium")))
    assert main(["editor", "vscode", "--", "--extensions-dir", str(tmp_path / "ext")]) == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args == [
        "--install-extension",
        str(editor_setup.vsix_path()),
        "--force",
        "--extensions-dir",
        str(tmp_path / "ext"),
    ]
    out = capsys.readouterr().out
    assert "Extension installed." in out and '"spark.server.path"' in out


def test_vscode_without_a_code_command_says_how_to_install_by_hand(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["editor", "vscode"]) == 2
    err = capsys.readouterr().err
    assert "code, code-server, codium" in err and "spark-lsp editor vscode --out" in err
    _fake_code(tmp_path, "code", rc=3)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["editor", "vscode"]) == 2
    assert "failed (exit 3)" in capsys.readouterr().err


def test_vscode_out_writes_the_vsix(tmp_path, capsys):
    assert main(["editor", "vscode", "--out", str(tmp_path)]) == 0
    written = tmp_path / "spark-lsp.vsix"
    assert written.read_bytes() == editor_setup.vsix_path().read_bytes()
    assert main(["editor", "vscode", "--out", str(tmp_path / "sub" / "x.vsix")]) == 0
    assert (tmp_path / "sub" / "x.vsix").is_file()


def test_the_shipped_vsix_is_a_spark_extension_and_differences_are_found(tmp_path, capsys):
    shipped = editor_setup.vsix_path()
    content = editor_setup.vsix_content(shipped)
    assert b'"name": "spark-lsp"' in content["extension/package.json"]
    assert main(["editor", "check-vsix", str(shipped)]) == 0
    changed = tmp_path / "changed.vsix"
    with zipfile.ZipFile(shipped) as src, zipfile.ZipFile(changed, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(
                item, data + b"\n" if item.filename == "extension/dist/extension.js" else data
            )
    assert editor_setup.vsix_differences(shipped, changed) == ["extension/dist/extension.js"]
    assert main(["editor", "check-vsix", str(changed)]) == 2
    assert "npm run package" in capsys.readouterr().err
    text = tmp_path / "text.vsix"
    text.write_text("not a zip\n")
    assert main(["editor", "check-vsix", str(text)]) == 2
    assert (
        capsys.readouterr().err
        == f"spark-lsp editor: error: {text} is not a .vsix (not a zip file)\n"
    )


def test_the_package_data_holds_both_editors():
    assert editor_setup.vsix_path().suffix == ".vsix"
    assert (editor_setup.neovim_dir() / "plugin" / "spark.lua").is_file()
