"""Decode attention on a GPU: paged Triton v1 and v2 against SDPA over the same K/V laid out contiguously
(guide §7: a paged kernel competes with a contiguous layout; the vLLM paper measured its own 20-26 % slower than
FasterTransformer's). It prints each kernel's share of the card's peak HBM bandwidth and its latency against SDPA's.

Decode attention reads every cached key and value once and does a few flops per byte (4 at the default shapes: each
fp16 K and V number meets 4 query heads, a multiply and an add each), so its ceiling is memory bandwidth: achieved =
K/V bytes read / latency, reported against the card's peak. The kernels are timed through their unchecked launchers
(paged/kernels/decode_v1.py, decode_v2.py), as the engine calls them: the checks in paged/kernels/triton_ops.py cost a
device-to-host copy, which the engine pays only under PAGED_CHECK_KERNELS=1.

    python benchmarks/kernel_bench.py                         # the full grid (GPU only)
    python benchmarks/kernel_bench.py --batches 32 --contexts 4096,8192 --block-sizes 16
    python benchmarks/kernel_bench.py --dry-run               # tiny shapes (no GPU: in the interpreter): checks the script

Prints a table and writes kernel_bench.csv and kernel_bench.png under --out (benchmarks/results/, not in git).
"""

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paged.kernels.decode_v1 import paged_decode_v1
from paged.kernels.decode_v2 import paged_decode_v2
from paged.kernels.triton_ops import choose_num_splits

# Peak HBM bandwidth in TB/s by device name (first match wins); --peak-tbps overrides.
PEAK_TBPS = [
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H800", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
]
FIELDS = ["method", "batch", "context", "block_size", "latency_us", "tb_per_s", "pct_of_peak", "vs_sdpa", "max_err"]


def parse_args(argv):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 256])
    p.add_argument("--block-sizes", type=ints, default=[16, 32, 128])
    p.add_argument("--num-heads", type=int, default=32, help="query heads (default: Llama-3-8B's 32)")
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--peak-tbps", type=float, default=None, help="peak HBM bandwidth (default: from the GPU's name)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes, on the GPU if there is one, else on the CPU through Triton's interpreter",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.contexts, args.batches, args.block_sizes = [40, 100], [1, 3], [16]
        args.num_heads, args.num_kv_heads, args.head_dim, args.dtype = 4, 2, 32, "float32"
    return args


def peak_tbps(args, device):
    if args.peak_tbps or device.type != "cuda":
        return args.peak_tbps
    name = torch.cuda.get_device_name(device)
    return next((tbps for key, tbps in PEAK_TBPS if key in name), None)


def make_inputs(batch, context, block_size, args, device):
    """A shuffled pool holding batch sequences of `context` tokens, and the same K/V laid out contiguously."""
    dtype = getattr(torch, args.dtype)
    hkv, d = args.num_kv_heads, args.head_dim
    per_seq = -(-context // block_size)
    key_cache = torch.randn(batch * per_seq, block_size, hkv, d, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.num_heads, d, dtype=dtype, device=device)
    k = torch.empty(batch, hkv, context, d, dtype=dtype, device=device)  # [batch, Hkv, L, D] for SDPA
    v = torch.empty_like(k)
    for b in range(batch):  # one sequence at a time
        blocks = block_tables[b].long()
        k[b] = key_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)
        v[b] = value_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)
    return query, key_cache, value_cache, block_tables, context_lens, k, v


def fits(batch, context, args, device):
    if device.type != "cuda":
        return True
    element_bytes = getattr(torch, args.dtype).itemsize
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * element_bytes
    return 2 * kv_bytes < 0.8 * torch.cuda.mem_get_info(device)[0]  # the pool and the contiguous copy


