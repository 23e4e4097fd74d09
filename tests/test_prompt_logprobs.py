"""Prompt log-probabilities from the engine (vLLM's prompt_logprobs): each prompt token's log-probability given
the tokens before it, kept from the prefill's own logits, chunked or not, and equal to transformers' log_softmax
on the same weights. A request that asks for them does not read the prefix cache, and its blocks are cached for
the requests after it."""

import dataclasses

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm, random_prompts
from test_oracle import assert_logprobs_are_transformers

from paged import LLM, SamplingParams


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(prompt) - 1, vocab] of prompt tokens 1.. (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine, prompts, params, **kwargs):
    """Every prompt added at once, stepped to the end; outputs in prompt order."""
    params = dataclasses.replace(params, **kwargs)
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step())
    return [done[i] for i in ids]


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_are_transformers_log_softmax(smollm2, chat_prompts, chunked):
    """SmolLM2, whole prefills and 16-token chunks: None for the first prompt token, then each token first with
    transformers' log-probability and rank, then its 3 most likely alternatives; the completion is unchanged."""
    model, tokenizer = smollm2
    settings = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4) if chunked else {}
    llm = LLM(
        model=model, tokenizer=tokenizer, num_blocks=128, block_size=16, device="cpu", dtype=torch.float32, **settings
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = chat_prompts[:3]
    outs = run(llm.engine, prompts, params, prompt_logprobs=3)
    plain = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, without) in enumerate(zip(outs, plain)):
        ids = out.prompt_token_ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        assert_logprobs_are_transformers(
            f"prompt {i}", out.prompt_logprobs[1:], ids[1:], hf_prompt_logprobs(model, ids), 3
        )
        assert all(lp.decoded_token == tokenizer.decode([t]) for e in out.prompt_logprobs[1:] for t, lp in e.items())
        assert out.outputs[0].token_ids == without.outputs[0].token_ids
        assert without.prompt_logprobs is None  # not asked for, not kept
    assert_pool_empty(llm)


def test_a_request_for_prompt_logprobs_skips_reading_the_prefix_cache_but_fills_it(tiny_model):
    llm = make_tiny_llm(tiny_model, enable_prefix_caching=True)
    engine = llm.engine
    prompt = random_prompts(1, seed=3, low=40, high=41)[0]  # 40 tokens: 4 full blocks of 8 and a part
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    reference = hf_prompt_logprobs(tiny_model, prompt)
    scored = run(engine, [prompt], params, prompt_logprobs=0)[0]  # a cold cache: computes, then caches
    assert engine.kv_stats()["prefix_hit_tokens"] == 0
    reused = run(engine, [prompt], params)[0]  # reads the blocks it left
    assert engine.kv_stats()["prefix_hit_tokens"] == 32
    assert engine.requests == {} and reused.outputs[0].token_ids == scored.outputs[0].token_ids
    again = run(engine, [prompt], params, prompt_logprobs=0)[0]  # the cache holds it: not read
    assert engine.kv_stats()["prefix_hit_tokens"] == 32
    for out in (scored, again):
        entries = out.prompt_logprobs[1:]
        assert [next(iter(e)) for e in entries] == prompt[1:] and all(len(e) == 1 for e in entries)
        assert [e[t].logprob for e, t in zip(entries, prompt[1:])] == pytest.approx(
            [float(reference[j, t]) for j, t in enumerate(prompt[1:])], abs=1e-4
        )
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        dataclasses.replace(params, prompt_logprobs=1, skip_reading_prefix_cache=False)
    forced = run(engine, [prompt], params, skip_reading_prefix_cache=True)[0]  # may be asked for alone too
    assert engine.kv_stats()["prefix_hit_tokens"] == 32 and forced.prompt_logprobs is None
    assert_pool_empty(llm)


def test_prompt_logprobs_survive_preemption_failed_steps_and_n(tiny_model):
    """A pool too small for every request at once preempts (recompute); a step that fails is undone; n = 2
    completions share the prompt. Each request's prompt logprobs are still transformers', each once."""
    llm = make_tiny_llm(
        tiny_model, num_blocks=12, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine = llm.engine
    prompts = random_prompts(6, seed=5, low=10, high=40)
    failures = iter([False, False, True, False, False, True] + [False] * 1000)

    def fail_sometimes(plan):
        if next(failures):
            raise RuntimeError("a failing step")

    engine.forward_observers.append(fail_sometimes)
    params = SamplingParams(n=2, max_tokens=12, seed=1, ignore_eos=True, prompt_logprobs=2)
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    done, num_failed = {}, 0
    while engine.has_unfinished_requests():
        try:
            done.update((out.request_id, out) for out in engine.step())
        except RuntimeError:
            num_failed += 1
    assert num_failed == 2 and engine.scheduler.num_preemptions > 0
    for request_id, prompt in zip(ids, prompts):
        out = done[request_id]
        assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs) == 2
        assert_logprobs_are_transformers(
            request_id, out.prompt_logprobs[1:], prompt[1:], hf_prompt_logprobs(tiny_model, prompt), 2
        )
    assert_pool_empty(llm)


@pytest.mark.parametrize("value, word", [(-1, ">= 0"), (21, "<= 20"), (1.5, "integer"), (True, "integer")])
def test_a_bad_prompt_logprobs_is_a_value_error_naming_it(tiny_model, value, word):
    llm = make_tiny_llm(tiny_model)
    with pytest.raises(ValueError, match=f"prompt_logprobs.*{word}"):
        SamplingParams(prompt_logprobs=value)
    assert run(llm.engine, [[1, 2, 3]], SamplingParams(max_tokens=2), prompt_logprobs=1)[0].prompt_logprobs


def test_llm_generate_takes_prompt_logprobs_in_its_sampling_params(tiny_model):
    """Offline, as in vLLM: SamplingParams(prompt_logprobs=N) on LLM.generate, and the same numbers as transformers."""
    llm = make_tiny_llm(tiny_model, enable_prefix_caching=True)
    prompt = random_prompts(1, seed=5, low=20, high=21)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert_logprobs_are_transformers(
        "generate", out.prompt_logprobs[1:], prompt[1:], hf_prompt_logprobs(tiny_model, prompt), 1
    )
    assert_pool_empty(llm)
