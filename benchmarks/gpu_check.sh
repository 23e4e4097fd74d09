#!/usr/bin/env bash
# The book's GPU check, sized for one run of under ten minutes on one H200 (guide §7, §17):
#   1. the kernel tests on the GPU (tests/test_kernels.py, tests/test_lora_kernel.py: with CUDA present they put
#      their tensors there and compile the kernels; nothing needs setting);
#   2. benchmarks/kernel_bench.py, on a grid cut to fit the time (KERNEL_BENCH_ARGS replaces it);
#   3. benchmarks/gpu_engine_check.py: the engine against transformers on random-weight SmolLM2-, Llama-3-8B- and
#      Qwen3-shaped models in bf16 with the Triton backend (prompts of 512 tokens), decode tok/s at batch 1, 16 and 64,
#      and with CUDA graphs against enforce_eager=True: the same greedy tokens, each decode step's host parts, and the
#      step against its memory floor;
#   4. benchmarks/tp_check.py: tensor_parallel_size=2 against 1 (greedy tokens in fp32, decode tok/s in bf16) where
#      the machine has two CUDA devices; skipped, saying so, where it has one.
# Every figure is printed; the benchmark's table and plot go to $OUT (or benchmarks/results).
#
#   benchmarks/gpu_check.sh          on a CUDA machine, with whatever python3 holds torch, triton and transformers
#   benchmarks/gpu_check.sh --dry    here, without a GPU: tiny shapes in Triton's interpreter (checks the scripts)
#
# It installs nothing and fetches nothing (a GPU machine may have no network): it uses the python named by $PYTHON
# (default python3) and says which package is missing, if one is.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry" ]]; then DRY=1; elif [[ $# -gt 0 ]]; then echo "usage: $0 [--dry]" >&2; exit 2; fi
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ $DRY == 0 ]]; then unset TRITON_INTERPRET; fi

"$PY" - "$DRY" <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "triton", "transformers", "numpy", "tqdm", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} lacks {', '.join(missing)}; install them (or carry wheels) first")
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"GPU: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
elif sys.argv[1] == "0":
    sys.exit("gpu_check: no CUDA device is visible to torch; run with --dry for the interpreter check")
else:
    print("no GPU: dry run, Triton's interpreter, tiny shapes")
EOF

status=0
section() { echo; echo "=== $1 ($(date -u +%H:%M:%S), ${SECONDS}s elapsed)"; }

section "1. kernel tests"
# -o addopts= : the project's pytest options name nbval, which a GPU machine need not have
# (the dry run keeps a few quick tests: the interpreter's whole run is the ordinary test suite's business)
if [[ $DRY == 1 ]]; then filter=(-k "matches_write_kv or one_token_is_decode or rejects or shrink"); else filter=(); fi
"$PY" -m pytest -o addopts= -p no:cacheprovider -q -ra "${filter[@]}" tests/test_kernels.py tests/test_lora_kernel.py \
  || status=1

section "2. kernel_bench.py"
if [[ $DRY == 1 ]]; then
  bench_args=(--dry-run)
else
  read -r -a bench_args <<<"${KERNEL_BENCH_ARGS:---batches 1,8,32,64,256 --contexts 1024,4096,16384 --block-sizes 16,128}"
fi
"$PY" benchmarks/kernel_bench.py "${bench_args[@]}" --out "$RESULTS" || status=1

section "3. the engine against transformers"
if [[ $DRY == 1 ]]; then engine_args=(--dry); else engine_args=(--prompt-len 512 --batch-sizes 1,16,64); fi
"$PY" benchmarks/gpu_engine_check.py "${engine_args[@]}" || status=1

section "4. tensor parallelism"
if [[ $DRY == 1 ]]; then tp_args=(--dry); else tp_args=(); fi
"$PY" benchmarks/tp_check.py "${tp_args[@]}" || status=1

section "done: $([[ $status == 0 ]] && echo 'every step passed' || echo 'a step FAILED (see above)')"
exit $status
