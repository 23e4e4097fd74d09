"""Throughput of the paged engine against its peers, measured side by side in one run (guide §11, §13).

    python benchmarks/throughput.py                       # both workloads, batch 1, latency; fp32 (half an hour)
    python benchmarks/throughput.py --workloads fixed --num-prompts 16 --max-tokens 32 --skip-static   # a quick look
    python benchmarks/throughput.py --threads 1           # on a machine other processes share

Same prompts, same output lengths (EOS ignored everywhere), same weights and dtype. Two workloads:
  fixed    64 chat prompts, 128 new tokens each, all admitted at once
  steady   256 chat requests whose output lengths follow ShareGPT's (paged.analysis.traces) scaled to at most 256 tokens,
           each request's length the same for every engine, 64 running at a time: continuous batchers refill a
           finished request's place, static batching waits for the longest request of each batch (the paper's case)
The paged engine runs with its defaults (the C++ attention kernel on a CPU), with the torch reference attention,
and (fixed workload) with prefix caching (the prompts share the chat template's system turn). Peers:
  static      transformers `generate` in static batches with left padding (the paper's HF baseline)
  hf-cb       transformers' continuous batching (`generate_batch`'s manager) over its own paged cache
  ceiling     the model's matmuls alone, at batch 64 (decode steps only: it overstates what an engine can reach),
              and over the steps the paged engine ran (every prompt and output token at the step shapes it chose:
              what no engine that schedules the same way can beat on this CPU)
Also: one chat stream alone (batch 1) against transformers' `generate`; TTFT of a request with a long shared
system prompt, cold and on a prefix-cache hit; and the p99 time per output token of running decodes while a long
prompt arrives, with and without chunked prefill.
A machine shared with other work is noisy, so only the ratios printed at the end mean anything.
"""

import argparse
import collections
import statistics
import time

import torch

from paged import LLM, SamplingParams
from paged.analysis.traces import sharegpt_trace
from paged.model.loader import chat_prompt, load_hf_model, load_model
from paged.model.packed_linear import linear

TOPICS = [
    "the ocean",
    "volcanoes",
    "the history of tea",
    "black holes",
    "bees",
    "the printing press",
    "jazz",
    "glaciers",
    "the Roman roads",
    "photosynthesis",
    "chess openings",
    "the moon landing",
    "origami",
    "coral reefs",
    "the violin",
    "desert plants",
]
ASKS = [
    "Tell me three facts about {}.",
    "Write a short poem about {}.",
    "Explain {} to a child.",
    "What are common misconceptions about {}?",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)]) for i in range(count)]
    return [tokenizer(chat_prompt(tokenizer, t), add_special_tokens=False)["input_ids"] for t in texts]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def steady_lengths(count: int, cap: int = 256, seed: int = 0) -> list[int]:
    """ShareGPT-like output lengths (mean 338, clipped at 1,024 by paged.analysis.traces), scaled so that 1,024 becomes cap."""
    trace = sharegpt_trace(count, seed=seed)
    high = 2048 - 2048 // 2  # the trace's output clip, max_model_len - max_input_len
    return [max(1, round(r.output_len * cap / high)) for r in trace]


def record_steps(engine, steps: list) -> None:
    """Appends (tokens computed, logits rows) of every step the engine runs from now on to steps: a sequence whose
    step reaches its last token samples from one logits row."""
    engine.forward_observers.append(
        lambda plan: steps.append(
            (
                plan.num_batched_tokens,
                sum(1 for seq, n in plan.scheduled if seq.num_computed_tokens + n == seq.num_tokens),
            )
        )
    )


def run_paged(model, tokenizer, prompts, lengths, steps=None, **engine_args):
    """The paged engine's tokens and seconds; steps, if a list, gets (tokens computed, logits rows) of every step."""
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, **engine_args)
    if steps is not None:
        record_steps(llm.engine, steps)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return [o.outputs[0].token_ids for o in outs], seconds


CEILING = "matmul-only ceiling over the workload's own steps"


def run_static(model, tokenizer, prompts, lengths, batch_size):
    """Static batches in arrival order; each batch runs until its longest request is done."""
    outputs, total = [], 0.0
    for start in range(0, len(prompts), batch_size):
        batch, wanted = prompts[start : start + batch_size], lengths[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out, seconds = timed(
                lambda: model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=max(wanted),
                    min_new_tokens=max(wanted),
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=tokenizer.pad_token_id,
                )
            )
        total += seconds
        outputs += [row[:n] for row, n in zip(out[:, width:].tolist(), wanted)]
    return outputs, total


