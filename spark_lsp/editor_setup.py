"""Setting up an editor for this installation: where the shipped editor parts are, which command
starts this installation's server, and the text a user copies.

The package carries the built VS Code extension (``editors/spark-lsp.vsix``) and the Neovim plugin
(``editors/neovim``). An editor started from a desktop launcher does not inherit a virtual
environment, so everything handed to it names this installation by absolute path.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
EDITORS_DIR = PACKAGE_DIR / "editors"
VSIX_NAME = "spark-lsp.vsix"
#: the VS Code command lines `spark-lsp editor vscode` looks for, in this order
VSCODE_COMMANDS = ("code", "code-server", "codium")
#: the entries of a .vsix that hold the extension's behaviour (the rest is packaging metadata)
VSIX_CONTENT = ("extension/package.json", "extension/dist/extension.js")


class SetupError(RuntimeError):
    """The editor cannot be set up as asked; the message says what to do instead."""


def vsix_path() -> Path:
    """The VS Code extension this installation ships."""
    path = EDITORS_DIR / VSIX_NAME
    if not path.is_file():
        raise SetupError(
            f"the VS Code extension is missing from this installation ({path}); "
            "build it from the clone: cd editors/vscode && npm ci && npm run package"
        )
    return path


def neovim_dir() -> Path:
    """The Neovim plugin's folder (the directory to add to 'runtimepath'), symlinks resolved."""
    path = (EDITORS_DIR / "neovim").resolve()
    if not (path / "lua" / "spark" / "init.lua").is_file():
        raise SetupError(f"the Neovim plugin is missing from this installation ({path})")
    return path


def server_command() -> list[str]:
    """This installation's server command, absolute: the `spark-lsp` console script next to this
    Python when there is one, else this Python running the CLI module."""
    script = Path(sys.executable).parent / ("spark-lsp.exe" if os.name == "nt" else "spark-lsp")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve", "--stdio"]
    return [sys.executable, "-m", "spark_lsp.cli", "serve", "--stdio"]


def _lua_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def neovim_snippet(model: str | None = None) -> str:
    """Lua for the user's init.lua: the plugin on the runtimepath and setup() with this
    installation's absolute server command (Neovim need not run inside its environment)."""
    cmd = ", ".join(_lua_string(a) for a in server_command())
    lines = [
        "-- Spark LSP: add to your init.lua (~/.config/nvim/init.lua)",
        f"vim.opt.runtimepath:append({_lua_string(str(neovim_dir()))})",
        "require('spark').setup({",
        f"  cmd = {{ {cmd} }},",
    ]
    if model:
        lines.append(f"  model = {_lua_string(model)},")
    lines.append("})")
    return "\n".join(lines) + "\n"


def find_vscode(explicit: str | None = None) -> str:
    """The VS Code command to install with: `explicit`, else the first of VSCODE_COMMANDS on PATH."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise SetupError(f"{explicit!r} is not an executable command")
        return found
    for name in VSCODE_COMMANDS:
        found = shutil.which(name)
        if found is not None:
            return found
    raise SetupError(
        f"no VS Code command line found ({', '.join(VSCODE_COMMANDS)} on PATH). Write the extension "
        "to a file with `spark-lsp editor vscode --out spark-lsp.vsix` and install it in VS Code: "
        "Extensions view, '...' menu, 'Install from VSIX...'"
    )


def vsix_content(path: Path) -> dict[str, bytes]:
    """The behaviour-bearing entries of a .vsix (VSIX_CONTENT), to compare two builds."""
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise SetupError(f"{path} is not a .vsix (not a zip file)") from None
    with z:
        names = set(z.namelist())
        missing = [n for n in VSIX_CONTENT if n not in names]
        if missing:
            raise SetupError(
                f"{path} is not a spark-lsp extension package (no {', '.join(missing)})"
            )
        return {n: z.read(n) for n in VSIX_CONTENT}


def vsix_differences(shipped: Path, built: Path) -> list[str]:
    """The content entries in which the shipped .vsix differs from one built from source."""
    a, b = vsix_content(shipped), vsix_content(built)
    return [n for n in VSIX_CONTENT if a[n] != b[n]]
