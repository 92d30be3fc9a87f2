#!/usr/bin/env bash
# Everything that needs a GPU, in one run (under ~8 minutes on one H100/H200-class GPU):
#   1. the kernel tests, compiled for the GPU (no interpreter);
#   2. the decode-attention benchmark: contexts 512/2k/8k, batch 1/4, contiguous vs shuffled block tables,
#      Triton kernel and torch reference, achieved GB/s against the device's HBM bandwidth;
#   3. in-process hit vs miss decode on the qwen2.5-0.5b preset in bf16 (paged, Triton kernels).
# Writes perf/results/gpu/*.json and prints one table. Without a CUDA device it says so and runs nothing.
#   bash perf/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-perf/results/gpu}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: skipped: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))"
    exit 0
fi
mkdir -p "$OUT"
unset TRITON_INTERPRET
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'

echo "== 1. kernel tests on the GPU"
"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3

echo "== 2. decode attention benchmark"
for impl in triton reference; do
    "$PY" -m perf.bench_attention --impl "$impl" --device cuda --dtype bfloat16 --contexts 512,2048,8192 \
        --batches 1,4 --iters 50 --json "$OUT/attention_$impl.json"
done

echo "== 3. hit vs miss decode, qwen2.5-0.5b bf16, in process"
for storage in paged dense; do
    "$PY" -m perf.profile_hit_miss --preset qwen2.5-0.5b --dtype bfloat16 --device cuda --attention auto \
        --storage "$storage" --pairs 8 --max-tokens 128 --json "$OUT/hit_miss_$storage.json"
done
echo "gpu_check: JSON in $OUT"
