"""Tensor parallelism on GPUs (guide §1, §15): one engine at tensor_parallel_size=2 against one at 1, on a random
Llama-3-8B-shaped model (its layers cut to fit the time), where the machine has two CUDA devices; skipped, saying so,
where it has fewer.

  - greedy tokens in fp32: tp=2 against tp=1, prompt by prompt: positions equal before the first difference, and
    tp=1's logit margin there (an all-reduce adds the ranks' partial sums in another order; a difference at a margin
    of fp32 rounding is a near-tie, not a bug);
  - decode throughput in bf16 at a few batch sizes, tp=1 and tp=2: the time of `max_tokens` tokens minus that of one
    (the prefill), per decoded token.

    python benchmarks/tp_check.py            # needs two CUDA devices
    python benchmarks/tp_check.py --dry      # two gloo ranks on the CPU, a tiny model (checks the script)
"""

import argparse
import sys
import tempfile
import time

import torch

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def random_llama(settings: dict, dtype: torch.dtype, folder) -> str:
    """A random Llama saved as a checkpoint folder: every rank reads its shard from it (a model object would be
    pickled to each worker whole)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**settings)).to(dtype).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(settings["vocab_size"])}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(folder)  # one word per id
    return str(folder)


def greedy(llm, prompts, max_tokens):
    from paged import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def decode_rate(llm, batch: int, prompt_len: int, max_tokens: int) -> float:
    """Decoded tokens per second at `batch` sequences: (time of max_tokens) - (time of 1), over the tokens between."""
    from paged import SamplingParams

    prompts = [[(7 * i + j) % 200 + 1 for j in range(prompt_len)] for i in range(batch)]

    def timed(tokens):
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - started

    return batch * (max_tokens - 1) / (timed(max_tokens) - timed(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("--batch-sizes", default="1,16,64")
    args = parser.parse_args(argv)
    from paged import LLM

    if args.dry:
        device, settings, batches, prompt_len, new = "cpu", TINY, [1, 4], 16, 8
    else:
        if torch.cuda.device_count() < 2:
            print(f"tensor parallelism: skipped, {torch.cuda.device_count()} CUDA device(s) (it needs two)")
            return 0
        device, settings, batches, prompt_len, new = (
            "cuda",
            LLAMA3_8B,
            [int(b) for b in args.batch_sizes.split(",")],
            512,
            32,
        )
    prompts = [[(11 * i + j) % 200 + 1 for j in range(64)] for i in range(4)]
    engine = dict(device=device, num_blocks=1024, block_size=16)
    print(
        f"model: Llama-3-8B-shaped, random weights (fp32: 2 layers; bf16: {settings['num_hidden_layers']})"
        if not args.dry
        else "model: tiny random Llama, two gloo ranks on the CPU"
    )
    scratch = tempfile.TemporaryDirectory()
    model = random_llama({**settings, "num_hidden_layers": 2}, torch.float32, f"{scratch.name}/fp32")
    one = greedy(LLM(model=model, dtype=torch.float32, **engine), prompts, new)
    two_llm = LLM(model=model, dtype=torch.float32, tensor_parallel_size=2, **engine)
    two = greedy(two_llm, prompts, new)
    two_llm.shutdown()
    for i, (a, b) in enumerate(zip(one, two)):
        at = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if at is None:
            print(f"fp32 prompt {i}: tp=2 = tp=1, all {len(a.token_ids)} tokens")
        else:
            top = sorted((e.logprob for e in a.logprobs[at].values()), reverse=True)
            print(
                f"fp32 prompt {i}: equal for {at} tokens, then parts where tp=1's top two log-probs are "
                f"{top[0] - top[1]:.2e} apart"
            )
    dtype = torch.float32 if args.dry else torch.bfloat16
    model = random_llama(settings, dtype, f"{scratch.name}/{dtype}")
    for size in (1, 2):
        llm = LLM(model=model, dtype=dtype, tensor_parallel_size=size, **engine)
        rates = {b: decode_rate(llm, b, prompt_len, new) for b in batches}
        print(
            f"{str(dtype).split('.')[-1]} decode, tensor_parallel_size={size}: "
            + ", ".join(f"{rate:.0f} tok/s at batch {b}" for b, rate in rates.items())
        )
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
