"""Where a server's time goes under load (guide §11, §12, §13): every step of the serving loop, traced.

    python benchmarks/serve_trace.py                              # the server's defaults, 32 requests at 2 req/s
    python benchmarks/serve_trace.py --policies whole chunked-2048 sized-every-step sized \
        --out benchmarks/results/serve_trace.json

The server (`build_app` over `serving_llm`, as `python -m paged serve` builds it) runs in this process, and
`paged.analysis.load_client` sends it streamed requests over HTTP. The serving loop keeps a record of each step
(`AsyncLLM.steps`): the prompt tokens and decodes it ran, its wall time, the part spent in the forward pass, and the
loop's own work around it. For each scheduling policy asked for, printed: the steps by kind (decodes only, prompt
tokens only, both), their time, the most prompt tokens one step ran while streams waited, the time per step spent
outside the forward pass, and the client's TTFT and ITL percentiles, which these steps explain. The policies:
  whole              every prompt in one step, at most 2048 tokens a step (the server's old default)
  chunked-2048       prompts chunked to fill a budget of 2048 tokens a step
  sized-every-step   prompts chunked under the budget sized for this machine (serving/token_budget.py), every step
  sized              the same, but a step with no decode runs its first prompt whole (the server's default)
--out writes every policy's steps and summary as JSON (chapter 13 draws benchmarks/results/serve_trace.json).
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged.analysis.load_client import make_requests, run_load  # noqa: E402
from paged.serving.api_server import build_app, serve_in_thread, serving_llm  # noqa: E402

POLICIES = {
    "whole": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
    "chunked-2048": {"enable_chunked_prefill": True, "max_num_batched_tokens": 2048},
    "sized-every-step": {"max_idle_prefill_tokens": None},
    "sized": {},
}


def step_table(steps) -> list[dict]:
    """The steps grouped by kind, with their count, time and prompt tokens."""
    kinds = {"decodes only": [], "prompt tokens only": [], "prompt tokens and decodes": []}
    for s in steps:
        prefill = sum(n for _, n in s.step.prefills)
        kind = (
            "decodes only" if not prefill else "prompt tokens and decodes" if s.step.decodes else "prompt tokens only"
        )
        kinds[kind].append(s)
    rows = []
    for kind, group in kinds.items():
        if not group:
            continue
        times = np.array([s.step.duration for s in group])
        rows.append(
            {
                "kind": kind,
                "steps": len(group),
                "mean ms": 1e3 * times.mean(),
                "p99 ms": 1e3 * np.percentile(times, 99),
                "max ms": 1e3 * times.max(),
                "prompt tokens, max": max(sum(n for _, n in s.step.prefills) for s in group),
                "decodes, mean": float(np.mean([len(s.step.decodes) for s in group])),
            }
        )
    return rows


def run_policy(name: str, args) -> dict:
    """Serve the load under one policy; print what its steps show; return its settings, summary and steps."""
    llm, sized = serving_llm("smollm2", **POLICIES[name])
    config = llm.engine.config
    settings = {
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "sized": sized is not None,
        "max_idle_prefill_tokens": config.max_idle_prefill_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "max_num_seqs": config.max_num_seqs,
        "enable_prefix_caching": config.enable_prefix_caching,
    }
    print(f"\n== {name}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    app = build_app(llm, "smollm2")
    requests = make_requests(
        args.num_prompts, "sharegpt", seed=0, max_input_len=args.max_input_len, max_output_len=args.max_output_len
    )
    warm_up = make_requests(2, "sharegpt", seed=1, max_input_len=args.max_input_len, max_output_len=8)
    with serve_in_thread(app) as url:
        asyncio.run(run_load(url, "smollm2", warm_up, 100.0))  # warm up, on prompts of its own
        app.state.async_llm.steps.clear()
        result = asyncio.run(run_load(url, "smollm2", requests, args.request_rate))
        steps = list(app.state.async_llm.steps)
    summary = result.summary()
    print(
        f"{len(steps)} steps; client: TTFT p50 {summary['ttft_p50']:.2f} s, p99 {summary['ttft_p99']:.2f} s; "
        f"ITL p50 {1e3 * summary['itl_p50']:.0f} ms, p99 {1e3 * summary['itl_p99']:.0f} ms; "
        f"{summary['output_tok_s']:.1f} output tok/s; {summary['failures']} failures"
    )
    print(f"{'kind':<28}{'steps':>7}{'mean ms':>9}{'p99 ms':>9}{'max ms':>9}{'prompt tok max':>16}{'decodes mean':>14}")
    for row in step_table(steps):
        print(
            f"{row['kind']:<28}{row['steps']:>7}{row['mean ms']:>9.0f}{row['p99 ms']:>9.0f}{row['max ms']:>9.0f}"
            f"{row['prompt tokens, max']:>16}{row['decodes, mean']:>14.1f}"
        )
    outside = np.array([s.outside_forward for s in steps])
    loop = np.array([s.loop_time for s in steps])
    total = np.array([s.step.duration + s.loop_time for s in steps])
    print(
        f"per step outside the forward pass: mean {1e3 * outside.mean():.1f} ms, p99 "
        f"{1e3 * np.percentile(outside, 99):.1f} ms ({outside.sum() / total.sum():.1%} of the loop's time); "
        f"of it the loop's own work around the step: mean {1e3 * loop.mean():.1f} ms, p99 "
        f"{1e3 * np.percentile(loop, 99):.1f} ms"
    )
    return {
        "settings": settings,
        "summary": summary,
        "steps": [
            {
                "start": s.step.start,
                "duration": s.step.duration,
                "forward": s.forward_time,
                "loop": s.loop_time,
                "prompt_tokens": sum(n for _, n in s.step.prefills),
                "prefills": len(s.step.prefills),
                "decodes": len(s.step.decodes),
                "waiting": s.num_waiting,
                "running": s.num_running,
            }
            for s in steps
        ],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["sized"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--out", default=None, help="write every policy's steps and summary as JSON here")
    args = parser.parse_args(argv)
    results = {name: run_policy(name, args) for name in args.policies}
    if args.out:
        load = {
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "profile": "sharegpt",
            "max_input_len": args.max_input_len,
            "max_output_len": args.max_output_len,
            "command": "python benchmarks/serve_trace.py " + " ".join(argv or sys.argv[1:]),
        }
        Path(args.out).write_text(json.dumps({"load": load, "policies": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
