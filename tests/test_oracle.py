"""The oracle: greedy token ids from the paged engine equal transformers' `generate` on the same weights."""

import copy

import pytest
import torch
from helpers import assert_near_tie, assert_pool_empty, hf_greedy, make_tiny_llm, random_prompts, run_engine

from paged import SamplingParams

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    from paged import LLM

    model, tokenizer = smollm2
    return LLM(model=model, tokenizer=tokenizer, num_blocks=512, block_size=16, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_reference(smollm2, smollm2_llm, chat_prompts):
    """transformers' greedy continuation of each chat prompt, one prompt at a time, EOS ignored."""
    model, tokenizer = smollm2
    return [
        hf_greedy(model, tokenizer(p, add_special_tokens=False)["input_ids"], NEW_TOKENS, stop_at_eos=False)
        for p in chat_prompts
    ]


def test_smollm2_answers_paris(smollm2_llm, chat_prompts):
    out = smollm2_llm.generate(chat_prompts[0], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_eight_chat_prompts_together_match_transformers(smollm2_llm, chat_prompts, hf_reference):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = smollm2_llm.generate(chat_prompts, params, use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(chat_prompts)  # all lengths differ
    for out, expected in zip(outs, hf_reference):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert out.outputs[0].token_ids == expected
    assert_pool_empty(smollm2_llm)


def test_stopping_at_eos_matches_transformers(smollm2, smollm2_llm, chat_prompts):
    model, _ = smollm2
    outs = smollm2_llm.generate(chat_prompts[:3], SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 64)


def test_smollm2_in_bf16_equals_transformers_in_bf16_up_to_near_ties(smollm2, chat_prompts):
    """bf16 rounds differently along the engine's path (fused projections; on a CPU without bf16 matmuls, fp32
    products of the bf16 weights, model/packed_linear.py); where a token differs, transformers ranks both within a
    bf16-sized margin."""
    from paged import LLM

    model, tokenizer = smollm2
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(model=model16, tokenizer=tokenizer, num_blocks=256, device="cpu", dtype=torch.bfloat16)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in chat_prompts[:4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for index, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_near_tie(
            f"prompt {index}",
            model16,
            prompt,
            out.outputs[0].token_ids,
            hf_greedy(model16, prompt, 16, stop_at_eos=False),
        )
    assert_pool_empty(llm)


@pytest.mark.parametrize("block_size", [8, 32])
def test_tiny_model_matches_transformers_at_any_block_size(tiny_model, block_size):
    prompts = random_prompts(6, seed=1)
    llm = make_tiny_llm(tiny_model, block_size=block_size, num_blocks=512 // block_size * 4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 24, stop_at_eos=False)
    assert_pool_empty(llm)


def test_prefix_caching_chunked_prefill_and_preemption_keep_transformers_tokens(smollm2, chat_prompts, hf_reference):
    """All the serving machinery at once on the real model: shared chat-template blocks come from the prefix
    cache, prompts arrive in 32-token chunks, and a 48-block pool forces preemptions; tokens must not change."""
    from paged import LLM

    model, tokenizer = smollm2
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        num_blocks=48,
        block_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        device="cpu",
        dtype=torch.float32,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_engine(llm.engine, chat_prompts, params) == hf_reference
    stats = llm.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert_pool_empty(llm)


def test_swap_preemption_keeps_transformers_tokens(smollm2, chat_prompts, hf_reference):
    """Swap preemption (guide §15) on the real model: a 48-block pool swaps sequences out to a host tier and back;
    tokens must not change, and every swapped block comes back."""
    from paged import LLM

    model, tokenizer = smollm2
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        num_blocks=48,
        block_size=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        preemption_mode="swap",
        swap_space=0.05,
        device="cpu",
        dtype=torch.float32,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_engine(llm.engine, chat_prompts, params) == hf_reference
    stats = llm.kv_stats()
    assert stats["swap_out_blocks"] == stats["swap_in_blocks"] > 0 and stats["num_swapped"] == 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("draft_model", {"draft_layers": 8}), ("draft_model", {})])
def test_speculative_decoding_keeps_transformers_tokens(smollm2, chat_prompts, hf_reference, method, extra):
    """Speculation (prompt lookup, the early-exit self-draft, the target as its own draft) with prefix caching,
    chunked prefill and preemption on: greedy tokens must still be transformers'."""
    from paged import LLM

    model, tokenizer = smollm2
    config = {"method": method, "num_speculative_tokens": 3, **extra}
    if method == "draft_model":
        config["model"] = model
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        num_blocks=48,
        block_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        device="cpu",
        dtype=torch.float32,
        speculative_config=config,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_engine(llm.engine, chat_prompts, params) == hf_reference
    stats = llm.spec_stats()
    assert stats["num_accepted_tokens"] > 0
    if method == "draft_model" and not extra:  # the target as its own draft: every draft is accepted
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert llm.kv_stats()["num_preemptions"] > 0
    assert_pool_empty(llm)


# ---- log-probabilities ----------------------------------------------------------------------------------------


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(output), vocab] of each output position, the raw model's (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_are_transformers(
    label: str, entries, output: list[int], reference: torch.Tensor, num_top: int
) -> None:
    """Each position's entry: the chosen token first, with transformers' log-probability and rank; then its
    num_top most likely tokens with their log-probabilities. The set of most likely is checked only where
    transformers' k-th and (k+1)-th are further apart than the two engines' rounding."""
    assert len(entries) == len(output), label
    for position, (entry, token, row) in enumerate(zip(entries, output, reference)):
        where = f"{label}, token {position}"
        assert next(iter(entry)) == token, where
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-3), where
        surely_above, maybe_above = int((row > row[token] + 2e-3).sum()), int((row > row[token] - 2e-3).sum())
        assert surely_above < entry[token].rank <= maybe_above + 1, where
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[token_id]), abs=2e-3), where
        top = row.topk(num_top + 1).values
        if num_top and float(top[-2] - top[-1]) > 2e-3:
            others = [t for t, lp in entry.items() if lp.rank <= num_top]
            assert set(others) == set(row.topk(num_top).indices.tolist()), where


