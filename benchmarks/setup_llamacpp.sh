#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/bench_llamacpp.py: llama-cpp-python built from its PyPI sdist with
# the machine's own CPU flags, in a venv outside the repository (10-40 minutes on 2 cores, once).
#
#   bash benchmarks/setup_llamacpp.sh            # → $LLAMACPP_VENV (default ~/.cache/kvlab-bench/llamacpp)
#
# After the build it evaluates three tokens of a pulled model. If that crashes on a CPU that reports
# AMX, it builds again without AMX: AMX tiles need the kernel's leave (arch_prctl), which a VM may not
# give; seen here: SIGSEGV in ggml_backend_amx_mul_mat. Not part of `make test`.
set -euo pipefail
VENV="${LLAMACPP_VENV:-$HOME/.cache/kvlab-bench/llamacpp}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
MODEL="${KVLAB_HOME:-$HOME/.cache/kvlab}/models/smollm2-135m.gguf"

smoke() {  # 0 when llama.cpp can evaluate tokens on this machine (or there is no model to try)
    [ -f "$MODEL" ] || return 0
    "$VENV/bin/python" -c "
from llama_cpp import Llama
Llama(model_path='$MODEL', n_threads=2, verbose=False).eval([1, 2, 3])" 2>/dev/null
}

build() {  # $1: extra compiler flags
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$1' -DCMAKE_CXX_FLAGS='$1'" \
        "$VENV/bin/pip" install --force-reinstall --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null && smoke; then
    echo "llama-cpp-python already in $VENV and working"; exit 0
fi
if ! { "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; }; then
    build ""
fi
if ! smoke; then
    if grep -q amx /proc/cpuinfo; then
        echo "llama.cpp crashed evaluating tokens; building again without AMX"
        build "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
    smoke || { echo "llama.cpp still cannot evaluate tokens on this machine" >&2; exit 1; }
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
