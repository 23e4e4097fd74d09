"""Where a decode step's time goes on the host (guide §7, §11): each part of `LLMEngine.step` (schedule, build the
inputs, the forward pass, sample, finish), timed by the engine itself (`LLMEngine.last_step_times`), against the
memory floor: the time the step's bytes take to read once at the rate this machine reads memory.

    python benchmarks/host_time.py                               # SmolLM2, batches 1, 16, 64, greedy and sampled
    python benchmarks/host_time.py --batches 1,8 --steps 10 --prompt-len 64
    python benchmarks/host_time.py --out benchmarks/results      # also writes host_time_<device>.json there

paged/analysis/host_time.py says what the floor counts. On a CPU a step waits on the forward pass's arithmetic and the
work around it; on a GPU, on the host launching kernels unless they are replayed as a CUDA graph (engine/cuda_graphs.py).
`benchmarks/gpu_engine_check.py` prints the same parts for models of real shapes on a GPU, eager and with graphs.
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from paged.analysis.host_time import PARTS, decode_step_times
from paged.analysis.parallel_cost import measure_read_bandwidth


def report(rows: list[dict], bandwidth: float) -> None:
    print(
        f"{'batch':>5} {'sampling':>8} {'step ms':>8} "
        + " ".join(f"{p:>8}" for p in PARTS)
        + f" {'outside fwd':>11} {'floor ms':>8} {'floor/step':>10}"
    )
    for r in rows:
        outside = r["step_s"] - r["forward_s"]
        floor = r["bytes"] / bandwidth
        print(
            f"{r['batch']:5d} {r['sampling']:>8} {r['step_s'] * 1e3:8.2f} "
            + " ".join(f"{r[p + '_s'] * 1e3:8.2f}" for p in PARTS)
            + f" {outside * 1e3:6.2f} ({outside / r['step_s']:3.0%}) {floor * 1e3:8.2f} {floor / r['step_s']:10.1%}"
        )


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch (the median is printed)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", type=Path, help="a folder for host_time_<device>.json")
    args = p.parse_args(argv)
    from paged import LLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    largest = max(args.batches)
    blocks_per_seq = -(-(args.prompt_len + args.steps + 2 + largest) // 16)  # decode_step_times' max_tokens
    llm = LLM(
        model="smollm2",
        device=device,
        dtype=dtype,
        num_blocks=largest * blocks_per_seq + 8,
        max_num_seqs=largest,
        max_num_batched_tokens=max(2048, largest),
    )
    bandwidth = measure_read_bandwidth(device=device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or platform.machine())
    print(
        f"SmolLM2, {args.dtype}, prompt {args.prompt_len} tokens, on {name} ({torch.get_num_threads()} threads); "
        f"memory read at {bandwidth / 1e9:.1f} GB/s; graphs: "
        f"{'yes' if llm.engine.model_runner.decode_graphs is not None else 'no'}"
    )
    rows = []
    for batch in args.batches:
        for sampling, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            row = decode_step_times(llm.engine, batch, args.prompt_len, args.steps, temperature)
            rows.append({"sampling": sampling, **row})
    report(rows, bandwidth)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"host_time_{device.type}.json"
        path.write_text(
            json.dumps(
                {
                    "command": "python " + " ".join(["benchmarks/host_time.py", *sys.argv[1:]]),
                    "device": name,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "dtype": args.dtype,
                    "prompt_len": args.prompt_len,
                    "read_bandwidth_Bps": bandwidth,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
