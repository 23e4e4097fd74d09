"""Verification is lossless: the rejection sampler's tokens are distributed exactly as the target's, checked by
chi-square tests over many seeded draws; and on the tiny Llama, sampling with speculation matches sampling without
(in distribution, and token for token with a seed)."""

from collections import Counter

import pytest
import torch
from helpers import make_tiny_llm, random_prompts

from paged import SamplingParams
from paged.engine.rejection_sampler import greedy_accept, rejection_sample

DRAWS = 20_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts [V] under probabilities probs [V] (categories with probability 0 must be empty)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def two_sample_p(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value that two samples of categories come from one distribution (rare categories pooled)."""
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= min_count]
    rows = torch.tensor(
        [
            [a[k] for k in common] + [sum(a[k] for k in keys if k not in common)],
            [b[k] for k in common] + [sum(b[k] for k in keys if k not in common)],
        ],
        dtype=torch.float64,
    )
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
    statistic = ((rows - expected) ** 2 / expected).sum()
    dof = rows.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def random_distributions(rows: int, vocab: int, seed: int, sparse: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 1.5
    if sparse:  # some tokens impossible, as after top-k / top-p
        logits[torch.rand(rows, vocab, generator=generator) < 0.3] = float("-inf")
        logits[:, 0] = 0.0
    return logits.softmax(-1)


def emitted(p: torch.Tensor, q: torch.Tensor | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second one when the first draft was kept."""
    k, vocab = p.shape[0] - 1, p.shape[1]
    generator = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    fixed = torch.multinomial(p[:k], 1, generator=generator)[:, 0].tolist()  # a one-hot proposer's fixed guess
    for _ in range(DRAWS):
        drafts = fixed if q is None else torch.multinomial(q, 1, generator=generator)[:, 0].tolist()
        tokens = rejection_sample(p, drafts, q, generator)
        assert 1 <= len(tokens) <= k + 1 and tokens[:-1] == drafts[: len(tokens) - 1]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("proposer", ["draft", "one-hot"])
def test_emitted_tokens_follow_the_target_distribution(proposer, sparse):
    p = random_distributions(3, 6, seed=1, sparse=sparse)  # [k + 1, vocab]: the target at 3 positions
    q = None if proposer == "one-hot" else random_distributions(2, 6, seed=2, sparse=sparse)
    first, second = emitted(p, q, seed=3)
    assert chi_square_p(first, p[0]) > 1e-3
    assert chi_square_p(second, p[1]) > 1e-3  # given the first draft kept, the next token follows p_1
    assert 0 < second.sum() < DRAWS  # some drafts kept, some rejected


def test_the_chi_square_check_catches_a_sampler_that_keeps_every_draft():
    """The same check has power: keeping the drafts unconditionally gives q's distribution, not p's."""
    p, q = random_distributions(2, 6, seed=1)[:1], random_distributions(1, 6, seed=2)
    generator = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.multinomial(q[0], DRAWS, replacement=True, generator=generator), minlength=6)
    assert chi_square_p(counts.double(), p[0]) < 1e-6


def test_a_draft_equal_to_the_target_is_always_kept():
    p = random_distributions(4, 8, seed=5)
    generator = torch.Generator().manual_seed(6)
    for _ in range(200):
        drafts = torch.multinomial(p[:3], 1, generator=generator)[:, 0].tolist()
        assert rejection_sample(p, drafts, p[:3], generator)[:3] == drafts


def test_greedy_accepts_the_longest_matching_prefix_and_one_more():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus the bonus token
    assert greedy_accept([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the target's own token at the first miss
    assert greedy_accept([5, 6], [4]) == [5]
    assert greedy_accept([5], []) == [5]


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1},
    ],
)
def test_sampled_tokens_with_and_without_speculation_agree(tiny_model, config):
    """Unseeded, the second and third sampled tokens of one prompt (drawn through rejection sampling with
    speculation on) have the same distribution with and without speculation, over 400 completions each. Seeded,
    they are the same tokens: a seeded verify emits plain seeded sampling's token at every position."""
    if config["method"] == "draft_model":
        config = {**config, "model": tiny_model}
    prompt = [p for p in random_prompts(1, seed=30, low=8, high=9)[0]] * 2
    settings = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02, max_tokens=4, ignore_eos=True)
    plain = make_tiny_llm(tiny_model, num_blocks=512, max_num_seqs=64)
    spec = make_tiny_llm(tiny_model, num_blocks=512, max_num_seqs=64, speculative_config=config)
    without = plain.generate([prompt] * 400, SamplingParams(**settings), use_tqdm=False)
    with_spec = spec.generate([prompt] * 400, SamplingParams(**settings), use_tqdm=False)
    assert spec.spec_stats()["num_draft_tokens"] > 0
    for position in (1, 2):
        a = Counter(o.outputs[0].token_ids[position] for o in without)
        b = Counter(o.outputs[0].token_ids[position] for o in with_spec)
        assert two_sample_p(a, b) > 1e-3
    seeded = [SamplingParams(**settings, seed=s) for s in range(100)]
    num_drafts = spec.spec_stats()["num_draft_tokens"]
    without = plain.generate([prompt] * len(seeded), seeded, use_tqdm=False)
    with_spec = spec.generate([prompt] * len(seeded), seeded, use_tqdm=False)
    assert spec.spec_stats()["num_draft_tokens"] > num_drafts
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_spec]
