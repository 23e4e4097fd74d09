"""Multi-LoRA serving against its peers on SmolLM2 (guide §16), one run, ratios.

    python benchmarks/lora.py [--threads 1] [--batch 32] [--rank 16] [--repeats 2]

1. Tokens/s of one batch that mixes 1, 2, 4 and 8 adapters (requests spread evenly over them), against the base
   model alone on the same batch, and against the naive alternative: a merged model per adapter (W + s B A in
   the weights), requests served adapter by adapter, each group as its own smaller batch (merging not timed);
   best of --repeats rounds, the configurations taken in turns in each.
2. The cost of one decode step at --batch sequences with 4 adapters mixed, against a base-only step of the same
   shape (fastest of several steps each; S-LoRA's aim: the adapters cost little next to the base matmuls).
3. Memory from the tensors' bytes: one base plus N adapters, against N full (merged) models.

The adapters are random weights in PEFT's folder format, rank --rank on all seven projections (speed does not
depend on what the weights say). On a CPU the update runs through the torch reference of shrink/expand; on CUDA
through the Triton kernel (paged/kernels/lora.py).
"""

import argparse
import copy
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from paged import LLM, LoRARequest, SamplingParams
from paged.lora import TARGET_MODULES, LoRASlots
from paged.model.loader import load_hf_model

PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def save_random_adapter(folder: str, hf_model, rank: int, seed: int) -> None:
    """A rank-`rank` LoRA on every projection of every layer, written as PEFT writes it."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, layer in enumerate(hf_model.model.layers):
        for module in TARGET_MODULES:
            weight = getattr(getattr(layer, PARENT[module]), module).weight  # [out, in]
            prefix = f"base_model.model.model.layers.{index}.{PARENT[module]}.{module}"
            fan_in = weight.shape[1]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(TARGET_MODULES),
                "use_rslora": False,
                "fan_in_fan_out": False,
                "bias": "none",
            },
            f,
        )


def merged_model(hf_model, adapter):
    """A full copy of the model with one adapter merged in: what serving without LoRA batching needs per adapter."""
    merged = copy.deepcopy(hf_model)
    with torch.no_grad():
        for (index, module), (a, b) in adapter.weights.items():  # b is already scaled by alpha / r
            getattr(getattr(merged.model.layers[index], PARENT[module]), module).weight += b @ a
    return merged


def timed_generate(llm, prompts, params, lora_request=None) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def decode_step_seconds(runs, num_steps: int) -> list[float]:
    """runs: [(llm, prompts, lora_requests)], each on its own engine. Every prompt is added and prefilled (not
    timed); then the engines take decode steps in turn, so a change in the machine's load hits them alike.
    Returns each engine's fastest decode step, in seconds."""
    params = SamplingParams(max_tokens=num_steps + 4, temperature=0.0, ignore_eos=True)
    for llm, prompts, loras in runs:
        engine = llm.engine
        for prompt, lora in zip(prompts, loras):
            engine.add_request(engine.make_request(prompt, params, lora_request=lora))
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in running):
            engine.step()
    fastest = [float("inf")] * len(runs)
    for _ in range(num_steps):
        for i, (llm, _, _) in enumerate(runs):
            start = time.perf_counter()
            llm.engine.step()
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    for llm, _, _ in runs:
        for request_id in list(llm.engine.requests):
            llm.engine.abort_request(request_id)
    return fastest


