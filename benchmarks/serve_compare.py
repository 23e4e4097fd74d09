"""The runs of `make bench-serve` side by side (guide §13): both servers, both clients, every workload and rate.

    python benchmarks/serve_compare.py benchmarks/results/serve --out benchmarks/results/serve_vs_vllm.json \
        --how "cores=0-1" "paged=..." "vllm=..."

Reads every result file the script left in the folder, named SERVER_CLIENT_WORKLOAD_RATE_rROUND.json: vLLM's
benchmark client's (times in ms, goodput in requests/s), GuideLLM's (times in ms; its ITL is each request's mean gap,
weighted by its tokens, not every gap as vLLM's client counts it, and it has no SLO here) and serve_bench.py's (times
in s). Puts them in one shape (seconds), averages each figure over the rounds, prints per client and workload a table
of the two servers at each rate, then the comparisons the benchmark exists for: at every rate, this server's goodput,
TTFT p99, ITL p99 and output throughput against vLLM's, and the highest rate at which each still met the SLO for 90 %
of requests, with this server's over vLLM's (a bound where vLLM met it at no rate measured). A GuideLLM run that sent
its requests late (a burst, not the rate it names) stays in the file's runs with the reason, out of the summary and
the comparisons. A vLLM client's run saved with --save-detailed keeps its requests in the file's runs: when each went
out and its TTFT, to see which arrivals made the tail.
"""

import argparse
import json
from pathlib import Path

import numpy as np

FIGURES = (
    "throughput_rps",
    "output_tok_s",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "tpot_p99",
    "e2e_p99",
    "goodput_rps",
    "slo_attainment",
    "failures",
)
SLO_SHARE = 0.9  # DistServe's goodput: the highest rate at which this share of requests meets the SLO
HIGHEST = f"highest_rate_{int(SLO_SHARE * 100)}pct_slo"  # the comparisons' key for it
LATE_S = 1.0  # a request sent this much after its arrival time: the client did not offer the rate it was asked for


def from_vllm_bench(saved: dict) -> dict:
    """vLLM's benchmark client's result in this file's shape (seconds)."""
    row = {
        "throughput_rps": saved["request_throughput"],
        "output_tok_s": saved["output_throughput"],
        "goodput_rps": saved["request_goodput"],
        "failures": saved["failed"],
    }
    for name, theirs in (("ttft", "ttft"), ("itl", "itl"), ("tpot", "tpot"), ("e2e", "e2el")):
        for p in (50, 99):
            row[f"{name}_p{p}"] = saved[f"p{p}_{theirs}_ms"] / 1e3
    met = saved["request_goodput"] * saved["duration"]  # requests that met the SLO
    row["slo_attainment"] = met / (saved["completed"] + saved["failed"])
    return row


def from_guidellm(saved: dict) -> dict:
    """GuideLLM's report of its one benchmark in this file's shape (seconds); no SLO, so no goodput.

    GuideLLM 0.8.1 gives each figure's percentiles over the successful requests. Its time_per_output_token_ms is a
    request's latency over all its tokens, TTFT included; its inter_token_latency_ms, (latency - TTFT) / (tokens - 1),
    is what vLLM's client calls TPOT, so that is the TPOT here (and the ITL too: GuideLLM has no gap-by-gap figure).
    """
    benchmark = saved["benchmarks"][0]
    metrics, duration = benchmark["metrics"], benchmark["duration"]
    row = {
        "throughput_rps": metrics["request_totals"]["successful"] / duration,
        "output_tok_s": metrics["output_token_count"]["successful"]["total_sum"] / duration,
        "goodput_rps": float("nan"),
        "slo_attainment": float("nan"),
        "failures": metrics["request_totals"]["errored"] + metrics["request_totals"]["incomplete"],
    }
    for name, theirs, scale in (
        ("ttft", "time_to_first_token_ms", 1e-3),
        ("itl", "inter_token_latency_ms", 1e-3),
        ("tpot", "inter_token_latency_ms", 1e-3),
        ("e2e", "request_latency", 1.0),
    ):
        for p in (50, 99):
            row[f"{name}_p{p}"] = metrics[theirs]["successful"]["percentiles"][f"p{p}"] * scale
    return row


