"""The engine on a tiny random Llama: bad input, preemption, chunked prefill, abort, sampling, no leaked block."""

import random

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm, needs_triton, random_prompts, run_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import SamplingParams
from paged.engine.sampler import filter_logits, greedy_tokens, sample

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy outputs of 10 prompts with a roomy pool and no chunking: what every variant must reproduce."""
    prompts = random_prompts(10, seed=3)
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_preemption_by_recompute_keeps_outputs(tiny_model, reference):
    prompts, expected = reference
    llm = make_tiny_llm(tiny_model, num_blocks=12, block_size=8)  # 96 slots for ten sequences of up to 80 tokens
    assert run_engine(llm.engine, prompts, GREEDY) == expected
    assert llm.kv_stats()["num_preemptions"] > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("budget, idle_prefill", [(8, None), (13, None), (64, None), (8, 40)])
def test_chunked_prefill_keeps_outputs(tiny_model, reference, budget, idle_prefill):
    prompts, expected = reference
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
        max_idle_prefill_tokens=idle_prefill,
        max_num_seqs=min(budget, 64),
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pool_empty(llm)


def test_arrival_order_does_not_change_outputs(tiny_model, reference):
    prompts, expected = reference
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    llm = make_tiny_llm(tiny_model, num_blocks=256, max_num_seqs=3)
    outs = llm.generate([prompts[i] for i in order], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[i] for i in order]


def test_max_num_seqs_caps_the_running_batch(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=256, max_num_seqs=2)
    engine = llm.engine
    for prompt in random_prompts(5, seed=4):
        engine.add_request(engine.make_request(prompt, GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert_pool_empty(llm)


def test_abort_frees_blocks_at_once(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=64)
    engine = llm.engine
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in random_prompts(3, seed=5)]
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for request_id in ids:
        engine.abort_request(request_id)
    assert_pool_empty(llm)
    assert not engine.has_unfinished_requests()


def test_abort_one_completion_frees_its_blocks_and_the_others_go_on(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    engine = llm.engine
    prompt = random_prompts(1, seed=6)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    request_id = engine.add_request(engine.make_request(prompt, params))
    seqs = engine.requests[request_id].seqs
    while len(seqs) < 3 or len(seqs[1].output_token_ids) < 5:
        engine.step()
    engine.abort_sequence(request_id, 1)
    assert seqs[1].seq_id not in engine.block_manager.block_tables  # freed at once, not when the others end
    assert all(seq.seq_id in engine.block_manager.block_tables for seq in (seqs[0], seqs[2]))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    completions = outputs[request_id].outputs
    assert [c.token_ids for c in (completions[0], completions[2])] == [expected[0].token_ids, expected[2].token_ids]
    assert completions[1].finish_reason == "abort" and len(completions[1].token_ids) == 5
    assert completions[1].token_ids == expected[1].token_ids[:5]
    engine.abort_sequence(request_id, 0)  # the request is gone: ignored
    assert_pool_empty(llm)


def test_n_completions_and_seeded_sampling(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    prompt = random_prompts(1, seed=6)[0]
    params = SamplingParams(n=3, temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0]
    crowded = llm.generate([prompt] + random_prompts(4, seed=8), params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in alone.outputs)
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowded.outputs]  # seed beats batching
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    assert_pool_empty(llm)


def test_stop_token_ids_and_max_tokens(tiny_model, reference):
    prompts, expected = reference
    stop = expected[0][5]
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    out = llm.generate(
        prompts[0], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == expected[0][: expected[0].index(stop) + 1]
    out = llm.generate(prompts[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == expected[0][:3]


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    one, zero = torch.ones(1), torch.zeros(1)
    probs = filter_logits(logits, one, torch.tensor([2]), one, zero)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    probs = filter_logits(logits, one, torch.tensor([5]), torch.tensor([full[0].item() + 1e-3]), zero)
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]  # the smallest set reaching top_p
    probs = filter_logits(logits, one, torch.tensor([5]), torch.tensor([1e-6]), zero)
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]  # the top token always survives


def test_top_k_zero_and_minus_one_keep_every_token():
    """vLLM's top_k=0 means no top-k filter, and it takes -1 to mean the same: both draw what no filter draws."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])

    def draws(top_k):
        params = SamplingParams(temperature=1.0, top_k=top_k)
        return [
            sample(logits, [params], [torch.Generator().manual_seed(seed)], torch.Generator())[0] for seed in range(64)
        ]

    unfiltered = draws(5)
    assert SamplingParams().top_k == 0 and draws(0) == draws(-1) == unfiltered and len(set(unfiltered)) > 2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.sampled_from([2, 7, 64, 256, 320, 1000, 1536]), st.integers(0, 2**31 - 1))
