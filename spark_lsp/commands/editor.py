"""`spark-lsp editor`: set up VS Code or Neovim for this installation in one step.

``spark-lsp editor vscode`` installs the bundled extension with the ``code`` (or ``code-server``,
``codium``) found on PATH, or writes the .vsix where ``--out`` says; arguments after ``--`` go to
that command (e.g. ``--extensions-dir DIR``). ``spark-lsp editor neovim`` prints the lines for
init.lua: the plugin on the runtimepath and this installation's absolute server command.
``spark-lsp editor check-vsix BUILT`` compares a .vsix built from source with the shipped one.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "editor",
        help="set up VS Code or Neovim for this installation",
        description=__doc__.splitlines()[0],
    )
    esub = p.add_subparsers(dest="editor", metavar="EDITOR")
    esub.required = True
    v = esub.add_parser(
        "vscode",
        help="install the VS Code extension (or write it with --out)",
        description="Install the bundled VS Code extension with code, code-server "
        "or codium, or write the .vsix file with --out.",
    )
    v.add_argument(
        "--out",
        metavar="PATH",
        help="write the .vsix here (a file or a folder) instead of installing it",
    )
    v.add_argument(
        "--code",
        metavar="CMD",
        help="the VS Code command line to install with (default: code, code-server or codium on PATH)",
    )
    v.add_argument(
        "code_args",
        nargs=argparse.REMAINDER,
        metavar="-- ARGS",
        help="more arguments for that command, after -- (e.g. -- --extensions-dir DIR)",
    )
    v.set_defaults(func=run_vscode)
    n = esub.add_parser(
        "neovim",
        help="print the Neovim setup (init.lua lines) for this installation",
        description="Print the lines to add to Neovim's init.lua: the plugin's folder "
        "on the runtimepath and setup() with this installation's server command.",
    )
    n.add_argument("--model", metavar="DIR", help="a model folder for setup()'s model option")
    n.set_defaults(func=run_neovim)
    c = esub.add_parser(
        "check-vsix", help="check that the shipped .vsix matches one built from source"
    )
    c.add_argument("built", type=Path, help="a .vsix built from editors/vscode (npm run package)")
    c.set_defaults(func=run_check)


def _fail(msg: str) -> int:
    print(f"spark-lsp editor: error: {msg}", file=sys.stderr)
    return 2


def _server_path_hint() -> str:
    from spark_lsp.editor_setup import server_command

    cmd = server_command()
    if cmd[1:3] == ["serve", "--stdio"]:
        return (
            f"If VS Code does not start from this environment, set the setting\n"
            f'  "spark.server.path": "{cmd[0]}"'
        )
    return ""


def run_vscode(args: argparse.Namespace) -> int:
    from spark_lsp.editor_setup import SetupError, find_vscode, vsix_path

    extra = (
        [a for a in args.code_args if a != "--"] if args.code_args[:1] == ["--"] else args.code_args
    )
    try:
        vsix = vsix_path()
        if args.out:
            out = Path(args.out).expanduser()
            if out.is_dir():
                out = out / vsix.name
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(vsix, out)
            print(f"wrote {out.resolve()}")
            print(
                "install it in VS Code: Extensions view, '...' menu, 'Install from VSIX...', "
                f"or: code --install-extension {out.resolve()}"
            )
            return 0
        code = find_vscode(args.code)
    except SetupError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}")
    cmd = [code, "--install-extension", str(vsix), "--force", *extra]
    print(f"installing the Spark LSP extension with {code}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _fail(f"{code} could not run: {exc}")
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        return _fail(f"{code} --install-extension failed (exit {proc.returncode}):\n{out}")
    if out:
        print(out)
    print("done: restart VS Code (or run 'Developer: Reload Window') to start the extension")
    hint = _server_path_hint()
    if hint:
        print(hint)
    return 0


def run_neovim(args: argparse.Namespace) -> int:
    from spark_lsp.editor_setup import SetupError, neovim_snippet

    try:
        print(neovim_snippet(args.model), end="")
    except SetupError as exc:
        return _fail(str(exc))
    return 0


def run_check(args: argparse.Namespace) -> int:
    from spark_lsp.editor_setup import SetupError, vsix_differences, vsix_path

    try:
        shipped = vsix_path()
        diff = vsix_differences(shipped, args.built)
    except SetupError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename or args.built}: {exc.strerror or exc}")
    if diff:
        return _fail(
            f"the shipped {shipped} differs from {args.built} in {', '.join(diff)}: rebuild it "
            f"(cd editors/vscode && npm ci && npm run package && cp spark-lsp.vsix {shipped})"
        )
    print(f"the shipped {shipped.name} matches {args.built}")
    return 0
