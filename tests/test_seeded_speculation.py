"""A seeded request's tokens depend on its prompt and seed alone (guide §14): not on the pool, the batch, or
speculation.

Position p of a seeded completion is drawn with noise that is a function of (seed + index, p), so a verify that
keeps fewer drafts (pool pressure trims or drops them), a preemption, other requests beside it, or no speculation at
all give the same tokens. Checked on the tiny random Llama, with prompt lookup and with draft models."""

import pytest
import torch
from helpers import make_tiny_llm, random_prompts
from test_rejection_sampler import DRAWS, chi_square_p, random_distributions

from paged import SamplingParams
from paged.engine.rejection_sampler import seeded_accept
from paged.engine.sampler import exponential_noise, sample, seeded_token

K = 3
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)


def looping_prompt(seed: int) -> list[int]:
    """A prompt that repeats a phrase, so prompt lookup has something to find."""
    p = random_prompts(1, seed=seed, low=6, high=12)[0]
    return p + p + p[:4]


def spec_config(model, method: str) -> dict | None:
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": K},
        "draft=target": {"method": "draft_model", "model": model, "num_speculative_tokens": K},
        "early-exit": {"method": "draft_model", "model": model, "num_speculative_tokens": K, "draft_layers": 1},
    }[method]


def alone(model, prompt: list[int], params: SamplingParams, method: str, **engine) -> list[list[int]]:
    """Each completion's tokens, the request alone in a pool with room to spare."""
    engine = {"num_blocks": 128, **engine}
    llm = make_tiny_llm(model, speculative_config=spec_config(model, method), **engine)
    return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


def crowded(model, prompt: list[int], params: SamplingParams, method: str) -> tuple[list[list[int]], dict]:
    """Each completion's tokens with eight other requests beside it in a pool too small for them all, and what the
    pressure did: preemptions (of any sequence, and of the request's own), and the request's drafts: proposed, and
    cut by the scheduler (budget or pool short) or thrown away by a preemption."""
    llm = make_tiny_llm(
        model,
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        enable_chunked_prefill=True,
        speculative_config=spec_config(model, method),
    )
    engine = llm.engine
    pressure = {"preemptions": 0, "own_preemptions": 0, "drafts_proposed": 0, "drafts_cut": 0}
    schedule = engine.scheduler.schedule

    def schedule_and_count():
        proposed = {
            seq: len(seq.spec_token_ids) for seq in engine.scheduler.running if seq.request.request_id == target
        }
        plan = schedule()
        scheduled = {seq for seq, _ in plan.scheduled}
        pressure["preemptions"] += len(plan.preempted)
        pressure["drafts_proposed"] += sum(proposed.values())
        pressure["own_preemptions"] += sum(seq.request.request_id == target for seq in plan.preempted)
        pressure["drafts_cut"] += sum(
            n - (len(seq.spec_token_ids) if seq in scheduled else 0) for seq, n in proposed.items()
        )
        return plan

    engine.scheduler.schedule = schedule_and_count
    others = [looping_prompt(s) for s in range(50, 54)] + random_prompts(4, seed=55, low=10, high=30)
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=s if s % 2 else None)
        for s in range(len(others))
    ]
    for p, sp in zip(others[:4], other_params[:4]):
        engine.add_request(engine.make_request(p, sp))
    target = engine.add_request(engine.make_request(prompt, params))
    for p, sp in zip(others[4:], other_params[4:]):
        engine.add_request(engine.make_request(p, sp))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return [c.token_ids for c in outputs[target].outputs], pressure


@pytest.mark.parametrize("method", ["ngram", "draft=target", "early-exit"])
def test_a_seeded_request_gives_the_same_tokens_alone_crowded_and_without_speculation(tiny_model, method):
    prompt = looping_prompt(40)
    expected = alone(tiny_model, prompt, SEEDED, "none")
    assert alone(tiny_model, prompt, SEEDED, method) == expected
    tokens, pressure = crowded(tiny_model, prompt, SEEDED, method)
    assert pressure["own_preemptions"] > 0 and pressure["drafts_proposed"] > 0  # the pool really was short
    assert pressure["drafts_cut"] > 0 or method == "ngram"  # a random model seldom repeats: few lookups hit
    assert tokens == expected
    assert crowded(tiny_model, prompt, SEEDED, "none")[0] == expected


