"""The command line: `python -m paged demo | generate | serve | bench | setup`.

demo      answers a few chat prompts with SmolLM2 through the paged engine and shows where their K/V lived:
          each request's block table, the pool's occupancy, and the bytes paging used against naive reservation.
generate  answers your own prompts (chat template applied) and prints the text.
serve     an OpenAI-compatible HTTP server on 127.0.0.1:8000 (paged/serving/api_server.py; --help for its options).
          All three take --model: a checkpoint folder or a model in the local Hugging Face cache (Llama,
          Mistral, Qwen2, Qwen3) instead of SmolLM2.
worker    one rank of a tensor-parallel engine on another machine, started as torchrun starts a rank
          (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment); rank 0 runs
          `serve --tensor-parallel-size WORLD_SIZE` and sends it the model and every step.
bench     runs benchmarks/throughput.py from the repository checkout (arguments pass through).
setup     converts the bundled GGUF into the safetensors cache (done automatically on first use).
"""

import argparse
import sys
import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about paging in operating systems.",
    "Give me three tips for learning a new language.",
    "What is 12 times 12?",
    "Explain in two sentences why the sky is blue.",
]


def pool_map(num_blocks: int, owner_of_block: dict[int, str], width: int = 64) -> str:
    """One character per block: the owning request's letter, or '.' for a free block."""
    cells = [owner_of_block.get(b, ".") for b in range(num_blocks)]
    return "\n".join("    " + "".join(cells[i : i + width]) for i in range(0, num_blocks, width))


