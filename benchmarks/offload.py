"""Swap against recompute for one preempted sequence, and TTFT with the prefix in the pool, in the tier, nowhere
(guide §15, §17), on SmolLM2 in fp32 on this machine, with the same comparison modelled for an H100 on PCIe 5.0.

    python benchmarks/offload.py                               # 128 .. 4,096 tokens, memory and disk tier
    python benchmarks/offload.py --lengths 128,512 --prefix 256   # a quick look
    python benchmarks/offload.py --threads 1                   # on a machine other processes share

Recompute is timed as the prefill step of an n-token prompt; swap as copying the sequence's blocks to the tier and
back (`offload.KVTier.save` + `load`). The disk tier is a memory-mapped file: its writes land in the page cache
first, so it measures mapping and copying, not the device. On a machine shared with other work only ratios in one
run count.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from paged import LLM
from paged.analysis.offload_cost import (
    LLAMA3_70B_LAYER_WEIGHTS,
    PCIE5_X16_BANDWIDTH,
    PREFILL_MFU,
    crossover_tokens,
    gpu_recompute_seconds,
    gpu_swap_seconds,
    layer_weights,
    measure_swap_and_recompute,
    measure_ttft,
)
from paged.geometry import KVGeometry, cdiv, format_bytes
from paged.model.loader import load_hf_model
from paged.offload import KVTier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens for the TTFT comparison")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="prefixes measured for TTFT; the least time counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    block_size = args.block_size
    model, tokenizer = load_hf_model()
    print(f"torch threads: {torch.get_num_threads()}")

    # ---- swap against recompute ------------------------------------------------------------------------------------
    longest = max(lengths)
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=block_size,
        num_blocks=cdiv(longest + 2, block_size),
        max_num_batched_tokens=max(longest, 64),
        device="cpu",
        dtype=torch.float32,
    )
    slots = llm.engine.block_manager.num_blocks
    with tempfile.TemporaryDirectory() as folder:
        tiers = {
            "memory": KVTier(llm.engine.kv_cache, slots),
            "disk": KVTier(llm.engine.kv_cache, slots, Path(folder) / "swap.kv"),
        }
        measured = measure_swap_and_recompute(llm, lengths, tiers, repeats=3)
    geometry = KVGeometry.from_config(model.config, torch.float32)
    smollm2_params = layer_weights(model)
    print(
        f"\nswap (out + back in) against recompute (prefill again), SmolLM2 fp32, "
        f"{format_bytes(geometry.bytes_per_token)} per token, this CPU"
    )
    print(
        f"{'tokens':>7} {'recompute s':>12} {'memory s':>10} {'disk s':>10} {'recompute/memory':>17} "
        f"{'recompute/disk':>15}"
    )
    for i, n in enumerate(lengths):
        rec, mem, disk = measured["recompute"][i], measured["memory"][i], measured["disk"][i]
        print(f"{n:>7} {rec:>12.3f} {mem:>10.4f} {disk:>10.4f} {rec / mem:>16.0f}x {rec / disk:>14.0f}x")
    for name in tiers:
        table = dict(zip(lengths, measured[name]))
        recompute = dict(zip(lengths, measured["recompute"]))
        cross = crossover_tokens(table.get, recompute.get, lengths)
        print(
            f"  {name} tier: swap cheaper from {cross} tokens on"
            if cross
            else f"  {name} tier: recompute cheaper at every length measured"
        )

    # ---- the same on paper for a GPU --------------------------------------------------------------------------------
    print(
        f"\nGPU model: H100 SXM bf16 at {PREFILL_MFU:.0%} of peak for a prefill; K/V over PCIe 5.0 x16 at "
        f"{PCIE5_X16_BANDWIDTH / 1e9:.0f} GB/s each way"
    )
    grid = [2**k for k in range(4, 18)]
    for name, geo, params in (
        ("SmolLM2-135M", KVGeometry.from_config(model.config, torch.bfloat16), smollm2_params),
        ("Llama-3-70B", KVGeometry.llama3_70b(), LLAMA3_70B_LAYER_WEIGHTS),
    ):

        def swap(n, geo=geo):
            return gpu_swap_seconds(geo, n)

        def recompute(n, geo=geo, params=params):
            return gpu_recompute_seconds(geo, params, n)

        print(f"  {name}: {format_bytes(geo.bytes_per_token)} per token")
        for n in lengths:
            print(
                f"    {n:>6} tokens: swap {swap(n) * 1e3:8.3f} ms, recompute {recompute(n) * 1e3:8.3f} ms, "
                f"recompute/swap {recompute(n) / swap(n):6.2f}x"
            )
        cross = crossover_tokens(swap, recompute, grid)
        print(f"    swap cheaper from {cross} tokens on" if cross else "    recompute cheaper up to 131,072 tokens")

    # ---- TTFT: prefix in the pool, in the tier, nowhere -------------------------------------------------------------
    prefix_len = args.prefix
    pool_blocks = cdiv(prefix_len + 64, block_size) + 2
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=block_size,
        num_blocks=pool_blocks,
        max_num_batched_tokens=pool_blocks * block_size,
        enable_prefix_caching=True,
        kv_offloading_size=0.5,
        device="cpu",
        dtype=torch.float32,
    )
    generator = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 49152, (prefix_len,), generator=generator).tolist() for _ in range(args.repeats)]
    questions = [torch.randint(0, 49152, (16,), generator=generator).tolist() for _ in range(3)]
    filler = torch.randint(0, 49152, (pool_blocks * block_size - 1,), generator=generator).tolist()  # every block
    ttft = measure_ttft(llm, prefixes, questions, filler)
    print(
        f"\nTTFT of a {prefix_len}-token prefix + 16 new tokens (memory tier, block size {block_size}; "
        f"least of {args.repeats} prefixes)"
    )
    for case in ("nowhere", "tier", "pool"):
        print(f"  prefix {case:>7}: {ttft[case] * 1e3:9.1f} ms   nowhere/{case}: {ttft['nowhere'] / ttft[case]:6.1f}x")
    print(
        f"  prompt tokens served by the tier: {ttft['tier_hit_tokens']}, by the pool: {ttft['pool_hit_tokens']} "
        f"(over {args.repeats} prefixes)"
    )


if __name__ == "__main__":
    main()
