"""Speculative decoding against plain decoding, side by side in one run (guide §14).

    python benchmarks/speculative.py                                   # batch 1, 4, 16, 64; both workloads
    python benchmarks/speculative.py --batch-sizes 1,4 --max-tokens 48 # a quick look

Two workloads on SmolLM2 (greedy, EOS ignored so every method makes the same tokens):
  copying    rewrite or quote a passage given in the prompt: what prompt lookup (ngram) is for
  chat       free answers to short questions
Methods: none; ngram (prompt lookup); early-exit:L (the first L of the target's 30 layers with its final norm
and head, untrained); self (the target as its own draft: every draft accepted, at the full cost of the target).
For each: tokens/s, mean request latency, acceptance per draft position, and the cost model

    E = (1 - a^(k+1)) / (1 - a)          tokens per verify when each draft is accepted with probability a
    speedup = E * t_decode / (t_verify + t_draft)

with t_decode the time of a plain decode step at this batch size, t_verify the target step that scores k + 1
tokens per sequence and t_draft the proposer's time, all measured here. A verify is nearly free while decoding
is bound by reading weights (small batches) and costs k + 1 decodes once it is bound by compute (large
batches): that is where speculation stops paying. The last table times single forward passes (a decode step and
a verify step, `paged.analysis.speculative_cost.measure_step`) at batch sizes up to --cost-batches' largest, and says for each
measured acceptance rate the first batch size at which speculation stops paying, beside what the fitted step
cost of paged.analysis.step_cost predicts (`crossover_batch`). On a machine shared with other work only ratios in one run count.
"""

import argparse
import time

import torch

from paged import LLM, SamplingParams
from paged.analysis.speculative_cost import crossover_batch, expected_tokens, measure_step, verify_speedup
from paged.analysis.step_cost import SMOLLM2_CPU
from paged.model.loader import chat_prompt, load_hf_model

PASSAGE = (
    "The lighthouse stood on a narrow spit of rock at the edge of the bay. Every night its keeper climbed "
    "the one hundred and twelve steps to the lamp room, trimmed the wick, polished the great lens and "
    "watched the beam sweep across the water. Ships passing in the dark counted the flashes to know where "
    "they were: two short and one long meant the bay, three short meant the reef to the north."
)
COPY_ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this paragraph, changing nothing:\n\n{}",
    "Quote the passage below in full:\n\n{}",
    "Rewrite the following text, keeping every sentence as it is:\n\n{}",
]
CHAT_ASKS = [
    "Tell me three facts about the ocean.",
    "Write a short poem about bees.",
    "Explain jazz to a child.",
    "What are common misconceptions about glaciers?",
    "Describe how a violin makes sound.",
    "Why do we have seasons?",
    "Give me a recipe for pancakes.",
    "What is a black hole?",
]


def prompts_for(tokenizer, workload: str, count: int) -> list[list[int]]:
    asks = [a.format(PASSAGE) for a in COPY_ASKS] if workload == "copying" else CHAT_ASKS
    return [
        tokenizer(chat_prompt(tokenizer, asks[i % len(asks)]), add_special_tokens=False)["input_ids"]
        for i in range(count)
    ]


def speculative_config(method: str, model, k: int):
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "self":
        return {"method": "draft_model", "model": model, "num_speculative_tokens": k}
    layers = int(method.split(":")[1])  # early-exit:L
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "draft_layers": layers}


def run(model, tokenizer, prompts, method: str, k: int, max_tokens: int) -> dict:
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        num_blocks=2048,
        block_size=16,
        max_num_seqs=64,
        device="cpu",
        dtype=torch.float32,
        speculative_config=speculative_config(method, model, k),
    )
    engine = llm.engine
    draft_seconds = [0.0]
    if engine.speculator is not None:  # time the proposer apart from the target's step
        propose = engine.speculator.propose

        def timed_propose(*args):
            start = time.perf_counter()
            propose(*args)
            draft_seconds[0] += time.perf_counter() - start

        engine.speculator.propose = timed_propose
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm up
    draft_seconds[0], steps_before = 0.0, engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.spec_stats()
    num_steps = engine.num_steps - steps_before
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "seconds": seconds,
        "tok_s": len(prompts) * max_tokens / seconds,
        "latency": sum(o.metrics.e2e_latency for o in outs) / len(outs),
        "steps": num_steps,
        "draft_seconds": draft_seconds[0],
        "acceptance": stats["num_accepted_tokens"] / max(stats["num_draft_tokens"], 1),
        "per_pos": [n / max(stats["num_drafts"], 1) for n in stats["num_accepted_tokens_per_pos"]],
        "drafts": stats["num_drafts"],
    }