@pytest.mark.parametrize("method", ["ngram", "early-exit"])
def test_parallel_seeded_completions_keep_their_tokens_under_pressure(tiny_model, method):
    """n = 2: completion i draws from seed + i, with or without speculation, alone or crowded."""
    params = SamplingParams(n=2, temperature=1.0, top_k=40, seed=3, max_tokens=16, ignore_eos=True)
    prompt = looping_prompt(41)
    expected = alone(tiny_model, prompt, params, "none")
    assert expected[0] != expected[1]
    assert alone(tiny_model, prompt, params, method) == expected
    tokens, pressure = crowded(tiny_model, prompt, params, method)
    assert pressure["own_preemptions"] > 0 and pressure["drafts_proposed"] > 0
    assert pressure["drafts_cut"] > 0 or method == "ngram"
    assert tokens == expected


@pytest.mark.parametrize("block_size,num_blocks", [(2, 96), (4, 40), (16, 12)])
def test_seeded_tokens_do_not_depend_on_block_size_or_pool_size(tiny_model, block_size, num_blocks):
    prompt = looping_prompt(42)
    expected = alone(tiny_model, prompt, SEEDED, "none")
    assert alone(tiny_model, prompt, SEEDED, "early-exit", block_size=block_size, num_blocks=num_blocks) == expected


def test_draft_equal_to_target_keeps_every_seeded_draft(tiny_model):
    """Coupled drafting: a draft model samples its own distribution with the noise the target will use at each
    position, so a draft that is the target proposes exactly the tokens the target then picks (with noise of its
    own, a draft would be kept only where two independent draws agree)."""
    llm = make_tiny_llm(tiny_model, num_blocks=128, speculative_config=spec_config(tiny_model, "draft=target"))
    llm.generate([looping_prompt(s) for s in range(43, 47)], SEEDED, use_tqdm=False)
    stats = llm.spec_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]


def test_the_seeded_draw_is_torch_multinomials():
    """seeded_token over exponential_noise draws what torch.multinomial(probs, 1) draws from the same generator,
    one position after another: seeded sampling's tokens are the ones it gave before it was keyed by position."""
    probs = random_distributions(6, 300, seed=7, sparse=True)  # [positions, vocab]
    for seed in range(20):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for row in probs:
            assert seeded_token(row, exponential_noise(row, ours)) == int(torch.multinomial(row, 1, generator=theirs))


def test_seeded_tokens_follow_the_distribution_over_seeds():
    """Over many seeds, the keyed draw at a position is distributed as the filtered softmax (chi-square)."""
    p = random_distributions(1, 6, seed=1, sparse=True)[0]  # [vocab]
    counts = torch.zeros(6)
    for seed in range(DRAWS):
        counts[seeded_token(p, exponential_noise(p, torch.Generator().manual_seed(seed)))] += 1
    assert chi_square_p(counts, p) > 1e-3


def test_seeded_verify_emits_what_plain_sampling_would_and_follows_the_target():
    """seeded_accept keeps the drafts that equal the keyed draw at their position, then adds the keyed draw: the
    tokens are plain sampling's whatever the drafts, and over many seeds each position follows the target."""
    p = random_distributions(3, 6, seed=1, sparse=True)  # [k + 1, vocab]
    first, second = torch.zeros(6), torch.zeros(6)
    for seed in range(DRAWS // 4):
        plain = torch.Generator().manual_seed(seed)
        expected = [int(torch.multinomial(row, 1, generator=plain)) for row in p]
        for drafts in ([], expected[:2], [expected[0], (expected[1] + 1) % 6], [(expected[0] + 1) % 6, 0]):
            tokens = seeded_accept(p, drafts, torch.Generator().manual_seed(seed))
            assert tokens == expected[: len(tokens)]
            assert tokens[:-1] == drafts[: len(tokens) - 1] and len(tokens) <= len(drafts) + 1
        first[expected[0]] += 1
        second[expected[1]] += 1
    assert chi_square_p(first, p[0]) > 1e-3 and chi_square_p(second, p[1]) > 1e-3


def test_a_seeded_verify_draws_one_noise_per_emitted_token():
    """The generator moves on by as many positions as tokens are appended, so the next step's draw is the next
    position's, whatever was rejected."""
    p = random_distributions(4, 6, seed=2)  # [k + 1, vocab]
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        tokens = seeded_accept(p, [0, 1, 2], generator)
        reference = torch.Generator().manual_seed(seed)
        for row in p[: len(tokens)]:
            exponential_noise(row, reference)
        assert torch.equal(generator.get_state(), reference.get_state())


def test_sample_draws_seeded_rows_by_the_keyed_draw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 2  # [rows, vocab]
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    generators = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    tokens = sample(logits, params, generators, torch.Generator().manual_seed(0))
    for row, seed in enumerate((1, 2, 3)):
        probs = logits[row].softmax(-1)
        assert tokens[row] == seeded_token(probs, exponential_noise(probs, torch.Generator().manual_seed(seed)))