def run_demo(args) -> None:
    from paged import LLM, SamplingParams
    from paged.model.loader import chat_prompt

    started = time.perf_counter()
    llm = LLM(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks, device=args.device)
    engine = llm.engine
    manager = engine.block_manager
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    letters = {}
    for index, question in enumerate(DEMO_QUESTIONS):
        request_id = engine.add_request(engine.make_request(chat_prompt(llm.tokenizer, question), params))
        letters[request_id] = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[index]

    last_table, outputs, peak = {}, {}, (0, {}, 0)
    while engine.has_unfinished_requests():
        finished = engine.step()
        # Snapshot after the step: finished sequences have already given their blocks back.
        owners = {}
        for seq in engine.scheduler.running:
            rid = seq.request.request_id
            last_table[rid] = list(manager.block_tables[seq.seq_id])
            owners.update({b: letters[rid] for b in manager.block_tables[seq.seq_id]})
        for out in finished:
            outputs[out.request_id] = out
        live = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
        if len(owners) > len(peak[1]):
            peak = (engine.num_steps, owners, live)

    bytes_per_block = engine.kv_stats()["bytes_per_block"]
    bytes_per_token = bytes_per_block // manager.block_size
    name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model
    print(
        f"{name} on {engine.device}, {manager.num_blocks} blocks of {manager.block_size} tokens "
        f"({bytes_per_block / 2**10:.0f} KiB per block, {bytes_per_token:,} B per token)\n"
    )
    for request_id, out in outputs.items():
        completion = out.outputs[0]
        print(f"[{letters[request_id]}] {DEMO_QUESTIONS[int(request_id)]}")
        print(f"    -> {completion.text.strip()}")
        print(
            f"    {len(out.prompt_token_ids)} prompt + {len(completion.token_ids)} new tokens, "
            f"block table {last_table.get(request_id, [])}\n"
        )

    step, owners, live_tokens = peak
    used = len(owners)
    print(
        f"The pool at its fullest (step {step}): {used} of {manager.num_blocks} blocks in use, "
        f"one letter per request, '.' free"
    )
    print(pool_map(min(manager.num_blocks, max(owners, default=0) // 64 * 64 + 64), owners))
    paged_bytes = used * bytes_per_block
    naive_bytes = len(outputs) * (llm.engine.max_model_len * bytes_per_token)
    exact_bytes = sum(len(o.prompt_token_ids) + params.max_tokens for o in outputs.values()) * bytes_per_token
    print(f"\nKV memory at that moment: {live_tokens} live tokens = {live_tokens * bytes_per_token / 2**20:.1f} MiB")
    rows = [
        (f"paged, {used} blocks", paged_bytes),
        ("naive, prompt + max_tokens reserved per request", exact_bytes),
        (f"naive, max_model_len ({llm.engine.max_model_len}) reserved per request", naive_bytes),
    ]
    for label, size in rows:
        print(f"  {label:<55} {size / 2**20:8.1f} MiB")
    print(f"\nDone in {time.perf_counter() - started:.1f} s (model load included).")


def run_generate(args) -> None:
    from paged import LLM, SamplingParams
    from paged.model.loader import chat_prompt

    llm = LLM(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompts = [chat_prompt(llm.tokenizer, p) if not args.raw else p for p in args.prompts]
    for prompt, out in zip(args.prompts, llm.generate(prompts, params)):
        print(f"> {prompt}\n{out.outputs[0].text.strip()}\n")


def run_serve(args) -> None:
    from paged.serving.api_server import main as serve

    serve(args)


def run_bench(args) -> None:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing: the benchmarks live in the repository checkout")
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")


def run_worker(args) -> None:
    import os

    from paged.engine.multiproc_executor import TORCHRUN_VARIABLES, run_worker

    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(f"worker needs {', '.join(missing)} in the environment, as torchrun sets them")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < size:
        raise ValueError(f"RANK must be in [1, WORLD_SIZE) for a worker (rank 0 runs the engine), got {rank} of {size}")
    run_worker(rank, size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def run_setup(args) -> None:
    from paged.model.loader import convert_gguf_to_cache

    print(f"model cache: {convert_gguf_to_cache(force=args.force)}")


def main(argv=None) -> None:
    from paged.serving.api_server import server_defaults
    from paged.serving.token_budget import MAX_TOKEN_BUDGET, STEP_TARGET_S

    parser = argparse.ArgumentParser(
        prog="python -m paged", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler in [("demo", run_demo), ("generate", run_generate)]:
        command = commands.add_parser(name)
        command.set_defaults(handler=handler)
        command.add_argument("--block-size", type=int, default=16)
        command.add_argument("--num-blocks", type=int, default=1024)
        command.add_argument("--max-tokens", type=int, default=48)
        command.add_argument("--device", default=None)
        command.add_argument(
            "--model",
            default="smollm2",
            help="a checkpoint folder or a model in the local Hugging Face cache (default: smollm2)",
        )
    generate = commands.choices["generate"]
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server (see paged/serving/api_server.py)",
        description=(
            "An OpenAI-compatible server. Its engine settings are a server's own, as vllm serve's are, not LLM's "
            "offline defaults: every prompt is chunked under a token budget sized for this machine at start-up, so "
            "that no step keeps the streams waiting long (a step in which no stream decodes runs its first prompt whole: "
            "nobody waits on it); prefix caching is on; up to 128 sequences run at once."
        ),
    )
    serve.set_defaults(handler=run_serve)
    serve.add_argument(
        "--model",
        default="smollm2",
        help="a checkpoint folder or a model in the local Hugging Face cache (default: smollm2)",
    )
    serve.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="requests to /v1 must send 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--lora-modules", nargs="*", default=[], metavar="NAME=FOLDER", help="LoRA adapters served as models by name"
    )
    # A server's defaults are its own, as vllm serve's are: every prompt is chunked, under a token budget that keeps
    # each step short enough for the streams waiting on it, and prompts share cached blocks.
    defaults = server_defaults()
    serve.add_argument("--block-size", type=int, default=defaults["block_size"])
    serve.add_argument("--num-blocks", type=int, default=None, help="default: as many as 1 GiB of K/V holds")
    serve.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"])
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens one step computes at most (default: sized for this machine at start-up: "
        f"the most whole blocks of tokens whose step takes about {STEP_TARGET_S} s, "
        f"paged/serving/token_budget.py; then a step with no decode in it may run its first prompt whole, "
        f"up to {MAX_TOKEN_BUDGET} tokens. Set, it caps every step)",
    )
    serve.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=defaults["enable_chunked_prefill"],
        help="prompts longer than what is left of a step's budget run in chunks (default: on)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults["enable_prefix_caching"],
        help="requests share the K/V of a common prompt prefix (default: on)",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model across this many ranks: this process and workers it spawns, or the "
        "ranks a torchrun-style launcher started (`python -m paged worker`)",
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--device", default=None)
    serve.add_argument("--log-level", default="warning")
    bench = commands.add_parser("bench", help="throughput against transformers (see benchmarks/throughput.py)")
    bench.set_defaults(handler=run_bench)
    worker = commands.add_parser("worker", help="one rank of a tensor-parallel engine (torchrun's environment)")
    worker.set_defaults(handler=run_worker)
    setup = commands.add_parser("setup")
    setup.set_defaults(handler=run_setup)
    setup.add_argument("--force", action="store_true", help="convert again even if a cache exists")
    args, passed_through = parser.parse_known_args(argv)
    if passed_through and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(passed_through)}")
    args.bench_args = passed_through
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
