"""Throughput of the paged engine against its peers, measured side by side in one run (guide §11, §13).

    python benchmarks/throughput.py                       # 64 chat prompts, 128 new tokens each, fp32
    python benchmarks/throughput.py --num-prompts 16 --max-tokens 32 --skip-static   # a quick look

Same prompts, same output lengths (EOS ignored everywhere), same weights and dtype. The paged engine runs twice:
with its defaults, and with prefix caching on (the 64 chat prompts share the chat template's system turn, one
16-token block). Peers:
  static      transformers `generate` in static batches with left padding (the paper's HF baseline)
  hf-cb       transformers `generate_batch` (its own continuous batching over a paged cache)
  ceiling     the model's matmuls alone at the same batch size (what no engine on this CPU can beat)
Also: TTFT of a request with a long shared system prompt, cold and on a prefix-cache hit; and the p99 time
per output token of running decodes while a long prompt arrives, with and without chunked prefill.
The machines are shared and noisy, so only the ratios printed at the end mean anything.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from paged import LLM, SamplingParams
from paged.models import chat_prompt, load_hf_model

TOPICS = ["the ocean", "volcanoes", "the history of tea", "black holes", "bees", "the printing press", "jazz",
          "glaciers", "the Roman roads", "photosynthesis", "chess openings", "the moon landing", "origami",
          "coral reefs", "the violin", "desert plants"]
ASKS = ["Tell me three facts about {}.", "Write a short poem about {}.", "Explain {} to a child.",
        "What are common misconceptions about {}?"]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)]) for i in range(count)]
    return [tokenizer(chat_prompt(tokenizer, t), add_special_tokens=False)["input_ids"] for t in texts]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_paged(model, tokenizer, prompts, max_tokens, **engine_args):
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return [o.outputs[0].token_ids for o in outs], seconds


def run_static(model, tokenizer, prompts, max_tokens, batch_size):
    outputs, total = [], 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out, seconds = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                                        min_new_tokens=max_tokens, do_sample=False,
                                                        eos_token_id=None, pad_token_id=tokenizer.pad_token_id))
        total += seconds
        outputs += out[:, width:].tolist()
    return outputs, total


def run_hf_continuous(model, prompts, max_tokens):
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        results, seconds = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config))
    return [r.generated_tokens for r in results.values()], seconds


def matmul_ceiling(model, batch: int, repeats: int = 5) -> float:
    """Tokens per second of the model's matmuls alone (QKV, O, gate/up, down, LM head) at this batch size."""
    config = model.config
    hidden = torch.randn(batch, config.hidden_size)
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight))

    def one_step():
        x = hidden
        for qkv, o, gate_up, down in layers:
            q = F.linear(x, qkv)[:, :o.shape[1]]               # the attention itself is left out
            x = x + F.linear(q, o)
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            x = x + F.linear(gate * up, down)
        F.linear(x, model.lm_head.weight)

    with torch.no_grad():
        one_step()
        seconds = min(timed(one_step)[1] for _ in range(repeats))
    return batch / seconds


