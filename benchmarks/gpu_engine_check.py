"""The engine on a GPU against transformers (guide §7, §17): random-weight models of real shapes, in bf16, with
the Triton backend.

For each architecture in ARCHITECTURES it builds a transformers model of that family (Llama, Qwen3) with random
weights on the GPU,
then
  - greedy tokens: the engine's against transformers' own greedy loop (the same weights, the same dtype), prompt
    by prompt: how many positions agree before the first difference, and the logit margin there (transformers'
    logit of its token minus its logit of the engine's token; random weights give flat logits, so a difference
    at a margin of a few bf16 steps is a near-tie, not a bug). The median gap between the top two logits over
    all positions is printed beside it for scale;
  - whether the forward pass waits for the GPU: a prefill and a decode step run under
    torch.cuda.set_sync_debug_mode("error");
  - decode throughput at a few batch sizes: the time of `max_tokens` tokens minus that of one (the prefill),
    per decoded token;
  - the same with enforce_eager=True (no CUDA graphs): its greedy tokens against the graphs', token for token, and
    for both, a decode step's parts as the engine times them (benchmarks/host_time.py) against the memory floor: the
    step's bytes (weights, LM head, K/V) read once at the rate this GPU reads memory.

    python benchmarks/gpu_engine_check.py                      # every architecture below (needs CUDA)
    python benchmarks/gpu_engine_check.py --archs smollm2-135m --batch-sizes 1,32
    python benchmarks/gpu_engine_check.py --dry                # tiny shapes, fp32 (no GPU: in the interpreter)

A new architecture is one more entry in ARCHITECTURES: its model_type and the config settings of its shape.
"""

import argparse
import statistics
import sys
import time

import torch

