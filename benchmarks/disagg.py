"""Disaggregated prefill/decode on this machine (guide §15): what moves, what it costs, and what it buys.

    python benchmarks/disagg.py                 # SmolLM2, fp32, one run; prints ratios
    python benchmarks/disagg.py --long 512      # shorter long prompts, for a quick look

1. Bytes moved per request against prompt length: the prompt's blocks, every layer's K and V
   (46,080 B a token for SmolLM2 in fp32, rounded up to whole blocks).
2. Transfer time (the decode worker receiving the blocks and scattering them into its pool) against prefill time
   (the prefill worker's time to first token), per prompt length.
3. Interference: short requests decode while long prompts arrive. The p99 gap between a short request's tokens,
   colocated (one LLM, prefill and decode in the same steps) against disaggregated (the long prefills run in the
   other process). The cores are split evenly: the colocated LLM runs with 2 torch threads, each worker with 1.
   A colocated LLM with chunked prefill (a small token budget, Sarathi's answer) is the third peer, and the
   colocated LLM on one thread the fourth (on a loaded machine two OpenMP threads can be slower than one).
Only ratios within one run mean anything: a machine shared with other work is noisy.
"""

import argparse
import statistics

import torch

from paged import LLM, SamplingParams
from paged.disagg import DisaggregatedLLM

SEED = 0


def random_prompt(length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(100, 40_000, (length,), generator=generator).tolist()


def gaps(outputs) -> list[float]:
    """Seconds between consecutive tokens of each request."""
    return [b - a for out in outputs for a, b in zip(out.metrics.token_times, out.metrics.token_times[1:])]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def interference_workload(num_short: int, short_len: int, short_tokens: int, num_long: int, long_len: int):
    generator = torch.Generator().manual_seed(SEED)
    shorts = [random_prompt(short_len, generator) for _ in range(num_short)]
    longs = [random_prompt(long_len, generator) for _ in range(num_long)]
    params = [SamplingParams(max_tokens=short_tokens, temperature=0.0, ignore_eos=True)] * num_short + [
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ] * num_long
    return shorts + longs, params


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--long", type=int, default=1024, help="tokens of each long prompt in part 3")
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--num-short", type=int, default=4)
    parser.add_argument("--short-tokens", type=int, default=64)
    args = parser.parse_args()
    common = dict(block_size=16, num_blocks=1024, max_num_batched_tokens=2048, device="cpu", dtype=torch.float32)

    print("SmolLM2-135M fp32, block_size 16; colocated: 1 process x 2 threads, disaggregated: 2 workers x 1 thread")
    with DisaggregatedLLM("smollm2", num_threads=1, **common) as disagg:
        generator = torch.Generator().manual_seed(SEED)
        disagg.generate([random_prompt(64, generator)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        print("\n1-2. one request at a time: bytes moved and transfer time against prefill time")
        print(
            f"{'prompt':>7} {'blocks':>7} {'bytes':>12} {'B/token':>8} {'prefill s':>10} {'transfer s':>11} "
            f"{'transfer/prefill':>17} {'GB/s':>6}"
        )
        for length in args.lengths:
            before = len(disagg.transfer_log())
            out = disagg.generate(
                [random_prompt(length, generator)],
                SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )[0]
            (record,) = disagg.transfer_log()[before:]
            prefill_s = out.metrics.ttft
            print(
                f"{length:>7} {record['num_blocks']:>7} {record['num_bytes']:>12,} "
                f"{record['num_bytes'] / length:>8,.0f} {prefill_s:>10.3f} {record['seconds']:>11.4f} "
                f"{record['seconds'] / prefill_s:>17.4f} {record['num_bytes'] / record['seconds'] / 1e9:>6.2f}"
            )

        prompts, params = interference_workload(args.num_short, 32, args.short_tokens, args.num_long, args.long)
        disagg_out = disagg.generate(prompts, params, use_tqdm=False)

    torch.set_num_threads(2)
    colocated = LLM(model="smollm2", **common)
    colocated.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    coloc_out = colocated.generate(prompts, params, use_tqdm=False)
    chunked = LLM(model="smollm2", **{**common, "max_num_batched_tokens": 256}, enable_chunked_prefill=True)
    chunked_out = chunked.generate(prompts, params, use_tqdm=False)
    torch.set_num_threads(1)  # on a loaded machine two OpenMP threads can be slower than one: the fair check
    single_out = colocated.generate(prompts, params, use_tqdm=False)

    same = [o.outputs[0].token_ids for o in disagg_out] == [o.outputs[0].token_ids for o in coloc_out]
    print(
        f"\n3. {args.num_short} short requests (32-token prompts, {args.short_tokens} tokens each) decode while "
        f"{args.num_long} prompts of {args.long} tokens arrive (greedy tokens identical: {same})"
    )
    shorts = slice(0, args.num_short)
    rows = [
        ("colocated", coloc_out),
        ("colocated, chunked prefill 256", chunked_out),
        ("colocated, 1 thread", single_out),
        ("disaggregated", disagg_out),
    ]
    base = p99(gaps(coloc_out[shorts]))
    print(
        f"{'':>32} {'median gap s':>13} {'p99 gap s':>10} {'p99 / colocated':>16} {'long TTFT s':>12} "
        f"{'makespan s':>11}"
    )
    for name, outs in rows:
        short_gaps = gaps(outs[shorts])
        long_ttft = statistics.mean(o.metrics.ttft for o in outs[args.num_short :])
        start = min(o.metrics.arrival_time for o in outs)
        makespan = max(o.metrics.finished_time for o in outs) - start
        print(
            f"{name:>32} {statistics.median(short_gaps):>13.4f} {p99(short_gaps):>10.4f} "
            f"{p99(short_gaps) / base:>16.3f} {long_ttft:>12.3f} {makespan:>11.3f}"
        )


if __name__ == "__main__":
    main()
