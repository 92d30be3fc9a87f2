# The two commands: `make run` (the main job on the embedded default model) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test serve bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Until the Triton model lands, the main job runs in process: one prompt, then the same prompt again (a cache hit).
run: setup
	$(PY) -m engine generate --max-tokens 128 --repeat 2 \
	  --prompt "$$(head -c 2000 engine/models/corpus.txt)"

test: setup
	$(PY) -m pytest

serve:
	@echo "make serve: the Triton model repository is not built yet (see the open issues)"; exit 2

bench:
	@echo "make bench: the hit vs miss benchmark is not built yet (see the open issues)"; exit 2
