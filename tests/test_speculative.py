"""Speculative decoding in the engine, on a tiny random Llama: greedy tokens do not change, draft = target accepts
everything, rejected drafts give their blocks back, bad configs are refused by name, and sampling stays lossless."""

import pytest
import torch
from helpers import (
    assert_pool_empty,
    cached_blocks_hold_their_tokens,
    hf_greedy,
    make_tiny_llm,
    random_prompts,
    record_cached_prefixes,
    run_engine,
    run_through_interrupts,
)
from transformers import LlamaConfig, LlamaForCausalLM

from paged import SamplingParams
from paged.geometry import cdiv

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup has something to find."""
    return [p + p + p[:5] for p in random_prompts(count, seed=seed, low=4, high=20)]


def configs(model) -> dict:
    return {
        "ngram": dict(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1),
        "draft=target": dict(method="draft_model", model=model),
        "early-exit": dict(method="draft_model", model=model, draft_layers=1),
    }


def assert_draft_pool_empty(llm) -> None:
    drafter = llm.engine.speculator.drafter
    if drafter is not None:
        assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
        assert drafter.block_manager.block_tables == {} and drafter.num_computed == {}


@pytest.fixture(scope="module")
def prompts():
    """Ten prompts behind one shared 17-token header (a system prompt, say), for the prefix cache."""
    header = random_prompts(1, seed=20, low=17, high=18)[0]
    return [header + p for p in looping_prompts(6, seed=21) + random_prompts(4, seed=22)]


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft=target", "early-exit"])
def test_greedy_tokens_do_not_change_with_all_the_machinery_on(tiny_model, prompts, expected, method, k):
    """Prefix caching, chunked prefill and a pool small enough to preempt, with speculation on."""
    config = {**configs(tiny_model)[method], "num_speculative_tokens": k}
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=20,
        block_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        speculative_config=config,
    )
    prefix_of = record_cached_prefixes(llm)
    assert run_engine(llm.engine, prompts, GREEDY) == expected
    stats = llm.spec_stats()
    assert stats["num_drafts"] > 0
    assert stats["num_accepted_tokens"] > 0 or method == "ngram"  # a random model does not copy its prompt
    assert llm.kv_stats()["num_preemptions"] > 0 and llm.kv_stats()["prefix_hit_tokens"] > 0
    cached_blocks_hold_their_tokens(llm, tiny_model, prefix_of)  # no block full of rejected drafts was cached
    assert_pool_empty(llm)
    assert_draft_pool_empty(llm)


def test_speculative_tokens_equal_transformers(tiny_model):
    prompts = looping_prompts(4, seed=23)
    llm = make_tiny_llm(tiny_model, num_blocks=128, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, GREEDY.max_tokens, stop_at_eos=False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_equal_to_target_accepts_every_greedy_draft(tiny_model, prompts, k):
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        speculative_config={"method": "draft_model", "model": tiny_model, "num_speculative_tokens": k},
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.spec_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert stats["num_accepted_tokens_per_pos"][0] == stats["num_drafts"]
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats["num_accepted_tokens"]
    assert_draft_pool_empty(llm)


def test_rejected_drafts_give_their_blocks_back_at_once(tiny_model, prompts):
    """After every step each running sequence holds exactly the blocks its computed tokens need, and the next
    token goes into the slot the first rejected draft had."""
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        block_size=2,
        speculative_config={
            "method": "draft_model",
            "model": tiny_model,
            "num_speculative_tokens": 5,
            "draft_layers": 1,
        },
    )
    engine, manager = llm.engine, llm.engine.block_manager
    verify_slots = {}  # seq_id -> (first position verified, slots of the verified positions)

    def record(plan):
        verify_slots.clear()
        for seq, num_new in plan.scheduled:
            if seq.spec_token_ids:
                start = seq.num_computed_tokens
                verify_slots[seq.seq_id] = start, manager.slot_mapping(seq.seq_id, start, start + num_new)

    engine.forward_observers.append(record)
    for prompt in prompts:
        engine.add_request(engine.make_request(prompt, GREEDY))
    num_reused = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(manager.block_tables[seq.seq_id]) == cdiv(seq.num_computed_tokens, manager.block_size)
            if seq.seq_id in verify_slots:
                start, slots = verify_slots[seq.seq_id]
                rejected = seq.num_computed_tokens - start  # index of the first rejected draft's position
                if rejected < len(slots):
                    table = manager.block_tables[seq.seq_id] + [None]  # the next block, if any, comes later
                    position = seq.num_computed_tokens
                    if table[position // 2] is not None:
                        assert table[position // 2] * 2 + position % 2 == slots[rejected]
                        num_reused += 1
    stats = llm.spec_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # some drafts were rejected
    assert num_reused > 0
    assert_pool_empty(llm)
    assert_draft_pool_empty(llm)


def test_a_sequence_near_max_tokens_proposes_fewer(tiny_model, prompts):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        speculative_config={"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 5},
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert llm.spec_stats()["num_accepted_tokens_per_pos"][2:] == [0, 0, 0]  # 1 sampled, then at most 1 + 1
    assert llm.spec_stats()["num_draft_tokens"] == len(prompts)


BAD_CONFIGS = [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "prompt_lookup_min",
    ),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "smollm2"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": 42}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/no/such/folder"}, "model"),
    ("ngram", "speculative_config"),
]


@pytest.mark.parametrize("config,key", BAD_CONFIGS)
def test_bad_speculative_configs_are_named(tiny_model, config, key):
    with pytest.raises(ValueError, match=key):
        make_tiny_llm(tiny_model, speculative_config=config)


def test_drafts_of_another_vocabulary_length_or_depth_are_refused_and_the_engine_works_after(
    tiny_model, prompts, expected
):
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    ).eval()
    short = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
        )
    ).eval()
    for config, message in [
        ({"model": other}, "vocabulary"),
        ({"model": short}, "positions"),
        ({"model": tiny_model, "draft_layers": 3}, "draft_layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_tiny_llm(
                tiny_model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, **config}
            )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    good = make_tiny_llm(
        tiny_model, num_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert [o.outputs[0].token_ids for o in good.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_spec_stats_are_zero_without_speculation(tiny_model, prompts):
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert llm.spec_stats() == {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_accepted_tokens_per_pos": [],
    }


def test_an_interrupted_verify_is_rolled_back(tiny_model, prompts, expected):
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=64,
        enable_prefix_caching=True,
        speculative_config={
            "method": "draft_model",
            "model": tiny_model,
            "num_speculative_tokens": 3,
            "draft_layers": 1,
        },
    )
    engine = llm.engine
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts]
    # each interrupts a step that verifies drafts
    assert run_through_interrupts(engine, ids, interrupt_at=(2, 4, 3)) == expected
    assert_pool_empty(llm)
    assert_draft_pool_empty(llm)


def test_parallel_sampling_shares_blocks_and_beam_search_is_unchanged(tiny_model, prompts):
    """n > 1 forks share the prompt's blocks (copy-on-write) while each completion speculates on its own; beam
    search does not speculate and gives the same beams as an engine without speculation."""
    config = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3, "draft_layers": 1}
    llm = make_tiny_llm(tiny_model, num_blocks=128, speculative_config=config)
    params = SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=16, seed=5, ignore_eos=True)
    shared = []
    llm.engine.forward_observers.append(
        lambda plan: shared.append(
            max(
                llm.engine.block_manager.ref_count(b) for t in llm.engine.block_manager.block_tables.values() for b in t
            )
        )
    )
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    llm.engine.forward_observers.clear()
    assert max(shared) == 3  # a prompt block held by all three completions
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 16 for c in o.outputs) for o in outs)
    assert llm.spec_stats()["num_drafts"] > 0
    assert_pool_empty(llm)
    assert_draft_pool_empty(llm)
    plain = make_tiny_llm(tiny_model, num_blocks=128)
    beams = llm.beam_search(prompts[:2], beam_width=3, max_tokens=8)
    expected = plain.beam_search(prompts[:2], beam_width=3, max_tokens=8)
    assert [[s.token_ids for s in b.sequences] for b in beams] == [[s.token_ids for s in b.sequences] for b in expected]
    assert_pool_empty(llm)


def test_the_cost_model_finds_where_speculation_stops_paying():
    from paged.analysis.speculative_cost import crossover_batch, expected_tokens, verify_speedup
    from paged.analysis.step_cost import StepCost

    weights_bound = StepCost(fixed=1.0, per_token=0.0, per_seq=0.0, per_pair=0.0)  # k + 1 tokens cost one
    compute_bound = StepCost(fixed=0.0, per_token=1.0, per_seq=0.0, per_pair=0.0)  # k + 1 tokens cost k + 1
    assert verify_speedup(weights_bound, 64, 3, 0.5, context=100) == pytest.approx(expected_tokens(0.5, 3))
    assert verify_speedup(compute_bound, 64, 3, 0.5, context=100) == pytest.approx(expected_tokens(0.5, 3) / 4)
    assert crossover_batch(weights_bound, 3, 0.5, context=100) is None
    assert crossover_batch(compute_bound, 3, 0.5, context=100) == 1
    # decode 10 + B, verify 10 + 4B: E(0.5, 3) = 1.875 stops paying past B = 8.75 / 2.125 = 4.1
    mixed = StepCost(fixed=10.0, per_token=1.0, per_seq=0.0, per_pair=0.0)
    assert crossover_batch(mixed, 3, 0.5, context=100) == 5
    assert crossover_batch(mixed, 3, 0.3, context=100) < 5 and crossover_batch(mixed, 3, 1.0, context=100) is None
    # a draft that costs as much as the target halves the gain at k = 1 when verifying is free
    assert verify_speedup(weights_bound, 1, 1, 1.0, context=10, draft_cost=1.0) == pytest.approx(1.0)


def test_measure_step_times_decodes_and_verifies_and_gives_the_pool_back(tiny_model):
    from paged.analysis.speculative_cost import measure_step

    llm = make_tiny_llm(tiny_model, num_blocks=32)
    assert measure_step(llm.engine, 4, 1, context=20, repeats=2) > 0
    assert measure_step(llm.engine, 4, 4, context=20, repeats=2) > 0
    assert_pool_empty(llm)
    with pytest.raises(ValueError, match="batch \\(16\\).*num_blocks"):
        measure_step(llm.engine, 16, 4, context=20)
    assert_pool_empty(llm)
    llm.engine.add_request(llm.engine.make_request([1, 2, 3], GREEDY))
    with pytest.raises(ValueError, match="idle engine"):
        measure_step(llm.engine, 1, 1, context=4)


@pytest.mark.parametrize("method", ["ngram", "early-exit"])
def test_forks_made_while_their_parent_verifies_drafts_take_only_its_accepted_tokens(tiny_model, method):
    """n > 1 with chunked prefill: a prompt's last chunk of one token looks like a decode, so it proposes drafts,
    and the step that verifies them also forks the other completions. A fork copies the parent's tokens and
    their K/V, never the drafts: one that started past its own tokens would never be scheduled again (the
    request hangs, then the scheduler finds nothing to run). top_k=1 makes every completion the greedy one."""
    config = {**configs(tiny_model)[method], "num_speculative_tokens": 3}
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        speculative_config=config,
    )
    engine = llm.engine
    prompt = looping_prompts(1, seed=5)[0][:17]  # 16 tokens in the first chunk, 1 in the second
    assert len(prompt) == 17
    params = SamplingParams(n=3, temperature=1.0, top_k=1, seed=3, max_tokens=10, ignore_eos=True)
    engine.add_request(engine.make_request(prompt, params))
    outputs = []
    for _ in range(30):  # a few steps do it; a hang stops here instead of stalling the suite
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    assert not engine.has_unfinished_requests(), "the completions forked from a drafting parent never ran again"
    greedy = make_tiny_llm(tiny_model, num_blocks=64).generate(prompt, GREEDY, use_tqdm=False)[0]
    assert [c.token_ids for c in outputs[0].outputs] == [greedy.outputs[0].token_ids[:10]] * 3
    assert llm.spec_stats()["num_drafts"] > 0
    assert_pool_empty(llm)
    assert_draft_pool_empty(llm)


def test_the_two_acceptances_and_the_break_even_point():
    from paged.analysis.speculative_cost import (
        acceptance_of_rate,
        break_even_acceptance,
        expected_tokens,
        rate_of_acceptance,
    )

    # r by counting: over many verifies with independent per-position acceptance a, accepted / drafted
    generator = torch.Generator().manual_seed(0)
    a, k, verifies = 0.7, 3, 200_000
    accepted = (torch.rand(verifies, k, generator=generator) < a).int().cumprod(dim=1).sum()
    assert rate_of_acceptance(a, k) == pytest.approx(accepted.item() / (verifies * k), abs=3e-3)
    assert rate_of_acceptance(0.75, 5) == pytest.approx(0.4576, abs=1e-4)  # chapter 09: a = 0.75 gives r = 0.46
    assert acceptance_of_rate(rate_of_acceptance(0.42, 4), 4) == pytest.approx(0.42)
    # a verify that costs 2 decode steps pays from E = 2 on: r = 1/3 with k = 3
    a_even, r_even = break_even_acceptance(2.0, 3)
    assert r_even == pytest.approx(1 / 3) and expected_tokens(a_even, 3) == pytest.approx(2.0)
    assert break_even_acceptance(4.5, 3) is None and break_even_acceptance(0.8, 3) == pytest.approx((0.0, 0.0))
    with pytest.raises(ValueError, match="rate"):
        acceptance_of_rate(1.5, 3)
