"""A ShareGPT-format file with ShareGPT-like lengths, for vLLM's benchmark client (`--dataset-name sharegpt`).

    python benchmarks/sharegpt_like.py --tokenizer MODEL_DIR --out benchmarks/results/sharegpt_like.json

This is NOT ShareGPT: there is no network here, and the project ships no data. It is a list of
{"id", "conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]} whose prompt and reply
lengths are those benchmarks/serve_bench.py draws (paged.analysis.load_client.make_requests: paged.analysis.traces' ShareGPT-like
log-normal lengths, clipped to --max-input-len and --max-output-len), and whose text is words of the model's
tokenizer, each one token both at the start of a text and after a space, so that the tokenizer cuts "w1 w2 ... wn"
into exactly n tokens. vLLM's sharegpt loader counts a prompt's tokens with the tokenizer (no special tokens are
added by SmolLM2's) and sends the reply's token count as max_tokens, so it sends the lengths drawn here; like the
real ShareGPT, it drops the conversations it filters (prompt or reply under 4 tokens, prompt over 1,024, both over
2,048), which the ShareGPT-like lengths rarely give. The file is checked against the tokenizer before it is written.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged.analysis.load_client import make_requests  # noqa: E402

MIN_WORD_LETTERS = 4  # shorter single tokens are mostly pieces of words ("equ", "lig")


def whole_words(tokenizer) -> list[str]:
    """Lower-case words of the vocabulary that are one token alone and one token after a space, sorted.

    A piece that begins a longer word of the vocabulary ("adequ" of "adequate", "pict" of "picture") is left out:
    most such pieces are not words, and the words left are enough (some 1,500 for SmolLM2)."""
    spaced_words = sorted(
        piece[1:]
        for piece in tokenizer.get_vocab()
        if piece.startswith("Ġ") and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower()
    )
    candidates = [
        w
        for w, after in zip(spaced_words, spaced_words[1:] + [""])  # sorted: a longer word follows
        if len(w) >= MIN_WORD_LETTERS and not after.startswith(w)
    ]
    alone = tokenizer(candidates, add_special_tokens=False).input_ids
    spaced = tokenizer([" " + w for w in candidates], add_special_tokens=False).input_ids
    return [w for w, a, s in zip(candidates, alone, spaced) if len(a) == 1 and len(s) == 1]


def drawn_lengths(num: int, seed: int, max_input_len: int, max_output_len: int) -> list[tuple[int, int]]:
    """(prompt, reply) tokens of each conversation: serve_bench.py's ShareGPT-like requests for this seed."""
    return [(len(r.prompt), r.max_tokens) for r in make_requests(num, "sharegpt", seed, max_input_len, max_output_len)]


def conversations(tokenizer, lengths: list[tuple[int, int]], seed: int) -> list[dict]:
    words = whole_words(tokenizer)
    rng = np.random.default_rng(seed)
    out = []
    for i, pair in enumerate(lengths):
        prompt, reply = (" ".join(rng.choice(words, n)) for n in pair)
        out.append(
            {
                "id": f"sharegpt-like-{seed}-{i}",
                "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}],
            }
        )
    return out


def check_lengths(tokenizer, data: list[dict], lengths: list[tuple[int, int]]) -> None:
    """Every text is as many tokens as drawn, counted as vLLM's loader counts them (tokenizer(text).input_ids)."""
    texts = [turn["value"] for entry in data for turn in entry["conversations"]]
    counted = [len(ids) for ids in tokenizer(texts).input_ids]
    drawn = [n for pair in lengths for n in pair]
    if counted != drawn:
        bad = next(i for i, (a, b) in enumerate(zip(counted, drawn)) if a != b)
        raise AssertionError(f"text {bad} is {counted[bad]} tokens, drawn {drawn[bad]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="the model folder whose tokenizer counts the lengths")
    parser.add_argument("--out", type=Path, required=True)
    # vLLM's client shuffles the file by its --seed and takes the first --num-prompts: with many conversations,
    # two runs rarely share a prompt (which the server would find in its prefix cache)
    parser.add_argument("--num-conversations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-input-len", type=int, default=512, help="as serve_bench.py is run by make bench-serve")
    parser.add_argument("--max-output-len", type=int, default=128)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lengths = drawn_lengths(args.num_conversations, args.seed, args.max_input_len, args.max_output_len)
    data = conversations(tokenizer, lengths, args.seed)
    check_lengths(tokenizer, data, lengths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data) + "\n")
    prompts, replies = np.mean(lengths, axis=0)
    print(
        f"{len(data)} ShareGPT-like conversations (not ShareGPT) in {args.out}: {prompts:.0f} prompt and "
        f"{replies:.0f} reply tokens on average"
    )


if __name__ == "__main__":
    main()
