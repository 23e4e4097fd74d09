"""A serving benchmark in the manner of `vllm bench serve` (guide §13), against any OpenAI-compatible server.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 32 --request-rate 2
    python benchmarks/serve_bench.py --base-url ... --max-concurrency 8 --result-json paged.json --label paged

Prompts are random token ids with ShareGPT-like lengths (paged.analysis.traces; --profile alpaca for short ones), each
asking for exactly its trace output length. Arrivals are Poisson at --request-rate (default: all at once), or a
fixed number in flight with --max-concurrency. Prints request and output throughput, TTFT / TPOT / ITL / e2e
(mean, median, p90, p99) and goodput under the SLO given by --slo-ttft and --slo-tpot (seconds).
"""

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged.analysis.load_client import first_model, make_requests, run_load  # noqa: E402
from paged.engine.metrics import SLO  # noqa: E402

ROWS = (
    [
        ("successful requests", "requests", "{:.0f}"),
        ("failed requests", "failures", "{:.0f}"),
        ("duration (s)", "duration_s", "{:.2f}"),
        ("request throughput (req/s)", "throughput_rps", "{:.3f}"),
        ("output throughput (tok/s)", "output_tok_s", "{:.1f}"),
    ]
    + [
        (f"{name.upper()} {stat} (ms)", f"{name}_{key}", "ms")
        for name in ("ttft", "tpot", "itl", "e2e")
        for stat, key in (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
    ]
    + [("SLO attainment", "slo_attainment", "{:.3f}"), ("goodput (req/s)", "goodput_rps", "{:.3f}")]
)


def cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1000:.1f}" if fmt == "ms" else fmt.format(value)


def print_table(results: dict[str, dict]) -> None:
    """One column per result, vllm bench serve's rows."""
    names = list(results)
    print(f"{'':<30}" + "".join(f"{name:>16}" for name in names))
    for label, key, fmt in ROWS:
        print(f"{label:<30}" + "".join(f"{cell(results[n].get(key), fmt):>16}" for n in names))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--profile", choices=["sharegpt", "alpaca"], default="sharegpt")
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=256)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    parser.add_argument("--label", default="server", help="the column's name in the printed table")
    parser.add_argument("--result-json", default=None, help="write the summary here")
    args = parser.parse_args(argv)

    if not args.base_url:
        parser.error("--base-url is required")
    model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
    requests = make_requests(args.num_prompts, args.profile, args.seed, args.max_input_len, args.max_output_len)
    result = asyncio.run(
        run_load(args.base_url, model, requests, args.request_rate, args.max_concurrency, args.seed, args.api_key)
    )
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    summary = result.summary(slo)
    load = f"rate {args.request_rate} req/s" if args.max_concurrency is None else f"concurrency {args.max_concurrency}"
    print(
        f"{args.num_prompts} {args.profile}-like prompts against {model} at {args.base_url}, {load}; "
        f"SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s"
    )
    print_table({args.label: summary})
    for failure in result.failures[:5]:
        print(f"  {failure}")
    if args.result_json:
        settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "result_json")}
        settings["request_rate"] = str(settings["request_rate"])
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(
            json.dumps({"label": args.label, "model": model, "settings": settings, "summary": summary}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