def run_hf_continuous(model, prompts, lengths, max_running):
    """transformers' continuous batching (the manager behind `generate_batch`), one max_new_tokens per request."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(max_requests_per_batch=max_running)

    def generate():
        results = {}
        with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching
        ) as manager:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
        return [results[i].generated_tokens for i in ids]

    with torch.no_grad():
        return timed(generate)


def run_hf_single(model, prompt, max_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out, seconds = timed(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        )
    return out[0, ids.shape[1] :].tolist(), seconds


class Matmuls:
    """The model's matmuls alone (QKV, O, gate/up, down in every layer; the LM head), timed at any batch shape, with
    the weights packed as the engine packs them (paged/model/packed_linear.py)."""

    def __init__(self, model):
        self.hidden_size, self.dtype = model.config.hidden_size, model.dtype
        paged, _ = load_model(model, dtype=model.dtype)  # the engine's own fused (and, where it packs, packed) weights
        self.layers = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in paged.layers]
        self.lm_head = paged.lm_head

    @torch.no_grad()
    def seconds(self, tokens: int, logits_rows: int, repeats: int = 3) -> float:
        """The fastest of repeats: every layer's matmuls over tokens rows, the LM head over logits_rows."""
        hidden = torch.randn(tokens, self.hidden_size, dtype=self.dtype)

        def one_step():
            x = hidden
            for qkv, o, gate_up, down in self.layers:
                q = linear(x, qkv)[:, : o.shape[1]]  # the attention itself is left out
                x = x + linear(q, o)
                gate, up = linear(x, gate_up).chunk(2, dim=-1)
                x = x + linear(gate * up, down)
            linear(x[:logits_rows], self.lm_head)

        one_step()
        return min(timed(one_step)[1] for _ in range(repeats))

    def workload_seconds(self, steps: list[tuple[int, int]]) -> float:
        """The matmuls of every step an engine ran, (tokens, logits rows) each, summed; each distinct shape is timed
        once, up to 64 rows exactly, above that at the nearest of a grid 1/8 apart (a matmul's time grows about
        linearly there)."""

        def near(tokens):
            grid = 2 ** (tokens.bit_length() - 1) // 8
            return tokens if tokens <= 64 else round(tokens / grid) * grid

        counts = collections.Counter((near(tokens), rows) for tokens, rows in steps)
        return sum(count * self.seconds(tokens, rows) for (tokens, rows), count in counts.items())