def guidellm_late(saved: dict) -> str | None:
    """Why a GuideLLM run did not offer its rate, or None where every request went out on time.

    GuideLLM keeps each request's arrival time (`targeted_start`) beside the time it sent it (`request_start`). A
    client that falls behind, or (GuideLLM 0.8.1's Poisson profile) reads its arrival clock before it is set, sends
    its requests late and together: a burst, which no rate's figures should be compared with."""
    timings = [r["info"]["timings"] for r in saved["benchmarks"][0]["requests"]["successful"]]
    late = sum(t["request_start"] - t["targeted_start"] > LATE_S for t in timings)
    if late == 0:
        return None
    return f"{late} of {len(timings)} requests went out more than {LATE_S:g} s after their arrival time"


def sent_requests(saved: dict) -> list[dict] | None:
    """Each successful request of a vLLM client's run saved with --save-detailed, in the order sent: when it went
    out (seconds after the run's first), its prompt's length in tokens, its TTFT (s). None where the run kept no
    detail."""
    if "ttfts" not in saved:
        return None
    starts, first = saved["start_times"], min(saved["start_times"])
    return [
        {"sent_s": starts[i] - first, "prompt_tokens": saved["input_lens"][i], "ttft_s": saved["ttfts"][i]}
        for i in sorted(range(len(starts)), key=starts.__getitem__)
        if not saved["errors"][i]
    ]


READERS = {
    "vllm-bench": from_vllm_bench,
    "guidellm": from_guidellm,
    "serve-bench": lambda saved: {name: saved["summary"].get(name) for name in FIGURES},
}


def read_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        server, client, workload, rate, round_ = path.stem.split("_")
        saved = json.loads(path.read_text())
        figures = READERS[client](saved)
        runs.append(
            {
                "server": server,
                "client": client,
                "workload": workload,
                "rate": float(rate),
                "round": int(round_[1:]),
                # why the run is kept out of the summary and the comparisons (None: it is not)
                "left_out": guidellm_late(saved) if client == "guidellm" else None,
                **figures,
                "requests": sent_requests(saved) if client == "vllm-bench" else None,
            }
        )
    return runs


def average(runs: list[dict]) -> list[dict]:
    """One row per server, client, workload and rate: each figure's mean over the rounds it was not left out of."""
    groups = {}
    for run in runs:
        if run["left_out"] is None:
            groups.setdefault((run["client"], run["workload"], run["rate"], run["server"]), []).append(run)
    rows = []
    for (client, workload, rate, server), group in sorted(groups.items()):
        rows.append(
            {
                "client": client,
                "workload": workload,
                "rate": rate,
                "server": server,
                "rounds": len(group),
                **{name: float(np.mean([r[name] for r in group])) for name in FIGURES},
            }
        )
    return rows


def comparisons(rows: list[dict]) -> dict:
    """At each rate of each client and workload: this server (and each budget it was also run at, paged-b<N>)
    against vLLM on the four figures the benchmark targets."""
    table = {(r["client"], r["workload"], r["rate"], r["server"]): r for r in rows}
    at_rates = []
    for (client, workload, rate, server), paged in sorted(table.items()):
        vllm = table.get((client, workload, rate, "vllm"))
        if not server.startswith("paged") or vllm is None:
            continue
        at_rates.append(
            {
                "server": server,
                "client": client,
                "workload": workload,
                "rate": rate,
                # None where the client counts no goodput (GuideLLM's result has no SLO)
                "goodput >= vllm": None
                if np.isnan(paged["goodput_rps"]) or np.isnan(vllm["goodput_rps"])
                else paged["goodput_rps"] >= vllm["goodput_rps"],
                "ttft p99 <= vllm": paged["ttft_p99"] <= vllm["ttft_p99"],
                "itl p99 <= vllm": paged["itl_p99"] <= vllm["itl_p99"],
                "output tok/s >= vllm": paged["output_tok_s"] >= vllm["output_tok_s"],
                "itl p99 ratio": paged["itl_p99"] / vllm["itl_p99"],
                "ttft p99 ratio": paged["ttft_p99"] / vllm["ttft_p99"],
            }
        )
    random = [r for r in rows if (r["client"], r["workload"]) == ("vllm-bench", "random")]
    highest = {
        server: max(
            (r["rate"] for r in random if r["server"] == server and r["slo_attainment"] >= SLO_SHARE), default=None
        )
        for server in sorted({r["server"] for r in rows})
    }
    return {"at_rates": at_rates, HIGHEST: highest, f"{HIGHEST}_over_vllm": rate_over_vllm(random, highest)}