def test_logprobs_are_transformers_log_softmax(smollm2, smollm2_llm, chat_prompts):
    """Greedy and sampled (temperature, top-k): each token's log-probability is the raw model's, as transformers
    computes it, with the chosen token's rank and the top alternatives; the decoded token is its text alone."""
    model, tokenizer = smollm2
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(max_tokens=6, temperature=1.3, top_k=20, seed=7, ignore_eos=True, logprobs=0)
    outs = smollm2_llm.generate(chat_prompts[:3] * 2, [greedy] * 3 + [sampled] * 3, use_tqdm=False)
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        reference = hf_logprobs(model, out.prompt_token_ids, completion.token_ids)
        assert_logprobs_are_transformers(
            f"request {i}", completion.logprobs, completion.token_ids, reference, 3 if i < 3 else 0
        )
        assert completion.cumulative_logprob == pytest.approx(
            sum(float(reference[j, t]) for j, t in enumerate(completion.token_ids)), abs=1e-2
        )
        for entry in completion.logprobs:
            assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())
    assert all(next(iter(e.values())).rank == 1 for o in outs[:3] for e in o.outputs[0].logprobs)  # greedy
    assert any(next(iter(e.values())).rank > 1 for o in outs[3:] for e in o.outputs[0].logprobs)  # sampled
    assert all(len(e) == 1 for o in outs[3:] for e in o.outputs[0].logprobs)  # logprobs=0: the chosen one only
    assert (
        smollm2_llm.generate(chat_prompts[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs
        is None
    )  # not asked for, not kept


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logprobs_with_speculative_decoding_are_those_without(tiny_model, method):
    """A verify step appends several tokens at once; each gets the log-probabilities of its own row, so they equal
    those of plain decoding, one token per step."""
    prompts = [p * 3 for p in random_prompts(4, seed=9, low=3, high=8)]  # repeats: prompt lookup finds drafts
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = tiny_model
    plain = make_tiny_llm(tiny_model, num_blocks=128).generate(prompts, params, use_tqdm=False)
    speculating = make_tiny_llm(tiny_model, num_blocks=128, speculative_config=config)
    fast = speculating.generate(prompts, params, use_tqdm=False)
    assert speculating.spec_stats()["num_accepted_tokens"] > 0
    for a, b in zip(plain, fast):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)