def model_bytes(hf_model) -> int:
    return sum(p.nbytes for p in {p.data_ptr(): p for p in hf_model.parameters()}.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the tokens/s comparison")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed for the step-cost ratio")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf_model, tokenizer = load_hf_model(dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    common = dict(
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        num_blocks=args.batch * 8,
    )
    print(
        f"{device}, {dtype}, {torch.get_num_threads()} threads; batch {args.batch}, prompts of "
        f"{args.prompt_len} tokens, {args.max_tokens} new each; adapters of rank {args.rank} on all 7 projections"
    )

    with tempfile.TemporaryDirectory() as root:
        requests = []
        for i in range(8):
            save_random_adapter(os.path.join(root, f"a{i}"), hf_model, args.rank, seed=i)
            requests.append(LoRARequest(f"a{i}", i + 1, os.path.join(root, f"a{i}")))
        base_llm = LLM(model=copy.deepcopy(hf_model), **common)
        lora_llm = LLM(model=copy.deepcopy(hf_model), enable_lora=True, max_loras=8, max_lora_rank=args.rank, **common)
        timed_generate(base_llm, prompts[:2], params)  # warm up both
        timed_generate(lora_llm, prompts[:2], params, lora_request=requests[0])

        # 1. tokens/s: mixed adapters, base alone, merged models one adapter after another. Every configuration
        #    runs once per round, in turns, and keeps its best round: the machine's load changes over minutes.
        counts = (1, 2, 4, 8)
        best = {}
        for _ in range(args.repeats):
            tokens, seconds = timed_generate(base_llm, prompts, params)
            best["base"] = max(best.get("base", 0.0), tokens / seconds)
            for num_adapters in counts:
                loras = [requests[i % num_adapters] for i in range(args.batch)]
                tokens, seconds = timed_generate(lora_llm, prompts, params, lora_request=loras)
                best[num_adapters] = max(best.get(num_adapters, 0.0), tokens / seconds)
                naive_tokens, naive_seconds = 0, 0.0
                for a in range(num_adapters):
                    naive = LLM(model=merged_model(hf_model, lora_llm.engine.lora.resolve(requests[a])), **common)
                    group = [p for p, lr in zip(prompts, loras) if lr is requests[a]]
                    timed_generate(naive, group[:1], SamplingParams(max_tokens=2))  # warm up
                    t, s = timed_generate(naive, group, params)
                    naive_tokens, naive_seconds = naive_tokens + t, naive_seconds + s
                    del naive
                best[("naive", num_adapters)] = max(
                    best.get(("naive", num_adapters), 0.0), naive_tokens / naive_seconds
                )
        print(f"\ntokens/s, best of {args.repeats} rounds taken in turns")
        print(f"{'adapters':>8} {'multi-LoRA tok/s':>17} {'vs base':>8} {'naive tok/s':>12} {'multi/naive':>12}")
        print(f"{'base':>8} {best['base']:17.1f} {1.0:8.2f}")
        for n in counts:
            print(
                f"{n:>8} {best[n]:17.1f} {best[n] / best['base']:8.2f} {best[('naive', n)]:12.1f} "
                f"{best[n] / best[('naive', n)]:12.2f}"
            )

        # 2. one decode step at batch --batch: 4 adapters mixed against base only
        four = [requests[i % 4] for i in range(args.batch)]
        lora_llm_4 = LLM(
            model=copy.deepcopy(hf_model), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common
        )
        base_step, lora_base_step, mixed_step = decode_step_seconds(
            [
                (base_llm, prompts, [None] * args.batch),
                (lora_llm, prompts, [None] * args.batch),
                (lora_llm_4, prompts, four),
            ],
            args.steps,
        )
        print(
            f"\ndecode step at batch {args.batch} (fastest of {args.steps}, taken in turns): base-only engine "
            f"{base_step * 1e3:.1f} ms, LoRA engine with base requests {lora_base_step * 1e3:.1f} ms, "
            f"4 adapters mixed {mixed_step * 1e3:.1f} ms"
        )
        print(f"step-cost ratio, 4 adapters mixed / base-only: {mixed_step / base_step:.2f}x")

        # 3. memory, from the tensors' bytes (fp32 weights as loaded; the ratio does not depend on the dtype)
        base_bytes = model_bytes(hf_model)
        adapter_bytes = lora_llm.engine.lora.registry[1].nbytes
        print(
            f"\nbase model {base_bytes / 2**20:.1f} MiB; one rank-{args.rank} adapter "
            f"{adapter_bytes / 2**20:.2f} MiB "
            f"({adapter_bytes / base_bytes:.2%} of the base)"
        )
        print(f"{'N':>4} {'base + N adapters MiB':>22} {'N full models MiB':>18} {'ratio':>7}")
        for n in (1, 2, 4, 8, 16, 64):
            shared, full = base_bytes + n * adapter_bytes, n * base_bytes
            print(f"{n:>4} {shared / 2**20:22.1f} {full / 2**20:18.1f} {full / shared:7.2f}")
        slots = LoRASlots(lora_llm.engine.model, 8, args.rank)
        print(f"device slots for max_loras=8 at max_lora_rank={args.rank}: {slots.nbytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