def time_us(fn, device):
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # the interpreter: one run
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def bench_one(batch, context, block_size, args, device, with_sdpa):
    """Rows for v1 and v2 at this block size, and for SDPA if asked (block_size 0: contiguous).

    SDPA gets K/V as [batch, num_kv_heads, context, head_dim] and enable_gqa=True, so it reads the same bytes;
    its output is also the reference that max_err is measured against."""
    q, kc, vc, bt, lens, k, v = make_inputs(batch, context, block_size, args, device)
    scale = args.head_dim**-0.5
    splits = choose_num_splits(batch, args.num_kv_heads, context, device)
    methods = {
        "sdpa": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0],
        "v1": lambda: paged_decode_v1(q, kc, vc, bt, lens, scale),
        "v2": lambda: paged_decode_v2(q, kc, vc, bt, lens, scale, splits),
    }
    expected = methods["sdpa"]().float()
    kv_bytes = k.numel() * k.element_size() * 2
    rows = []
    for method, fn in methods.items():
        if method == "sdpa" and not with_sdpa:
            continue
        us = time_us(fn, device)
        rows.append(
            dict(
                method=method,
                batch=batch,
                context=context,
                block_size=0 if method == "sdpa" else block_size,
                latency_us=us,
                tb_per_s=kv_bytes / us / 1e6,
                max_err=float((fn().float() - expected).abs().max()),
            )
        )
    return rows


def finish(rows, peak):
    sdpa = {(r["batch"], r["context"]): r["latency_us"] for r in rows if r["method"] == "sdpa"}
    for r in rows:
        r["pct_of_peak"] = 100 * r["tb_per_s"] / peak if peak else float("nan")
        r["vs_sdpa"] = r["latency_us"] / sdpa[r["batch"], r["context"]]


def print_table(rows):
    print(
        f"{'method':>6} {'batch':>5} {'context':>7} {'block':>5} {'latency us':>11} {'TB/s':>7} "
        f"{'% peak':>7} {'/ sdpa':>7} {'max err':>8}"
    )
    for r in rows:
        print(
            f"{r['method']:>6} {r['batch']:>5} {r['context']:>7} {r['block_size'] or '-':>5} "
            f"{r['latency_us']:>11.1f} {r['tb_per_s']:>7.3f} {r['pct_of_peak']:>7.1f} {r['vs_sdpa']:>7.2f} "
            f"{r['max_err']:>8.1e}"
        )


def save_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def save_plot(rows, peak, title, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block_sizes = sorted({r["block_size"] for r in rows if r["block_size"]})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(block_sizes), figsize=(5 * len(block_sizes), 4), sharey=True, squeeze=False)
    for ax, bs in zip(axes[0], block_sizes):
        for i, batch in enumerate(batches):
            for method, style in (("v1", ":"), ("v2", "-"), ("sdpa", "--")):
                pts = [
                    (r["context"], r["tb_per_s"])
                    for r in rows
                    if r["method"] == method and r["batch"] == batch and r["block_size"] in (bs, 0)
                ]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i}", marker=".", label=f"{method} batch {batch}")
        if peak:
            ax.axhline(peak, color="k", lw=0.8)
            ax.axhline(0.8 * peak, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"block size {bs}")
    axes[0][0].set_ylabel("K/V bytes read / latency (TB/s)")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(
            "kernel_bench.py measures GPU kernels and needs CUDA; none is available here. "
            "Run it with --dry-run for a tiny CPU check of the script itself."
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    peak = peak_tbps(args, device)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            if not fits(batch, context, args, device):
                print(f"skipped batch {batch} context {context}: K/V and its contiguous copy do not fit")
                continue
            for i, block_size in enumerate(args.block_sizes):
                rows += bench_one(batch, context, block_size, args, device, with_sdpa=i == 0)
    finish(rows, peak)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter (dry run)"
    title = (
        f"{name}, peak {peak or 'unknown'} TB/s\n"
        f"heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, {args.dtype}, "
        f"torch {torch.__version__}"
    )
    print(title)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    save_csv(rows, args.out / "kernel_bench.csv")
    save_plot(rows, peak, title, args.out / "kernel_bench.png")
    print(f"wrote {args.out / 'kernel_bench.csv'} and {args.out / 'kernel_bench.png'}")
    return rows


if __name__ == "__main__":
    main()