def ttft_prefix_hit(model, tokenizer, system_tokens: int = 1500):
    """Seconds to the first token of a chat request whose long system prompt is cold, then cached."""
    system = " ".join(["Answer carefully, cite your reasoning, and keep to the facts."] * (system_tokens // 12))
    messages = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    prompt = lambda q: tokenizer.apply_chat_template(messages(q), tokenize=False, add_generation_prompt=True)
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, enable_prefix_caching=True,
              num_blocks=512)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cold = llm.generate([prompt("What is a prime number?")], params, use_tqdm=False)[0]
    hit = llm.generate([prompt("Name a large mammal.")], params, use_tqdm=False)[0]
    return len(cold.prompt_token_ids), cold.metrics.ttft, hit.metrics.ttft, llm.kv_stats()["prefix_hit_tokens"]


def decode_stall(model, tokenizer, prompts, chunked: bool, long_prompt_tokens: int = 1500, budget: int = 256):
    """Per-step latencies of 16 running decodes while one long prompt arrives: p50 and p99 seconds."""
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, num_blocks=1024,
              enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 2048, max_num_seqs=32)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for p in prompts[:16]:
        engine.add_request(engine.make_request(p, params))
    step_times = []
    for step in range(30):
        if step == 5:
            engine.add_request(engine.make_request(list(range(100, 100 + long_prompt_tokens)),
                                                   SamplingParams(max_tokens=4, temperature=0.0)))
        decodes_before = sum(1 for s in engine.scheduler.running if s.num_tokens - s.num_computed_tokens == 1)
        _, seconds = timed(engine.step)
        if decodes_before:
            step_times.append(seconds)
    step_times.sort()
    return statistics.median(step_times), step_times[min(len(step_times) - 1, int(0.99 * len(step_times)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--static-batch", type=int, default=8)
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_hf_model()
    prompts = chat_prompts(tokenizer, args.num_prompts)
    new_tokens = args.num_prompts * args.max_tokens
    print(f"{args.num_prompts} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.max_tokens} new tokens each, fp32, {torch.get_num_threads()} threads")

    rows = {}
    ours, seconds = run_paged(model, tokenizer, prompts, args.max_tokens, num_blocks=2048,
                              max_num_seqs=args.num_prompts)
    rows["paged"] = (new_tokens / seconds, 1.0)
    theirs, seconds = run_paged(model, tokenizer, prompts, args.max_tokens, num_blocks=2048,
                                max_num_seqs=args.num_prompts, enable_prefix_caching=True)
    rows["paged, prefix caching (shared chat template)"] = (new_tokens / seconds, agreement(ours, theirs))
    if not args.skip_hf_cb:
        theirs, seconds = run_hf_continuous(model, prompts, args.max_tokens)
        rows["hf generate_batch"] = (new_tokens / seconds, agreement(ours, theirs))
    if not args.skip_static:
        theirs, seconds = run_static(model, tokenizer, prompts, args.max_tokens, args.static_batch)
        rows[f"hf generate, static batches of {args.static_batch}"] = (new_tokens / seconds, agreement(ours, theirs))
    ceiling = matmul_ceiling(model, args.num_prompts)
    rows[f"matmul-only ceiling at batch {args.num_prompts}"] = (ceiling, float("nan"))

    print(f"\n{'engine':<44} {'tok/s':>8} {'paged is':>10} {'same tokens':>12}")
    for name, (rate, same) in rows.items():
        print(f"{name:<44} {rate:8.1f} {rows['paged'][0] / rate:9.2f}x {same:12.1%}")
    print(f"\npaged reaches {rows['paged'][0] / ceiling:.0%} of the matmul-only ceiling")
    print("what a speed-up over a peer asks of this machine, as a share of the ceiling:")
    for name, (rate, _) in rows.items():
        if name.startswith("hf"):
            print(f"  {name}: 4x = {4 * rate:.0f} tok/s ({4 * rate / ceiling:.0%}), "
                  f"6x = {6 * rate:.0f} tok/s ({6 * rate / ceiling:.0%})")

    if not args.skip_latency:
        length, cold, hit, hits = ttft_prefix_hit(model, tokenizer)
        print(f"\nTTFT, {length}-token prompt with a shared system prompt: cold {cold * 1e3:.0f} ms, "
              f"prefix hit {hit * 1e3:.0f} ms ({hits} tokens reused): {cold / hit:.1f}x lower")
        for chunked in (False, True):
            p50, p99 = decode_stall(model, tokenizer, prompts, chunked)
            label = "chunked prefill (budget 256)" if chunked else "no chunking"
            print(f"decode step latency while a 1,500-token prompt arrives, {label:<28}: "
                  f"p50 {p50 * 1e3:6.0f} ms, p99 {p99 * 1e3:6.0f} ms")


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of generated tokens equal, position by position, up to each pair's first difference."""
    same = total = 0
    for a, b in zip(ours, theirs):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + prefix, total + len(a)
    return same / total


if __name__ == "__main__":
    main()
