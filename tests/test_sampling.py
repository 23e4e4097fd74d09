"""The sampler's filters against transformers' logits warpers, composed in vLLM V1's order (temperature, min-p,
top-k, top-p over what top-k left), on the same logits; and what LLM.generate samples on the real model."""

import itertools

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm, random_prompts
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from paged import LLM, SamplingParams
from paged.engine.sampler import filter_logits, filter_params, inverse_cdf_tokens, sample
from paged.model.loader import chat_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPERATURES = [0.5, 1.0, 1.5]
TOP_KS = [0, 1, 3, 50]
TOP_PS = [0.3, 0.9, 1.0]
MIN_PS = [0.0, 0.05, 0.3]
SETTINGS = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS, MIN_PS))


def warped_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """transformers' warpers in vLLM's order; a filter that is off is left out, as transformers' generate does."""
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [MinPLogitsWarper(min_p)] if min_p > 0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    scores = logits.clone()
    for warp in warpers:
        scores = warp(None, scores)
    return scores.softmax(dim=-1)


@pytest.fixture(scope="module")
def real_logits(smollm2):
    """Next-token logits [4, vocab] of SmolLM2 after four chat prompts: peaked and flat rows alike."""
    model, tokenizer = smollm2
    prompts = [chat_prompt(tokenizer, q) for q in ("Write one word.", "What is 2+2?", "Tell me a story.", "Hi")]
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            rows.append(model(ids).logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("logits_source", ["random", "smollm2"])
def test_filtered_distribution_equals_transformers_warpers(logits_source, request):
    if logits_source == "random":
        logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
        logits[0, :7] = logits[0, 7]  # ties at the k-th largest: top-k keeps them all, in both
    else:
        logits = request.getfixturevalue("real_logits")
    rows = len(logits)
    for temperature, top_k, top_p, min_p in SETTINGS:
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * rows
        ours = filter_logits(logits, *filter_params(params, logits.shape[-1], logits.device))
        oracle = warped_probs(logits, temperature, top_k, top_p, min_p)
        assert torch.equal(ours > 0, oracle > 0), (temperature, top_k, top_p, min_p)
        assert (ours - oracle).abs().max().item() <= 1e-6, (temperature, top_k, top_p, min_p)


def test_one_batch_of_mixed_settings_filters_each_row_by_its_own(real_logits):
    """Rows of one call with different settings (some filters off) get what each would get alone."""
    settings = SETTINGS[::5]
    logits = real_logits[torch.arange(len(settings)) % len(real_logits)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    ours = filter_logits(logits, *filter_params(params, logits.shape[-1], logits.device))
    for row, (temperature, top_k, top_p, min_p) in enumerate(settings):
        oracle = warped_probs(logits[row : row + 1], temperature, top_k, top_p, min_p)[0]
        assert torch.equal(ours[row] > 0, oracle > 0)
        assert (ours[row] - oracle).abs().max().item() <= 1e-6


def test_disabled_filters_change_no_probability(real_logits):
    """top_p=1, top_k=0 or -1 and min_p=0 keep every token at exactly the probability of the plain softmax, alone
    and in a batch where other rows filter."""
    plain = (real_logits / 0.7).softmax(dim=-1)
    for top_k in (0, -1):
        params = [SamplingParams(temperature=0.7, top_k=top_k, top_p=1.0, min_p=0.0)] * len(real_logits)
        alone = filter_logits(real_logits, *filter_params(params, real_logits.shape[-1], "cpu"))
        assert torch.equal(alone, plain)
    mixed = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1)] * 2
    batched = filter_logits(real_logits, *filter_params(mixed, real_logits.shape[-1], "cpu"))
    assert torch.equal(batched[0], plain[0]) and torch.equal(batched[2], plain[2])
    assert (batched[0] > 0).sum().item() == real_logits.shape[-1]  # no token of the vocabulary is left out


def test_sampled_tokens_stay_in_the_oracles_support(real_logits):
    """sample() draws only tokens the warpers allow, for every setting, with a seed and without."""
    for temperature, top_k, top_p, min_p in SETTINGS[::4]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        allowed = warped_probs(real_logits, temperature, top_k, top_p, min_p) > 0
        default = torch.Generator().manual_seed(1)
        for seed in range(8):
            seeded = [torch.Generator().manual_seed(seed) if row % 2 else None for row in range(len(real_logits))]
            tokens = sample(real_logits, [params] * len(real_logits), seeded, default)
            assert all(allowed[row, token] for row, token in enumerate(tokens))


