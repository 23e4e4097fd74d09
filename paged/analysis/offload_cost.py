"""What swap and the prefix-cache tier cost, measured here and modelled for a GPU (guide §15, §17).

A preempted sequence of n tokens can be brought back three ways:
  swap       its K/V go out to the tier and come back: 2 * n * bytes_per_token over the link between them
  recompute  its blocks are dropped and prefilled again: 2 * P * n + 2 * n^2 * num_layers * d FLOPs
             (P = the decoder layers' weights, d = num_attention_heads * head_dim; the n^2 term is causal
             attention's QK^T and PV)
  recompute that hits the prefix cache
             its blocks are freed with their hashes kept (vLLM V1's preemption), and the c leading tokens whose
             blocks nobody has reused since are found in the cache: only tokens c..n are prefilled again,
             2 * P * (n - c) + 2 * (n^2 - c^2) * num_layers * d FLOPs
Swap grows linearly with n, recompute faster than linearly: "recomputing the prefill, which can be much worse for
long-context requests" (guide §15). Which one wins depends on the model's ratio of KV bytes to FLOPs per token, on
the machine's ratio of link bandwidth to compute, and on the share of peak FLOP/s a prefill reaches (its MFU).
`gpu_swap_seconds` / `gpu_recompute_seconds` are that model for an H100 on PCIe 5.0; `measure_swap_and_recompute`
and `measure_ttft` measure the same things on the engine, in this process.
"""

import time

import torch

from paged.geometry import H100_SXM_BF16_FLOPS, KVGeometry
from paged.sampling_params import SamplingParams

PCIE5_X16_BANDWIDTH = 64e9  # bytes/s one way, PCIe 5.0 x16 (32 GT/s x 16 lanes, before protocol overhead)
PREFILL_MFU = 0.5  # share of peak FLOP/s of a large model's long prefill; a small model's reaches less
# Llama-3-70B's decoder layers: 80 x (q, o 8192^2; k, v 8192 x 1024; gate, up, down 8192 x 28672; two norms);
# with the embedding and the untied head (128,256 x 8,192 each) and the final norm, 70.55e9 weights in all
LLAMA3_70B_LAYER_WEIGHTS = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)


def layer_weights(hf_model) -> int:
    """The weights every prefilled token goes through: the decoder layers'. Not the embedding (a lookup, no FLOPs)
    nor the LM head, which a recompute needs for the last token only."""
    return sum(p.numel() for p in hf_model.model.layers.parameters())


def prefill_flops(geometry: KVGeometry, num_params: float, num_tokens: int, num_cached: int = 0) -> float:
    """FLOPs of prefilling tokens num_cached..num_tokens after num_cached cached ones: the weights' 2 * P per token
    (num_params = P, the layer weights) plus causal attention over every (query, key) pair they compute."""
    d = geometry.num_layers * geometry.num_attention_heads * geometry.head_dim
    attention = 2 * (num_tokens**2 - num_cached**2) * d
    return 2 * num_params * (num_tokens - num_cached) + attention


def gpu_swap_seconds(geometry: KVGeometry, num_tokens: int, bandwidth: float = PCIE5_X16_BANDWIDTH) -> float:
    """A sequence's K/V out to host memory and back in over the link."""
    return 2 * geometry.request_bytes(num_tokens) / bandwidth


def gpu_recompute_seconds(
    geometry: KVGeometry,
    num_params: float,
    num_tokens: int,
    flops: float = H100_SXM_BF16_FLOPS,
    mfu: float = PREFILL_MFU,
    cached_share: float = 0.0,
) -> float:
    """A sequence's prefill done again at mfu of the GPU's peak; cached_share of its tokens (rounded down) are
    found in the prefix cache and not computed."""
    if not 0 <= cached_share <= 1:
        raise ValueError(f"cached_share must be in [0, 1], got {cached_share}")
    num_cached = int(cached_share * num_tokens)
    return prefill_flops(geometry, num_params, num_tokens, num_cached) / (flops * mfu)