# name -> model_type and config settings (the shapes of the published configs; the weights are random)
ARCHITECTURES = {
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
DRY_ARCHITECTURE = dict(
    model_type="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def parse_args(argv):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--archs",
        type=lambda s: s.split(","),
        default=list(ARCHITECTURES),
        help=f"comma-separated, from {list(ARCHITECTURES)}",
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts compared with transformers")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 64])
    p.add_argument(
        "--dry",
        action="store_true",
        help="tiny shapes in float32, on the GPU if there is one, else in Triton's interpreter on the CPU",
    )
    args = p.parse_args(argv)
    unknown = [a for a in args.archs if a not in ARCHITECTURES]
    if unknown:
        p.error(f"unknown architecture(s) {unknown}; known: {list(ARCHITECTURES)}")
    if args.dry:
        args.archs, args.prompts, args.prompt_len, args.new_tokens, args.batch_sizes = ["dry"], 2, 8, 4, [1, 2]
    return args


def build_model(name, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(DRY_ARCHITECTURE if name == "dry" else ARCHITECTURES[name])
    config = AutoConfig.for_model(
        settings.pop("model_type"), **settings, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B model in seconds, not minutes
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int):
    """transformers' greedy tokens, and its fp32 logits [new_tokens, vocab] at each position. Each step runs the
    whole sequence again, without a cache: slower, but the same call in every transformers version."""
    ids = torch.tensor([prompt], device=model.device)  # [1, len]
    logits = []
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits.append(model(input_ids=ids, use_cache=False).logits[0, -1].float())
            ids = torch.cat([ids, logits[-1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist(), torch.stack(logits)


def engine_tokens(llm, args, vocab) -> list[list[int]]:
    """The engine's greedy tokens for a batch of random prompts of several lengths (decode batches of every size)."""
    from paged import SamplingParams

    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, vocab, (args.prompt_len // (1 + i % 3),), generator=generator).tolist()
        for i in range(max(args.batch_sizes))
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + i % args.new_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def compare(model, llm, args, vocab):
    from paged import SamplingParams

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    gaps = []
    for i, (prompt, engine_tokens) in enumerate(zip(prompts, ours)):
        reference, logits = hf_greedy(model, prompt, args.new_tokens)
        top2 = logits.topk(2, dim=-1).values  # [new_tokens, 2]
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        agree = next((j for j, (a, b) in enumerate(zip(engine_tokens, reference)) if a != b), len(reference))
        line = f"  prompt {i}: {agree}/{len(reference)} greedy tokens agree"
        if agree < len(reference):
            margin = float(logits[agree, reference[agree]] - logits[agree, engine_tokens[agree]])
            line += f"; first difference at token {agree}, transformers' logit margin there {margin:.4f}"
        print(line)
    print(f"  median top-1 / top-2 logit gap over all positions: {statistics.median(gaps):.4f}")


def forward_syncs(llm, prompt_len: int) -> str:
    """Run one prefill and one decode step with CUDA's sync debug mode set to raise inside the forward pass."""
    from paged import SamplingParams

    if not torch.cuda.is_available():
        return "not checked (no CUDA)"
    engine, forward = llm.engine, llm.engine.model.forward

    def strict_forward(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.model.forward = strict_forward
    try:
        llm.generate(
            [list(range(1, prompt_len + 1))],
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
        return "none (prefill and decode ran under set_sync_debug_mode('error'))"
    except RuntimeError as error:
        return f"YES: {str(error).splitlines()[0]}"
    finally:
        engine.model.forward = forward


def timed_generate(llm, prompts, max_tokens, device) -> float:
    from paged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def step_parts(llm, args, bandwidth):
    """A decode step's host parts and its memory floor at each batch size (benchmarks/host_time.py)."""
    from paged.analysis.host_time import PARTS, decode_step_times

    for batch in args.batch_sizes:
        r = decode_step_times(llm.engine, batch, args.prompt_len, 10)
        floor = r["bytes"] / bandwidth
        print(
            f"    batch {batch:4d}: step {r['step_s'] * 1e3:7.2f} ms ("
            + ", ".join(f"{part} {r[part + '_s'] * 1e3:.2f}" for part in PARTS)
            + f"); memory floor {floor * 1e3:.2f} ms = "
            f"{floor / r['step_s']:.0%} of the step"
        )


def throughput(llm, args, vocab, device):
    print(
        f"  decode throughput (prompt {args.prompt_len} tokens, {args.new_tokens} new tokens; "
        f"time of {args.new_tokens} tokens minus time of 1, per decoded token):"
    )
    for batch in args.batch_sizes:
        prompts = [[(7 * b + t) % vocab for t in range(args.prompt_len)] for b in range(batch)]
        timed_generate(llm, prompts, 2, device)  # compile, warm up
        prefill = timed_generate(llm, prompts, 1, device)
        total = timed_generate(llm, prompts, args.new_tokens, device)
        decoded = batch * (args.new_tokens - 1)
        step_ms = 1e3 * (total - prefill) / (args.new_tokens - 1)
        print(
            f"    batch {batch:4d}: {decoded / (total - prefill):10.1f} tok/s, {step_ms:7.2f} ms per decode step, "
            f"prefill {1e3 * prefill:8.1f} ms"
        )


def main(argv=None):
    args = parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        sys.exit("gpu_engine_check.py needs CUDA; none is available here. Run it with --dry for a tiny CPU check.")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.dry else torch.bfloat16  # the interpreter has no bf16 dot
    from paged import LLM
    from paged.analysis.parallel_cost import measure_read_bandwidth

    bandwidth = measure_read_bandwidth(device=device)
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (Triton interpreter)'}, "
        f"torch {torch.__version__}, dtype {dtype}, attention_backend 'triton'; memory read at "
        f"{bandwidth / 1e9:.0f} GB/s"
    )
    for name in args.archs:
        start = time.perf_counter()
        model = build_model(name, device, dtype)
        config = model.config
        print(
            f"\n{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, heads "
            f"{config.num_attention_heads}/{config.num_key_value_heads}, head_dim {config.head_dim}, "
            f"vocab {config.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters"
        )
        longest = max(args.batch_sizes + [args.prompts])
        block_size = 16
        blocks_per_seq = -(-(args.prompt_len + args.new_tokens) // block_size)
        tokens = {}
        for mode in ("graphs", "eager"):
            llm = LLM(
                model=model,
                device=device,
                dtype=dtype,
                attention_backend="triton",
                block_size=block_size,
                num_blocks=longest * blocks_per_seq + 8,
                max_num_seqs=longest,
                max_num_batched_tokens=max(2048, longest * args.prompt_len),
                enforce_eager=mode == "eager",
            )
            captured = (
                llm.engine.model_runner.decode_graphs is not None and llm.engine.model_runner.decode_graphs.graphs
            )
            print(f"  -- {mode}: decode CUDA graphs {'captured' if captured else 'not captured'}")
            if mode == "graphs":
                compare(model, llm, args, config.vocab_size)
                print(f"  host syncs inside the forward pass: {forward_syncs(llm, args.prompt_len)}")
            tokens[mode] = engine_tokens(llm, args, config.vocab_size)
            throughput(llm, args, config.vocab_size, device)
            step_parts(llm, args, bandwidth)
            del llm
        same = sum(a == b for a, b in zip(tokens["graphs"], tokens["eager"]))
        print(f"  greedy tokens with graphs = eager: {same} of {len(tokens['eager'])} prompts")
        print(f"  ({time.perf_counter() - start:.0f} s for {name})")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
