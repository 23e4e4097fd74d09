"""Beam search on shared blocks equals vLLM's rule (recomputed here over transformers' logits) and transformers' beam
search where the two agree, with beams that end in EOS; and sharing saves blocks."""

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm, random_prompts, tiny_llama

from paged import LLM
from paged.model.loader import chat_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 99  # a token the tiny model often ranks among a beam's candidates, made its end-of-sequence token


@pytest.fixture(scope="module")
def eos_model():
    return tiny_llama(eos_token_id=EOS)


def score(tokens, cum_logprob, length_penalty):
    """vLLM's get_beam_search_score: the generated tokens, an ending EOS included."""
    return cum_logprob / max(len(tokens), 1) ** length_penalty


@torch.no_grad()
def reference_beams(model, prompt, beam_width, max_tokens, length_penalty, eos, transformers_rule=False):
    """Beam search over transformers' logits, every beam recomputed from its whole text. vLLM's rule: every candidate
    ending in EOS among a beam's 2 x beam_width is a finished hypothesis. transformers' rule: only those among the
    beam_width best candidates of the step (its 2 x beam_width ranked over all beams) are.
    Returns [(generated tokens, cum logprob)], best first."""
    beams, finished = [([], 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        ids = torch.tensor([prompt + tokens for tokens, _ in beams])
        logprobs = model(ids).logits[:, -1].float().log_softmax(dim=-1)  # [beams, vocab]
        candidates = []
        for (tokens, cum), row in zip(beams, logprobs):
            top = row.topk(2 * beam_width)
            candidates += [(tokens + [t], cum + lp) for lp, t in zip(top.values.tolist(), top.indices.tolist())]
        if transformers_rule:
            candidates.sort(key=lambda c: -c[1])
            candidates = candidates[: 2 * beam_width]
            finished += [c for rank, c in enumerate(candidates) if c[0][-1] == eos and rank < beam_width]
        else:
            finished += [c for c in candidates if c[0][-1] == eos]
        beams = sorted([c for c in candidates if c[0][-1] != eos], key=lambda c: -c[1])[:beam_width]
    return sorted(finished + beams, key=lambda c: -score(*c, length_penalty))[:beam_width]


def hf_beams_with_eos(model, prompt, beam_width, max_tokens, length_penalty, eos):
    """transformers' beam search with early_stopping="never": (generated tokens cut after EOS, score) per beam."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=beam_width,
        max_new_tokens=max_tokens,
        do_sample=False,
        early_stopping="never",
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=eos,
        num_return_sequences=beam_width,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = []
    for row in out.sequences[:, ids.shape[1] :].tolist():
        beams.append(row[: row.index(eos) + 1] if eos in row else row)
    return beams, out.sequences_scores.tolist()


def hf_beams(model, prompt, beam_width, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=beam_width,
        max_new_tokens=max_tokens,
        do_sample=False,
        early_stopping=False,
        length_penalty=1.0,
        eos_token_id=None,
        pad_token_id=0,
        num_return_sequences=beam_width,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, ids.shape[1] :].tolist(), out.sequences_scores.tolist()


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
    assert all(held <= listed for held, listed in zip(physical, logical))
    assert sum(physical) < 0.6 * sum(logical)  # the 40-token prompt's five blocks are held once, not four times


def test_beam_width_is_checked(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=16)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(random_prompts(1), beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(random_prompts(1, low=50, high=51), beam_width=8, max_tokens=40)
    assert_pool_empty(llm)


EOS_CASES = [
    (prompt, beam_width, length_penalty)
    for prompt in random_prompts(6, seed=12)
    for beam_width in (2, 4)
    for length_penalty in (0.0, 1.0, 2.0)
]


def test_beams_that_end_in_eos_follow_vllms_rule(eos_model):
    """Finished hypotheses are set aside and beam_width beams go on: the engine's beams and scores are the
    reference's (vLLM's rule) for every case, and some cases finish beams with EOS."""
    llm = make_tiny_llm(eos_model, num_blocks=256)
    ended = 0
    for prompt, beam_width, length_penalty in EOS_CASES:
        out = llm.beam_search([prompt], beam_width=beam_width, max_tokens=10, length_penalty=length_penalty)[0]
        expected = reference_beams(eos_model, prompt, beam_width, 10, length_penalty, EOS)
        assert [s.token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([cum for _, cum in expected], abs=1e-4)
        assert all(s.finished == (s.token_ids[-1] == EOS) for s in out.sequences)
        ended += sum(s.finished for s in out.sequences)
    assert ended >= 5
    assert_pool_empty(llm)


def test_beams_that_end_in_eos_equal_transformers_where_the_rules_agree(eos_model):
    """transformers (early_stopping="never") is the reference with its own rule in every case; where that rule
    and vLLM's give the same beams, the engine gives transformers' beams and scores."""
    llm = make_tiny_llm(eos_model, num_blocks=256)
    agreeing = 0
    for prompt, beam_width, length_penalty in EOS_CASES:
        tokens, scores = hf_beams_with_eos(eos_model, prompt, beam_width, 10, length_penalty, EOS)
        own_rule = reference_beams(eos_model, prompt, beam_width, 10, length_penalty, EOS, transformers_rule=True)
        assert tokens == [t for t, _ in own_rule]
        assert scores == pytest.approx([score(*c, length_penalty) for c in own_rule], abs=1e-4)
        if own_rule != reference_beams(eos_model, prompt, beam_width, 10, length_penalty, EOS):
            continue
        out = llm.beam_search([prompt], beam_width=beam_width, max_tokens=10, length_penalty=length_penalty)[0]
        assert [s.token_ids for s in out.sequences] == tokens
        assert [score(s.token_ids, s.cum_logprob, length_penalty) for s in out.sequences] == pytest.approx(
            scores, abs=1e-4
        )
        agreeing += any(s.finished for s in out.sequences)
    assert agreeing >= 3  # cases with a beam ended by EOS, where the engine equals transformers


def test_smollm2_beams_equal_transformers(smollm2):
    """On the real model, EOS allowed: "What is 2+2?" with two beams and no length penalty."""
    model, tokenizer = smollm2
    prompt = tokenizer(chat_prompt(tokenizer, "What is 2+2?")).input_ids
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32, num_blocks=64)
    out = llm.beam_search([prompt], beam_width=2, max_tokens=24, length_penalty=0.0)[0]
    eos = tokenizer.eos_token_id
    tokens, scores = hf_beams_with_eos(model, prompt, 2, 24, 0.0, eos)
    assert [s.token_ids for s in out.sequences] == tokens
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(scores, abs=1e-3)
    assert any(s.finished for s in out.sequences)