def cost_model(model, tokenizer, batch_sizes: list[int], k: int, context: int, acceptances: dict[str, float]):
    """Decode and verify steps timed alone; the measured and the modelled batch size where speculation stops paying."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=16,
        device="cpu",
        dtype=torch.float32,
        num_blocks=max(batch_sizes) * -(-(context + k + 1) // 16),
    )
    measure_step(llm.engine, 1, 1, context, repeats=1)  # warm up
    print(f"\n== cost model: one forward pass at context {context}, k = {k}; speedup = E(a, k) * t_decode / t_verify")
    print(
        f"{'batch':>6}{'decode ms':>11}{'verify ms':>11}{'verify/decode':>15}{'fitted':>8}   "
        + "".join(f"{name:>22}" for name in acceptances)
    )
    measured = {}
    for batch in batch_sizes:
        decode, verify = measure_step(llm.engine, batch, 1, context), measure_step(llm.engine, batch, k + 1, context)
        fitted = (k + 1) / verify_speedup(SMOLLM2_CPU, batch, k, 1.0, context)  # modelled verify / decode
        line = f"{batch:>6}{decode * 1e3:11.1f}{verify * 1e3:11.1f}{verify / decode:15.2f}{fitted:8.2f}   "
        for name, a in acceptances.items():
            measured.setdefault(name, []).append((batch, expected_tokens(a, k) * decode / verify))
            line += f"{measured[name][-1][1]:22.2f}"
        print(line)
    for name, a in acceptances.items():
        stops = next((batch for batch, speedup in measured[name] if speedup < 1), None)
        modelled = crossover_batch(SMOLLM2_CPU, k, a, context)
        print(
            f"{name} (a = {a:.2f}): stops paying at batch {stops or f'> {max(batch_sizes)}'} measured, "
            f"{modelled or '> 4096'} by the fitted step cost"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--workloads", default="copying,chat")
    parser.add_argument("--methods", default="none,ngram,early-exit:8,early-exit:15,self")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cost-batches", default="1,4,16,64,128", help="batch sizes of the cost-model table")
    parser.add_argument("--context", type=int, default=200, help="context of the cost-model table's sequences")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; on a small CPU shared with other work, two threads can make small steps slower",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_hf_model()
    print(f"guide's arithmetic: a = 0.75, k = 5 gives E = {expected_tokens(0.75, 5):.2f} tokens per verify, not 4")
    acceptances = {}  # "method, workload" -> acceptance at each batch size
    for workload in args.workloads.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = prompts_for(tokenizer, workload, batch)
            print(f"\n== {workload}, batch {batch}, {args.max_tokens} new tokens, k = {args.k}")
            print(
                f"{'method':<14}{'tok/s':>8}{'x none':>8}{'latency s':>11}{'accept':>8}{'E meas':>8}"
                f"{'c':>7}{'model x':>9}   accepted per position"
            )
            base = None
            for method in args.methods.split(","):
                r = run(model, tokenizer, prompts, method, args.k, args.max_tokens)
                if method != "none":
                    acceptances.setdefault(f"{method}, {workload}", []).append(r["acceptance"])
                if base is None:
                    base = r
                assert r["tokens"] == base["tokens"], f"{method} changed the greedy tokens"
                line = f"{method:<14}{r['tok_s']:8.1f}{r['tok_s'] / base['tok_s']:8.2f}{r['latency']:11.2f}"
                if method == "none":
                    print(line)
                    continue
                t_decode = base["seconds"] / base["steps"]
                t_verify = (r["seconds"] - r["draft_seconds"]) / r["steps"]
                t_draft = r["draft_seconds"] / r["steps"]
                e_measured = args.max_tokens / r["steps"]  # new tokens per sequence per step (prefill included)
                c = t_draft / args.k / t_decode  # one draft step against one target decode step
                predicted = expected_tokens(r["acceptance"], args.k) * t_decode / (t_verify + t_draft)
                per_pos = " ".join(f"{p:.2f}" for p in r["per_pos"])
                print(
                    f"{line}{r['acceptance']:8.2f}{e_measured:8.2f}{c:7.2f}{predicted:9.2f}   {per_pos}"
                    f"   (verify {t_verify / t_decode:.2f}x a decode)"
                )

    cost_model(
        model,
        tokenizer,
        [int(b) for b in args.cost_batches.split(",")],
        args.k,
        args.context,
        {name: sum(values) / len(values) for name, values in acceptances.items()},
    )


if __name__ == "__main__":
    main()
