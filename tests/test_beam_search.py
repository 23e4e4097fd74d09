"""Beam search on shared blocks equals transformers' beam search, and sharing saves blocks."""

import pytest
import torch

from helpers import assert_pool_empty, make_tiny_llm, random_prompts


def hf_beams(model, prompt, beam_width, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam_width, max_new_tokens=max_tokens,
                         do_sample=False, early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
                         num_return_sequences=beam_width, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_match_transformers(tiny_model, beam_width):
    prompts = random_prompts(3, seed=2)
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    outs = llm.beam_search(prompts, beam_width=beam_width, max_tokens=10)
    for prompt, out in zip(prompts, outs):
        tokens, scores = hf_beams(tiny_model, prompt, beam_width, 10)
        assert [s.token_ids for s in out.sequences] == tokens
        assert [s.cum_logprob / 10 for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    assert_pool_empty(llm)
    assert llm.engine.requests == {}


def test_beams_share_blocks(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    out = llm.beam_search(random_prompts(1, seed=4, low=40, high=41), beam_width=4, max_tokens=12)[0]
    physical, logical = zip(*out.block_usage)
    assert all(p <= l for p, l in zip(physical, logical))
    assert sum(physical) < 0.6 * sum(logical)  # the 40-token prompt's five blocks are held once, not four times


def test_beam_width_is_checked(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=16)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(random_prompts(1), beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(random_prompts(1, low=50, high=51), beam_width=8, max_tokens=40)
    assert_pool_empty(llm)
