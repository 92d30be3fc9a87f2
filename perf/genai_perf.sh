#!/usr/bin/env bash
# genai-perf against a running server (`make serve`): a MISS profile (471-token synthetic prompts) and a HIT
# profile (every prompt is one shared 448-token prefix plus 23 tokens of its own), --backend vllm over gRPC.
#   perf/genai_perf.sh [GRPC_URL] [MODEL_DIR]
# genai-perf lives in its own venv (.cache/genai-perf-venv): its pins differ from the engine's.
set -euo pipefail
cd "$(dirname "$0")/.."
url=${1:-127.0.0.1:8001}
model=${2:-$(.venv/bin/python -c 'from engine.models.presets import cached_model; print(cached_model("small"))')}
venv=.cache/genai-perf-venv
if [ ! -x "$venv/bin/genai-perf" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q genai-perf==0.0.16
fi
cudart=$(.venv/bin/python -c 'import nvidia.cuda_runtime as m; print(list(m.__path__)[0])')/lib
export PATH="$PWD/.venv/bin:$PATH" LD_LIBRARY_PATH="$cudart:${LD_LIBRARY_PATH:-}"
common=(-m llm --backend vllm --endpoint-type kserve --streaming -u "$url" --tokenizer "$model"
        --output-tokens-mean 128 --output-tokens-mean-deterministic --concurrency 1 --request-count 8
        --synthetic-input-tokens-stddev 0)
"$venv/bin/genai-perf" profile "${common[@]}" --synthetic-input-tokens-mean 471 \
  --artifact-dir perf/results/genai-perf/miss
"$venv/bin/genai-perf" profile "${common[@]}" --synthetic-input-tokens-mean 23 \
  --num-prefix-prompts 1 --prefix-prompt-length 448 --artifact-dir perf/results/genai-perf/hit