def gpu_crossover_tokens(
    geometry: KVGeometry,
    num_params: float,
    bandwidth: float = PCIE5_X16_BANDWIDTH,
    flops: float = H100_SXM_BF16_FLOPS,
    mfu: float = PREFILL_MFU,
) -> float:
    """The context length n at which swap and a full recompute cost the same in the GPU model, from
    2 n B / bandwidth = (2 P n + 2 n^2 L d) / (flops * mfu). Swap is cheaper beyond it; 0 when it is cheaper at
    every length (the link carries a token's K/V faster than the GPU computes its weights' share)."""
    per_token_link = 2 * geometry.bytes_per_token * flops * mfu / bandwidth  # FLOPs the link time is worth
    attention = 2 * geometry.num_layers * geometry.num_attention_heads * geometry.head_dim
    return max(0.0, (per_token_link - 2 * num_params) / attention)


def crossover_tokens(swap_seconds, recompute_seconds, lengths) -> int | None:
    """The first length at which swap is cheaper than recompute (None if it never is among lengths)."""
    return next((n for n in lengths if swap_seconds(n) < recompute_seconds(n)), None)


def measure_swap_and_recompute(llm, lengths, tiers, repeats: int = 1) -> dict:
    """For each length n: seconds to prefill an n-token prompt (what a recompute costs) and, for each tier, seconds
    to copy its blocks out and back in. llm needs a pool of at least max(lengths) tokens; tiers are offload.KVTier
    objects over llm's pool with as many slots. Returns {"recompute": [...], tier name: [...]} in order of lengths."""
    engine = llm.engine
    manager = engine.block_manager
    results = {"recompute": []} | {name: [] for name in tiers}
    generator = torch.Generator().manual_seed(0)
    vocab = engine.model.vocab_size
    llm.generate([[1] * 8], SamplingParams(max_tokens=1), use_tqdm=False)  # warm up: nothing measured runs first
    for n in lengths:
        prompt = torch.randint(0, vocab, (n,), generator=generator).tolist()
        request = engine.make_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        engine.add_request(request)
        start = time.perf_counter()
        engine.step()  # the prefill: all n tokens' K/V, once
        results["recompute"].append(time.perf_counter() - start)
        table = manager.block_tables[request.seqs[0].seq_id]
        for name, tier in tiers.items():
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                tier.save(list(zip(table, range(len(table)))))
                tier.load(list(zip(range(len(table)), table)))
                best = min(best, time.perf_counter() - start)
            results[name].append(best)
        engine.abort_request(request.request_id)
    return results


def measure_ttft(llm, prefixes: list[list[int]], questions: list[list[int]], filler: list[int]) -> dict:
    """TTFT (seconds, the least over the prefixes) of prefix + a question when the prefix is nowhere (first time), in
    the pool (right after), and in the tier only (after a filler prompt has taken every pool block). llm: prefix
    caching on, a tier, a pool no larger than the filler. A short request of one partial block runs before each
    measured one, so that none of them pays for what a long prefill before it left behind (the allocator's state).
    Also returns the prompt tokens the pool and the tier served to the measured requests."""
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt):
        llm.generate([[1] * 8], params, use_tqdm=False)
        return llm.generate([prompt], params, use_tqdm=False)[0].metrics.ttft

    times = {"nowhere": [], "pool": [], "tier": [], "pool_hit_tokens": 0, "tier_hit_tokens": 0}
    for prefix in prefixes:
        times["nowhere"].append(ttft(prefix + questions[0]))
        before = llm.kv_stats()["prefix_hit_tokens"]
        times["pool"].append(ttft(prefix + questions[1]))
        times["pool_hit_tokens"] += llm.kv_stats()["prefix_hit_tokens"] - before
        llm.generate([filler], params, use_tqdm=False)
        before = llm.kv_stats()["offload_hit_tokens"]
        times["tier"].append(ttft(prefix + questions[2]))
        times["tier_hit_tokens"] += llm.kv_stats()["offload_hit_tokens"] - before
    return times | {case: min(times[case]) for case in ("nowhere", "pool", "tier")}