def ttft_prefix_hit(model, tokenizer, system_tokens: int = 1500):
    """Seconds to the first token of a chat request whose long system prompt is cold, then cached."""
    system = " ".join(["Answer carefully, cite your reasoning, and keep to the facts."] * (system_tokens // 12))

    def messages(q):
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    def prompt(q):
        return tokenizer.apply_chat_template(messages(q), tokenize=False, add_generation_prompt=True)

    llm = LLM(
        model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, enable_prefix_caching=True, num_blocks=512
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cold = llm.generate([prompt("What is a prime number?")], params, use_tqdm=False)[0]
    hit = llm.generate([prompt("Name a large mammal.")], params, use_tqdm=False)[0]
    return len(cold.prompt_token_ids), cold.metrics.ttft, hit.metrics.ttft, llm.kv_stats()["prefix_hit_tokens"]


def decode_stall(model, tokenizer, prompts, chunked: bool, long_prompt_tokens: int = 1500, budget: int = 256):
    """Per-step latencies of 16 running decodes while one long prompt arrives: p50 and p99 seconds."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
        num_blocks=1024,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget if chunked else 2048,
        max_num_seqs=32,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for p in prompts[:16]:
        engine.add_request(engine.make_request(p, params))
    step_times = []
    for step in range(30):
        if step == 5:
            engine.add_request(
                engine.make_request(
                    list(range(100, 100 + long_prompt_tokens)), SamplingParams(max_tokens=4, temperature=0.0)
                )
            )
        decodes_before = sum(1 for s in engine.scheduler.running if s.num_tokens - s.num_computed_tokens == 1)
        _, seconds = timed(engine.step)
        if decodes_before:
            step_times.append(seconds)
    step_times.sort()
    return statistics.median(step_times), step_times[min(len(step_times) - 1, int(0.99 * len(step_times)))]


def workload(
    model, tokenizer, prompts, lengths, max_running, static_batch, args, prefix_caching: bool = False
) -> dict[str, tuple[float, float]]:
    """{engine: (useful tokens per second, share of tokens equal to the paged engine's)} over one workload."""
    new_tokens = sum(lengths)
    rows = {}
    paged = dict(num_blocks=2048, max_num_seqs=max_running)
    steps = []
    ours, seconds = run_paged(model, tokenizer, prompts, lengths, steps=steps, **paged)
    rows["paged"] = (new_tokens / seconds, 1.0)
    matmuls = Matmuls(model)  # timed next to the paged run, so that a machine that drifts moves both alike
    ceilings = {
        f"matmul-only ceiling at batch {max_running}": max_running
        / matmuls.seconds(max_running, max_running, repeats=5),
        CEILING: new_tokens / matmuls.workload_seconds(steps),
    }
    theirs, seconds = run_paged(model, tokenizer, prompts, lengths, attention_backend="torch", **paged)
    rows["paged, torch reference attention"] = (new_tokens / seconds, agreement(ours, theirs))
    if prefix_caching:
        theirs, seconds = run_paged(model, tokenizer, prompts, lengths, enable_prefix_caching=True, **paged)
        rows["paged, prefix caching (shared chat template)"] = (new_tokens / seconds, agreement(ours, theirs))
    if not args.skip_hf_cb:
        theirs, seconds = run_hf_continuous(model, prompts, lengths, max_running)
        rows["hf continuous batching"] = (new_tokens / seconds, agreement(ours, theirs))
    if not args.skip_static:
        theirs, seconds = run_static(model, tokenizer, prompts, lengths, static_batch)
        rows[f"hf generate, static batches of {static_batch}"] = (new_tokens / seconds, agreement(ours, theirs))
    return rows | {name: (rate, float("nan")) for name, rate in ceilings.items()}


def report(rows: dict[str, tuple[float, float]]) -> None:
    paged = rows["paged"][0]
    print(f"{'engine':<52} {'tok/s':>8} {'paged is':>10} {'same tokens':>12}")
    for name, (rate, same) in rows.items():
        agreement_cell = f"{same:12.1%}" if same == same else ""  # nan: a ceiling computes no tokens
        print(f"{name:<52} {rate:8.1f} {paged / rate:9.2f}x {agreement_cell}")
    ratio = paged / rows[CEILING][0]
    print(f"  paged reaches {ratio:.0%} of the {CEILING}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=["fixed", "steady"], default=["fixed", "steady"])
    parser.add_argument("--num-prompts", type=int, default=64, help="fixed workload: prompts, all at once")
    parser.add_argument("--max-tokens", type=int, default=128, help="fixed workload: new tokens each")
    parser.add_argument("--static-batch", type=int, default=8, help="fixed workload: static batch size")
    parser.add_argument("--num-requests", type=int, default=256, help="steady workload: requests")
    parser.add_argument(
        "--max-running",
        type=int,
        default=64,
        help="steady workload: requests running at a time (and the static batch size)",
    )
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument("--skip-batch-one", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every engine (default: torch's); 1 keeps a shared machine's other "
        "processes from stalling every parallel op at its barrier",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_hf_model()
    print(f"fp32, {torch.get_num_threads()} thread(s)")

    if "fixed" in args.workloads:
        prompts = chat_prompts(tokenizer, args.num_prompts)
        print(
            f"\nfixed: {args.num_prompts} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
            f"{args.max_tokens} new tokens each"
        )
        report(
            workload(
                model,
                tokenizer,
                prompts,
                [args.max_tokens] * len(prompts),
                args.num_prompts,
                args.static_batch,
                args,
                prefix_caching=True,
            )
        )
    if "steady" in args.workloads:
        prompts = chat_prompts(tokenizer, args.num_requests)
        lengths = steady_lengths(args.num_requests)
        print(
            f"\nsteady: {args.num_requests} chat requests, output lengths ShareGPT-like scaled to <= 256 "
            f"(mean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}, max {max(lengths)}), "
            f"{args.max_running} running at a time"
        )
        report(workload(model, tokenizer, prompts, lengths, args.max_running, args.max_running, args))

    if not args.skip_batch_one:
        prompt = chat_prompts(tokenizer, 1)[0]
        ours, seconds = run_paged(model, tokenizer, [prompt], [args.max_tokens], num_blocks=256)
        theirs, hf_seconds = run_hf_single(model, prompt, args.max_tokens)
        print(
            f"\nbatch 1, one chat stream of {args.max_tokens} tokens: paged {args.max_tokens / seconds:.1f} tok/s, "
            f"hf generate {args.max_tokens / hf_seconds:.1f} tok/s: paged is {hf_seconds / seconds:.2f}x "
            f"(same tokens {agreement(ours, [theirs]):.0%})"
        )

    if not args.skip_latency:
        prompts = chat_prompts(tokenizer, 16)
        length, cold, hit, hits = ttft_prefix_hit(model, tokenizer)
        print(
            f"\nTTFT, {length}-token prompt with a shared system prompt: cold {cold * 1e3:.0f} ms, "
            f"prefix hit {hit * 1e3:.0f} ms ({hits} tokens reused): {cold / hit:.1f}x lower"
        )
        for chunked in (False, True):
            p50, p99 = decode_stall(model, tokenizer, prompts, chunked)
            label = "chunked prefill (budget 256)" if chunked else "no chunking"
            print(
                f"decode step latency while a 1,500-token prompt arrives, {label:<28}: "
                f"p50 {p50 * 1e3:6.0f} ms, p99 {p99 * 1e3:6.0f} ms"
            )


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of generated tokens equal, position by position, up to each pair's first difference."""
    same = total = 0
    for a, b in zip(ours, theirs):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + prefix, total + len(a)
    return same / total


if __name__ == "__main__":
    main()