def rate_over_vllm(random: list[dict], highest: dict) -> dict:
    """Each of this server's highest rates in the SLO over vLLM's, from the random prompts' rows: {"ratio",
    "more_than"}, None where this server met the share at no rate measured. Where vLLM met it at none, its own lies
    below the lowest rate measured, so the ratio is more than this server's over that lowest rate
    ("more_than": True)."""
    vllm_rates = [r["rate"] for r in random if r["server"] == "vllm"]
    ratios = {}
    for server, rate in highest.items():
        if not server.startswith("paged") or not vllm_rates:
            continue
        if rate is None:
            ratios[server] = None
        elif highest.get("vllm") is None:
            ratios[server] = {"ratio": rate / min(vllm_rates), "more_than": True}
        else:
            ratios[server] = {"ratio": rate / highest["vllm"], "more_than": False}
    return ratios


def print_tables(rows: list[dict], compared: dict, runs: list[dict]) -> None:
    keys = sorted({(r["client"], r["workload"]) for r in rows})
    for client, workload in keys:
        print(
            f"\n{client}, {workload} prompts ({'mean of the rounds' if client == 'vllm-bench' else 'one round'})"
            f"{'; ITL: each request mean gap' if client == 'guidellm' else ''}"
        )
        print(
            f"{'rate':>6} {'server':<12}{'req/s':>7}{'tok/s':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
            f"{'ITL p99':>9}{'TPOT p99':>10}{'SLO met':>9}{'goodput':>9}"
        )
        for r in rows:
            if (r["client"], r["workload"]) != (client, workload):
                continue
            print(
                f"{r['rate']:>6g} {r['server']:<12}{r['throughput_rps']:>7.2f}{r['output_tok_s']:>7.1f}"
                f"{r['ttft_p50']:>9.2f}s{r['ttft_p99']:>9.2f}s{r['itl_p50'] * 1e3:>7.0f}ms"
                f"{r['itl_p99'] * 1e3:>7.0f}ms{r['tpot_p99'] * 1e3:>8.0f}ms{r['slo_attainment']:>9.2f}"
                f"{r['goodput_rps']:>9.2f}"
            )
    print("\nthis server against vLLM, at each rate:")
    for c in compared["at_rates"]:
        checks = ", ".join(
            f"{name} {'not counted' if c[name] is None else 'yes' if c[name] else 'NO'}"
            for name in ("goodput >= vllm", "ttft p99 <= vllm", "itl p99 <= vllm", "output tok/s >= vllm")
        )
        print(f"  {c['server']}, {c['client']}, {c['workload']}, {c['rate']:g} req/s: {checks}")
    print(f"highest rate measured with {SLO_SHARE:.0%} of requests in the SLO: {compared[HIGHEST]}")
    for server, over in compared[f"{HIGHEST}_over_vllm"].items():
        if over is not None:
            print(f"  {server} over vllm: {'more than ' if over['more_than'] else ''}{over['ratio']:.2f}x")
    for run in runs:
        if run["left_out"] is not None:
            print(
                f"left out: {run['server']}, {run['client']}, {run['workload']}, {run['rate']:g} req/s, "
                f"round {run['round']}: {run['left_out']}"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--how", nargs="*", default=[], metavar="KEY=TEXT", help="how the servers were run")
    args = parser.parse_args(argv)
    runs = read_runs(args.folder)
    if not runs:
        parser.error(f"no result files in {args.folder}")
    rows = average(runs)
    compared = comparisons(rows)
    print_tables(rows, compared, runs)
    how = dict(item.split("=", 1) for item in args.how)
    args.out.write_text(
        json.dumps({"how": how, "summary": rows, "comparisons": compared, "runs": runs}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