def test_greedy_tokens_is_argmax(rows, vocab, seed):
    """Ties (few distinct values), -inf rows and NaN, vocabularies cut into chunks or not: argmax's answer exactly."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab), generator=generator).float()
    special = torch.rand(rows, vocab, generator=generator)
    logits[special < 0.05] = float("-inf")
    logits[special > 0.995] = float("nan")
    logits[0] = float("-inf") if seed % 3 == 0 else logits[0]
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


BAD_PARAMS = [
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(temperature=-1.0), "temperature"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
]


@pytest.mark.parametrize("kwargs,name", BAD_PARAMS)
def test_bad_sampling_params_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_engine_settings_are_named(tiny_model):
    for kwargs, name in [
        (dict(block_size=12), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_tiny_llm(tiny_model, **kwargs)


def test_bad_prompts_raise_and_leave_the_engine_usable(tiny_model, reference):
    prompts, expected = reference
    llm = make_tiny_llm(tiny_model, num_blocks=16, block_size=8, max_num_batched_tokens=100)  # 128 slots
    bad = [
        ([], SamplingParams(), "empty"),
        ([1] * 600, SamplingParams(), "max_model_len"),  # model holds 512
        ([1] * 120, SamplingParams(max_tokens=20), "max_tokens"),  # 140 tokens > 128-slot pool
        ([1] * 101, SamplingParams(max_tokens=2), "max_num_batched_tokens"),
        ([300], SamplingParams(), "vocabulary"),
        ("text needs a tokenizer", SamplingParams(), "tokenizer"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompts[0], prompt], params, use_tqdm=False)  # the good prompt must not be left queued
        assert not llm.engine.has_unfinished_requests()
        assert_pool_empty(llm)
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]


@needs_triton
def test_triton_kernels_in_the_interpreter_give_the_reference_tokens(tiny_model, reference):
    prompts, expected = reference
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=64,
        attention_backend="triton",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )  # chunks, so the prefill kernel also reads cached blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e[:4] for e in expected[:3]]
    assert_pool_empty(llm)


@pytest.mark.parametrize("speculative", [False, True])
def test_core_step_returns_every_new_token_once(tiny_model, speculative):
    """What core_step() says each sequence gained, put together step by step, is each completion's whole output,
    with forks (n = 2), chunked prompts, stop tokens and accepted drafts (several tokens in one step)."""
    spec = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3} if speculative else None
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        speculative_config=spec,
    )
    engine = llm.engine
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=2, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[7, 11, 13, 17, 19, 23]),
    ]
    for prompt, p in zip(random_prompts(6, seed=9), params * 2):
        engine.add_request(engine.make_request(prompt, p))
    streamed, finished, num_multi = {}, {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.core_step()
        for seq, num_new in outputs.new_tokens:
            assert num_new >= 1
            num_multi += num_new > 1
            streamed.setdefault((seq.request.request_id, seq.index), []).extend(seq.output_token_ids[-num_new:])
        finished |= {o.request_id: o for o in outputs.finished}
    wanted = {(r, c.index): c.token_ids for r, o in finished.items() for c in o.outputs}
    assert streamed == wanted and len(wanted) == 8
    assert (num_multi > 0) == speculative
    assert_pool_empty(llm)