def test_generate_samples_within_vllms_set(smollm2):
    """Through LLM.generate on SmolLM2: with top_k=50 and top_p=0.3 at T=1.5 every first token is one the oracle
    allows (top-p over the renormalised top 50), in 32 seeded samples."""
    model, tokenizer = smollm2
    prompt = chat_prompt(tokenizer, "Write one word.")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()
    allowed = set((warped_probs(logits, 1.5, 50, 0.3, 0.0)[0] > 0).nonzero()[:, 0].tolist())
    llm = LLM(
        model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, num_blocks=64, enable_prefix_caching=True
    )
    outs = llm.generate(
        [prompt] * 32,
        [SamplingParams(temperature=1.5, top_k=50, top_p=0.3, max_tokens=1, seed=s) for s in range(32)],
        use_tqdm=False,
    )
    first = [out.outputs[0].token_ids[0] for out in outs]
    assert set(first) <= allowed and len(allowed) < 50
    assert_pool_empty(llm)


def test_min_p_reaches_the_engine(tiny_model):
    """min_p=1 keeps only the most likely token: sampling at any temperature gives the greedy text."""
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    prompts = random_prompts(3, seed=5)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(
        prompts, SamplingParams(temperature=2.0, min_p=1.0, max_tokens=8, ignore_eos=True, seed=3), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy]


@pytest.mark.parametrize("vocab", [5, 1000, 49152])
def test_unseeded_draws_follow_the_probabilities(vocab):
    """inverse_cdf_tokens over many rows of one distribution, tokens grouped into bins of about equal probability
    (each likely token a bin of its own): Pearson's chi-square over the bins under its 1e-6 quantile (a fixed seed,
    so the check is exact; a wrong sampler is off by far more), and a token of probability zero never drawn, the first
    and the last of the vocabulary among them."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=generator) * 2
    logits[0] = logits[-1] = logits[vocab // 2] = float("-inf")
    probs = logits.softmax(-1)
    rows = 40_000
    tokens = inverse_cdf_tokens(probs.expand(rows, vocab), generator)
    counts = torch.bincount(tokens, minlength=vocab).double()  # [vocab]
    assert counts[0] == counts[-1] == counts[vocab // 2] == 0
    order = probs.argsort(descending=True)
    bins = (probs[order].double().cumsum(0) * 20).ceil().clamp(max=20).long()  # [vocab]: bin 1..20 by mass
    observed = torch.zeros(21, dtype=torch.float64).index_add_(0, bins, counts[order])[1:]
    expected = torch.zeros(21, dtype=torch.float64).index_add_(0, bins, rows * probs[order].double())[1:]
    used = expected > 0
    chi_square = float(((observed[used] - expected[used]) ** 2 / expected[used]).sum())
    assert chi_square < 63.7  # the chi-square distribution's 1 - 1e-6 quantile at 19 degrees of freedom


def test_each_row_of_a_mixed_batch_draws_what_it_draws_alone(real_logits):
    """A batch of greedy, unseeded and seeded rows: a greedy row gets its argmax, a seeded row the token its seed
    gives it alone, and the unseeded rows the tokens one shared draw over just those rows gives (the same generator
    state); the whole batch unseeded and sampled alike draws as those rows do."""
    greedy, unseeded = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=50)
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=3)
    logits = torch.cat([real_logits, real_logits.flip(0)])  # [8, vocab]
    params = [greedy, unseeded, seeded, unseeded, greedy, seeded, unseeded, unseeded]
    generators = [
        torch.Generator().manual_seed(3 + row) if p.seed is not None else None for row, p in enumerate(params)
    ]
    tokens = sample(logits, params, generators, torch.Generator().manual_seed(5))
    assert [tokens[row] for row in (0, 4)] == logits[[0, 4]].argmax(dim=-1).tolist()
    for row in (2, 5):
        alone = sample(logits[row : row + 1], [seeded], [torch.Generator().manual_seed(3 + row)], torch.Generator())
        assert tokens[row] == alone[0]
    shared_rows = [1, 3, 6, 7]
    alike = sample(logits[shared_rows], [unseeded] * 4, [None] * 4, torch.Generator().manual_seed(5))
    assert [tokens[row] for row in shared_rows] == alike
