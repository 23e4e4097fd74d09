"""Where the time of one engine step goes (guide §11, §13): torch's profiler over warm decode steps, with every
op (torch's own, and the C++ kernel's) put in the part of the forward pass it serves.

    python benchmarks/step_profile.py                          # 64 chat prompts, steps 59-68 of 128
    python benchmarks/step_profile.py --num-prompts 16 --steps 3
    python benchmarks/step_profile.py --attention-backend torch   # the torch reference: gather, then SDPA
    python benchmarks/step_profile.py --no-packed-weights      # F.linear on plain weights (model/packed_linear.py)
    python benchmarks/step_profile.py --dtype bfloat16 --threads 1

The engine runs the benchmark's chat prompts to the middle of their decode, times a few steps plainly, then profiles
as many. Each op's own time (not counting the ops it calls) is summed into a part; "python, scheduling and the
profiler's own cost" is what the step's wall time under the profiler has beyond all ops. The profiler adds a few
microseconds to every op, and a step runs hundreds of them, so that part is mostly the profiler's: what a step
really spends outside the model's forward pass (scheduling, building the inputs, sampling, the update) is timed
without the profiler, in the plain steps, and printed on the first line. On a shared machine the parts' sizes move
together.
"""

import argparse
import os
import time

import torch
from throughput import chat_prompts
from torch.profiler import ProfilerActivity, profile

from paged import LLM, SamplingParams
from paged.model.loader import load_hf_model

PARTS = {  # aten op -> what it does in a decode step of paged/model/llama.py, whichever attention runs
    "aten::mm": "matmuls (QKV, O, gate/up, down, LM head)",
    "mkldnn::_linear_pointwise": "matmuls (QKV, O, gate/up, down, LM head)",  # on weights packed for oneDNN
    "aten::amax": "sampling",  # greedy_tokens: each chunk's maximum, then argmax over chunks and within one
    "aten::argmax": "sampling",
}
ATTENTION_PARTS = {  # attention backend -> its ops -> what they do
    "torch": {  # paged/model/attention.py
        "aten::index_select": "K/V gather through the block tables",
        "aten::embedding": "K/V gather through the block tables",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention itself (SDPA)",
        "aten::index_put_": "K/V write into the pool",
    },
    "cpu": {  # paged/kernels/cpu_attention.cpp
        "paged_cpu::decode": "attention, reading K/V in place (C++ kernel)",
        "paged_cpu::prefill": "attention, reading K/V in place (C++ kernel)",
        "paged_cpu::reshape_and_cache": "K/V write into the pool",
    },
}
OTHER = "other ops (norms, RoPE, SiLU, residuals, masks, views)"


def parts_of(backend: str) -> dict[str, str]:
    """Every op a step of this attention backend runs that has a part of its own -> that part."""
    return {**PARTS, **ATTENTION_PARTS[backend]}


def profile_steps(engine, steps: int) -> tuple[float, float, float, dict[str, float]]:
    """Run `steps` engine steps plainly, then `steps` more under the profiler.

    Returns (ms a step without the profiler, ms of it outside the model's forward pass, ms a step with the profiler,
    {part: ms a step}); the parts add up to the third.
    """
    forward, forward_seconds = engine.model.forward, []

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        logits = forward(*args, **kwargs)
        forward_seconds.append(time.perf_counter() - start)
        return logits

    engine.model.forward = timed_forward  # an attribute of this object only; deleted below
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        plain_ms = (time.perf_counter() - start) * 1e3 / steps
    finally:
        del engine.model.forward
    outside_ms = plain_ms - sum(forward_seconds) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    parts: dict[str, float] = {}
    named = parts_of(engine.model.backend.name)
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "paged_cpu::", "mkldnn::")):
            part = named.get(event.key, OTHER)
            parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3 / steps
    parts["python, scheduling and the profiler's own cost"] = max(0.0, wall_ms - sum(parts.values()))
    return plain_ms, outside_ms, wall_ms, parts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="decode steps to time, and as many to profile")
    parser.add_argument(
        "--attention-backend",
        choices=sorted(ATTENTION_PARTS),
        default="cpu",
        help="the C++ kernel (the default on a CPU) or the torch reference",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--no-packed-weights",
        action="store_true",
        help="F.linear on plain weights instead of oneDNN's packed ones (paged/model/packed_linear.py)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.no_packed_weights:
        os.environ["PAGED_PACK_WEIGHTS"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_hf_model()
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        device="cpu",
        dtype=getattr(torch, args.dtype),
        num_blocks=2048,
        max_num_seqs=args.num_prompts,
        attention_backend=args.attention_backend,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in chat_prompts(tokenizer, args.num_prompts):
        engine.add_request(engine.make_request(prompt, params))
    for _ in range(args.max_tokens // 2 - args.steps):  # prefill, then decode to the middle of the run
        engine.step()
    context = max(seq.num_tokens for seq in engine.scheduler.running)
    plain_ms, outside_ms, wall_ms, parts = profile_steps(engine, args.steps)
    packed = "packed" if engine.model.layers[0].qkv.is_mkldnn else "plain"
    print(
        f"decode steps at batch {args.num_prompts}, context about {context} tokens, {args.dtype}, "
        f"{torch.get_num_threads()} thread(s), {engine.model.backend.name} attention, {packed} weights: "
        f"{plain_ms:.1f} ms a step ({outside_ms:.1f} ms of it outside the model's forward pass), "
        f"{wall_ms:.1f} ms under the profiler"
    )
    for name, ms in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {name:<58} {ms:7.1f} ms {ms / wall_ms:6.1%}")


if __name__ == "__main__":
    main()
