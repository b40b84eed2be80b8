#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, the core benchmark on the GPU, and the CPU suite.
#   bash benchmarks/cuda_check.sh [OUT_DIR]
# Expects python3 with torch (CUDA build), transformers, pytest and kvlab's dependencies importable;
# kvlab itself is imported from this checkout. Logs and JSON go to OUT_DIR (default ./cuda-check).
set -u -o pipefail
out=${1:-cuda-check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KVLAB_HOME=${KVLAB_HOME:-/tmp/kvlab-home}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/env.txt"
status=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_cuda_wave3.py 2>&1 | tee "$out/cuda-tests.log" || status=1
timeout 240 python3 benchmarks/bench_core.py --device cuda --random qwen3-0.6b --dtype bfloat16 --repeat 5 \
    --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.log" || status=1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "not real and not cuda" ${CPU_SUITE_ARGS:-} 2>&1 \
    | tail -40 > "$out/cpu-suite.log" || status=1
tail -3 "$out/cpu-suite.log"
exit $status
