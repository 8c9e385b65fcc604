#!/usr/bin/env bash
# The real llama.cpp servers the backend tests start (tests/backends), built once into the cache
# (CI's ~/.cache persists between runs, like the editor toolchains):
#   - llama-cpp-python 0.3.36 with its [server] extra: a wheel built from the sdist (~8 min once);
#   - the C++ `llama-server` from the llama.cpp sources that sdist vendors (cmake, ~10 min once),
#     for `/infill` and `/slots`.
# Usage: .ci/llama-tools.sh [--python] [--server]   (both by default). Idempotent.
set -euo pipefail
VERSION=0.3.36
CACHE="${SPARK_CACHE_DIR:-$HOME/.cache/spark-lsp}"
WHEELS="$CACHE/wheels"; SDIST="$CACHE/sdist"; TOOLS="${SPARK_TOOLS_DIR:-$CACHE/tools}"
SERVER_DIR="$TOOLS/llama-server-$VERSION"
want_python=1; want_server=1
if [ $# -gt 0 ]; then want_python=0; want_server=0; fi
for a in "$@"; do case "$a" in --python) want_python=1;; --server) want_server=1;; esac; done

sdist() {
  mkdir -p "$SDIST"
  local f="$SDIST/llama_cpp_python-$VERSION.tar.gz"
  [ -f "$f" ] || pip download -q --no-deps --no-binary :all: -d "$SDIST" "llama-cpp-python==$VERSION"
  echo "$f"
}

if [ "$want_python" = 1 ]; then
  if ! python -c "import llama_cpp, uvicorn, fastapi, sse_starlette, starlette_context, pydantic_settings, sys
sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    if ! ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then
      mkdir -p "$WHEELS"
      CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" pip wheel -q --no-deps -w "$WHEELS" "$(sdist)"
    fi
    # the cached wheel satisfies llama-cpp-python; the [server] extra brings uvicorn, fastapi, ...
    pip install -q "$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl | head -1)" "llama-cpp-python[server]==$VERSION"
  fi
fi

if [ "$want_server" = 1 ] && [ ! -x "$SERVER_DIR/llama-server" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  tar -xzf "$(sdist)" -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$work/build" --target llama-server -j "$(nproc)"
  mkdir -p "$SERVER_DIR"
  cp "$work/build/bin/llama-server" "$SERVER_DIR/llama-server.tmp"
  mv "$SERVER_DIR/llama-server.tmp" "$SERVER_DIR/llama-server"
fi
