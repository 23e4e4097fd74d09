"""The engine's promise under bad input, interrupts and edge cases, on a tiny random Llama.

Every call either gives a correct result or raises a ValueError that names the argument and the limit; a step that
is interrupted is rolled back; no block leaks, no request is lost or finished twice, and the prefix cache holds
only K/V that were really computed for its tokens.
"""

import numpy as np
import pytest
import torch
from helpers import (
    FailOnForward,
    Interrupt,
    assert_pool_empty,
    cached_blocks_hold_their_tokens,
    hf_greedy,
    make_tiny_llm,
    random_prompts,
    record_cached_prefixes,
    run_through_interrupts,
    tiny_llama,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged import LLM, SamplingParams
from paged.sampling_params import MAX_SEED

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=11, low=20, high=40)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    """Greedy outputs of the prompts on a roomy pool: what every run below must reproduce."""
    llm = make_tiny_llm(tiny_model, num_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


# ---- 1. an interrupted step ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [Interrupt, KeyboardInterrupt])
def test_an_interrupted_step_leaves_nothing_in_the_prefix_cache(tiny_model, prompts, expected, error):
    llm = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    llm.engine.forward_observers.append(FailOnForward(1, error))
    with pytest.raises(error):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert llm.kv_stats()["num_cached_blocks"] == 0  # their K/V were never written
    assert_pool_empty(llm)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]


def test_an_error_inside_the_forward_pass_is_rolled_back(tiny_model, prompts, expected):
    """The first layer writes its K/V, the second fails: the half-written blocks must not be served."""
    llm = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    prefix_of = record_cached_prefixes(llm)
    backend = llm.engine.model.backend
    prefill, calls = backend.prefill, []

    def failing_prefill(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return prefill(*args)

    backend.prefill = failing_prefill
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    backend.prefill = prefill
    assert tokens(llm.generate(prompts[:3], GREEDY, use_tqdm=False)) == expected[:3]
    cached_blocks_hold_their_tokens(llm, tiny_model, prefix_of)


def test_the_engine_recomputes_what_an_interrupted_step_scheduled(tiny_model, prompts, expected):
    """Through LLMEngine nothing is aborted: the step is rolled back and its sequences are simply run again."""
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=64,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        max_num_seqs=4,
    )
    engine = llm.engine
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts]
    # fail in the middle of prefills and of decodes
    assert run_through_interrupts(engine, ids, interrupt_at=(1, 3, 2, 5)) == expected
    assert_pool_empty(llm)


def test_an_error_in_the_sampler_is_rolled_back(tiny_model, prompts, expected, monkeypatch):
    import paged.engine.model_runner

    llm = make_tiny_llm(tiny_model, num_blocks=64)
    engine, sample, calls = llm.engine, paged.engine.model_runner.sample, []

    def failing_sample(*args):
        calls.append(1)
        if len(calls) in (1, 4):
            raise RuntimeError("sampler failed")
        return sample(*args)

    monkeypatch.setattr(paged.engine.model_runner, "sample", failing_sample)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts[:2]]
    ids.append(engine.add_request(engine.make_request(prompts[2], params)))  # forks right after its prompt
    outputs = {}
    for _ in range(100):
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except RuntimeError as error:
            assert str(error) == "sampler failed"
    assert not engine.has_unfinished_requests()
    assert [outputs[i].outputs[0].token_ids for i in ids[:2]] == expected[:2]
    assert [len(c.token_ids) for c in outputs[ids[2]].outputs] == [6, 6]
    assert_pool_empty(llm)


# ---- 2. recompute preemption past the token budget ----------------------------------------------------------------


def test_a_preempted_sequence_longer_than_the_budget_is_recomputed_in_chunks(tiny_model):
    """Chunked prefill off: every prompt fits the budget, but prompt + output after a preemption does not."""
    prompts = random_prompts(4, seed=13, low=30, high=31)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # up to 60 tokens: 8 blocks of 8
    expected = tokens(make_tiny_llm(tiny_model, num_blocks=256).generate(prompts, params, use_tqdm=False))
    llm = make_tiny_llm(tiny_model, num_blocks=12, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.kv_stats()["num_preemptions"] > 0
    assert_pool_empty(llm)


# ---- 3, 4, 5. beam search ------------------------------------------------------------------------------------------


def test_beam_search_stops_at_max_model_len(tiny_model, prompts, expected):
    llm = make_tiny_llm(tiny_model, num_blocks=160)
    prompt = random_prompts(1, seed=12, low=505, high=506)[0]  # the model holds 512 positions
    out = llm.beam_search([prompt], beam_width=2, max_tokens=32)[0]
    unfinished = [len(beam.token_ids) for beam in out.sequences if not beam.finished]
    assert unfinished and set(unfinished) == {7}
    assert_pool_empty(llm)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]


@pytest.mark.parametrize("beam_width, settings_", [(129, {}), (5, {"max_num_seqs": 4}), (0, {}), (2.0, {})])
def test_beam_search_refuses_impossible_widths(tiny_model, prompts, expected, beam_width, settings_):
    llm = make_tiny_llm(tiny_model, num_blocks=64, **settings_)  # vocabulary of 256
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(prompts[:2], beam_width=beam_width, max_tokens=4)
    assert_pool_empty(llm)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]


@pytest.mark.parametrize("at", [1, 2, 4])
def test_an_interrupted_beam_search_gives_every_block_back(tiny_model, prompts, expected, at):
    llm = make_tiny_llm(tiny_model, num_blocks=128, enable_prefix_caching=True)
    reference = llm.beam_search(prompts[:2], beam_width=3, max_tokens=6)
    llm.engine.forward_observers.append(FailOnForward(at, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search(prompts[:2], beam_width=3, max_tokens=6)
    llm.engine.forward_observers.clear()
    assert not llm.engine.has_unfinished_requests() and llm.engine.requests == {}
    assert_pool_empty(llm)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]
    again = llm.beam_search(prompts[:2], beam_width=3, max_tokens=6)
    assert [[b.token_ids for b in o.sequences] for o in again] == [
        [b.token_ids for b in o.sequences] for o in reference
    ]


@pytest.mark.parametrize("chunked, budget", [(False, 24), (True, 16)])
def test_beam_search_waits_for_budget_to_admit_every_prompt(tiny_model, chunked, budget):
    """The token budget admits one prompt at a time: the others' beams wait, holding no block yet."""
    batch = random_prompts(3, seed=14, low=12, high=21)
    roomy = make_tiny_llm(tiny_model, num_blocks=128).beam_search(batch, beam_width=2, max_tokens=3)
    llm = make_tiny_llm(
        tiny_model, num_blocks=16, max_num_seqs=4, enable_chunked_prefill=chunked, max_num_batched_tokens=budget
    )
    outs = llm.beam_search(batch, beam_width=2, max_tokens=3)
    assert [[b.token_ids for b in o.sequences] for o in outs] == [[b.token_ids for b in o.sequences] for o in roomy]
    assert_pool_empty(llm)


def test_beam_search_of_no_prompts_is_empty(tiny_model):
    assert make_tiny_llm(tiny_model).beam_search([], beam_width=2) == []


# ---- 6. request ids ------------------------------------------------------------------------------------------------


def test_automatic_request_ids_skip_the_callers_own(tiny_model, prompts, expected):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    engine = llm.engine
    mine = engine.add_request(engine.make_request(prompts[0], GREEDY, request_id="1"))
    auto = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts[1:3]]
    assert mine == "1" and len({mine, *auto}) == 3
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    assert [outputs[i] for i in [mine, *auto]] == expected[:3]


def test_one_request_id_twice_is_refused_before_anything_is_queued(tiny_model, prompts, expected):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    engine = llm.engine
    first, second = (engine.make_request(p, GREEDY, request_id="same") for p in prompts[:2])
    engine.add_request(first)
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        engine.add_request(second)
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        engine.make_request(prompts[1], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(first)  # the same request twice
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [("same", expected[0])]
    assert_pool_empty(llm)


def test_aborting_an_unknown_or_finished_request_is_ignored(tiny_model, prompts):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    engine = llm.engine
    request_id = engine.add_request(engine.make_request(prompts[0], GREEDY))
    engine.abort_request("nobody")
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort_request(request_id)
    engine.abort_request(request_id)
    assert_pool_empty(llm)


def test_drivers_refuse_an_engine_with_requests_in_flight(tiny_model, prompts, expected):
    """generate and beam_search step the engine for their own requests; another caller's would be taken."""
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    engine = llm.engine
    theirs = engine.add_request(engine.make_request(prompts[0], GREEDY))
    for call in (lambda: llm.generate(prompts[1], GREEDY), lambda: llm.beam_search(prompts[1], beam_width=2)):
        with pytest.raises(ValueError, match="idle engine"):
            call()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [(theirs, expected[0])]


# ---- 7, 8. sampling parameters ------------------------------------------------------------------------------------


def test_seeds_are_checked_and_the_largest_one_works(tiny_model, prompts):
    for seed in (2**64, -1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=MAX_SEED, ignore_eos=True)
    out = llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]


def test_a_bad_prompt_anywhere_in_a_batch_queues_nothing(tiny_model, prompts, expected):
    llm = make_tiny_llm(tiny_model, num_blocks=32)
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=1000)]  # the third can never fit the pool of 256 slots
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(prompts[:3], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.requests == {}
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 0.0])
def test_temperatures_near_zero_are_greedy(tiny_model, prompts, expected, temperature):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True)
    assert params.greedy
    assert tokens(llm.generate(prompts[:2], params, use_tqdm=False)) == expected[:2]


def test_greedy_sampling_with_n_above_one_is_refused():
    with pytest.raises(ValueError, match="n must be 1 with greedy"):
        SamplingParams(n=2, temperature=0.0)


# ---- 9. several end-of-sequence tokens ------------------------------------------------------------------------------


def test_a_list_of_eos_token_ids_stops_at_any_of_them(prompts, expected):
    model = tiny_llama()
    model.config.eos_token_id = [254, expected[0][3]]  # Llama 3 style: several ids end a turn
    llm = make_tiny_llm(model, num_blocks=128)
    out = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == expected[0][: expected[0].index(expected[0][3]) + 1]


# ---- 10. forks count against max_num_seqs -----------------------------------------------------------------------


def test_forks_count_against_max_num_seqs(tiny_model, prompts):
    llm = make_tiny_llm(tiny_model, num_blocks=128, max_num_seqs=4)
    with pytest.raises(ValueError, match="n \\(6\\) is more than max_num_seqs \\(4\\)"):
        llm.generate(prompts[0], SamplingParams(n=6, temperature=1.0))
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=0, ignore_eos=True)
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts[:3]]
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
        assert len(engine.scheduler.running) <= 4
    assert sorted(o.request_id for o in finished) == sorted(ids)
    assert all(len(c.token_ids) == 6 for o in finished for c in o.outputs)
    assert_pool_empty(llm)


# ---- inputs that are neither token ids nor text ---------------------------------------------------------------------

BAD_PROMPTS = [
    ([1.0, 2.0], "prompt\\[0\\] must be an integer"),
    ([3, 2.7], "prompt\\[1\\] must be an integer"),
    ([True, 5], "prompt\\[0\\] must be an integer"),
    ([[[1]]], "prompt\\[0\\] must be an integer"),
    ([1, [2]], "prompt\\[1\\] must be an integer"),
    (b"hello", "prompts must be"),
    (None, "prompts must be"),
    (torch.tensor([1, 2]), "tolist"),
    ([-1], "prompt\\[0\\] must be >= 0"),
    ("12", "tokenizer"),
    ([[1, 2], b"x"], "prompt must be a string or a list"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_prompts_that_are_not_token_ids_are_refused(tiny_model, prompts, expected, prompt, message):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_pool_empty(llm)
    assert tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]


def test_integer_scalars_of_numpy_and_torch_are_token_ids(tiny_model, prompts, expected):
    llm = make_tiny_llm(tiny_model, num_blocks=128)
    as_numpy = [np.int64(t) for t in prompts[0]]
    as_torch = [torch.tensor(t) for t in prompts[1]]
    assert tokens(llm.generate([as_numpy, tuple(as_torch)], GREEDY, use_tqdm=False)) == expected[:2]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
        (dict(stop_token_ids=[1, None]), "stop_token_ids\\[1\\]"),
        (dict(stop_token_ids=0), "stop_token_ids"),
        (dict(n=True), "n"),
        (dict(n=2.0), "n"),
        (dict(max_tokens="8"), "max_tokens"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=2.5), "top_k"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_sampling_params_name_what_is_wrong(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(block_size=True), "block_size"),
        (dict(num_blocks=True), "num_blocks"),
        (dict(max_num_seqs=1.5), "max_num_seqs"),
        (dict(max_num_batched_tokens=None), "max_num_batched_tokens"),
        (dict(num_blocks=None, kv_cache_memory=1000), "kv_cache_memory"),
        (dict(num_blocks=None, kv_cache_memory=-1), "kv_cache_memory"),
        (dict(num_blocks=None, kv_cache_memory="1GiB"), "kv_cache_memory"),
    ],
)
def test_engine_settings_name_what_is_wrong(tiny_model, kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_tiny_llm(tiny_model, **kwargs)


@pytest.mark.parametrize("model", [123, "llama-3-8b", None])
def test_an_unknown_model_is_named(model):
    with pytest.raises(ValueError, match="model must be 'smollm2'"):
        LLM(model=model, device="cpu")


# ---- the model's settings: honoured or refused by name --------------------------------------------------------------


def random_biases(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    return model


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(hidden_act="relu"), "hidden_act"),
        (
            dict(
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [4.0] * 8,
                    "original_max_position_embeddings": 32,
                }
            ),
            "longrope",
        ),
    ],
)
def test_llama_settings_the_engine_cannot_run_are_refused_by_name(overrides, name, prompts):
    model = random_biases(tiny_llama(**overrides))
    with pytest.raises(ValueError, match=name):
        make_tiny_llm(model)
    llm = make_tiny_llm(tiny_llama())  # a plain Llama still runs, and equals transformers
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == [
        hf_greedy(tiny_llama(), p, GREEDY.max_tokens, stop_at_eos=False) for p in prompts[:2]
    ]


def test_another_architecture_is_refused_by_name():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    other = GPTNeoXForCausalLM(
        GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(
        ValueError,
        match="GPTNeoXForCausalLM .*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM only",
    ):
        make_tiny_llm(other)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(head_dim=32),  # head_dim * heads != hidden_size
        dict(head_dim=8, num_attention_heads=8, num_key_value_heads=2),
        dict(tie_word_embeddings=False),
        dict(pretraining_tp=2),  # a training detail transformers ignores too
        dict(hidden_act="swish"),  # SiLU by its other name
        dict(rms_norm_eps=1e-2),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
        dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 128,
            }
        ),
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ],
    ids=lambda overrides: "-".join(
        f"{k}={v.get('rope_type', '') if isinstance(v, dict) else v}" for k, v in overrides.items()
    ),
)
def test_llama_settings_the_engine_honours_equal_transformers(overrides, prompts):
    model = tiny_llama(**overrides)
    outs = make_tiny_llm(model).generate(prompts[:3], GREEDY, use_tqdm=False)
    assert tokens(outs) == [hf_greedy(model, p, GREEDY.max_tokens, stop_at_eos=False) for p in prompts[:3]]


@pytest.mark.parametrize("architecture", ["gpt2", "llama-mlp-bias"])
def test_a_draft_model_folder_of_another_architecture_is_refused_by_name(tmp_path, prompts, architecture):
    from transformers import GPT2Config, GPT2LMHeadModel

    if architecture == "gpt2":
        other = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=4, n_positions=512))
    else:
        other = tiny_llama(mlp_bias=True)
    other.save_pretrained(tmp_path / architecture)
    tiny_llama(seed=1).save_pretrained(tmp_path / "llama")
    config = {"method": "draft_model", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]"):
        make_tiny_llm(tiny_llama(), speculative_config=config | {"model": str(tmp_path / architecture)})
    llm = make_tiny_llm(tiny_llama(), speculative_config=config | {"model": str(tmp_path / "llama")})
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == [
        hf_greedy(tiny_llama(), p, GREEDY.max_tokens, stop_at_eos=False) for p in prompts[:2]
    ]
    assert llm.spec_stats()["num_drafts"] > 0


# ---- properties ----------------------------------------------------------------------------------------------------

token_values = st.one_of(st.integers(-3, 300), st.booleans(), st.floats(-1, 300), st.none(), st.text(max_size=2))
prompt_values = st.one_of(
    st.lists(st.integers(0, 255), max_size=30),
    st.lists(token_values, min_size=1, max_size=6),
    st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=12), max_size=3),
    st.text(max_size=5),
    st.binary(max_size=3),
    st.integers(),
    st.none(),
)
param_values = st.fixed_dictionaries(
    {},
    optional={
        "n": st.one_of(st.integers(-1, 4), st.floats(0, 3), st.booleans()),
        "temperature": st.one_of(
            st.floats(-1, 3), st.sampled_from([1e-40, 1e-5, 0.0, float("nan"), float("inf")]), st.none()
        ),
        "top_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([1e-9, float("nan")])),
        "top_k": st.one_of(st.integers(-2, 300), st.floats(1, 3)),
        "max_tokens": st.one_of(st.integers(-1, 20), st.just(10**6), st.floats(1, 5)),
        "seed": st.one_of(st.none(), st.integers(-2, 2**64 + 1), st.floats(0, 9)),
        "stop_token_ids": st.one_of(st.none(), st.lists(token_values, max_size=3), st.integers(0, 255)),
        "ignore_eos": st.one_of(st.booleans(), st.integers(0, 1)),
    },
)


@pytest.fixture(scope="module")
def small_llm(tiny_model):
    return make_tiny_llm(tiny_model, num_blocks=40, block_size=8, max_num_seqs=4, max_num_batched_tokens=64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompt_values, kwargs=param_values)
def test_every_input_is_served_or_refused_by_name(small_llm, prompt, kwargs):
    """Accepted and served in full, or refused with a ValueError; either way the engine is as good as new."""
    try:
        params = SamplingParams(**kwargs)
        outputs = small_llm.generate(prompt, params, use_tqdm=False)
    except ValueError as error:
        assert str(error)
    else:
        assert all(len(o.outputs) == params.n for o in outputs)
        assert all(1 <= len(c.token_ids) <= params.max_tokens for o in outputs for c in o.outputs)
    assert not small_llm.engine.has_unfinished_requests() and small_llm.engine.requests == {}
    assert_pool_empty(small_llm)


def test_the_engine_is_still_right_after_every_refusal(small_llm, prompts, expected):
    assert tokens(small_llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


engine_settings = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(10, 40),
        "block_size": st.sampled_from([4, 8]),
        "max_num_seqs": st.integers(2, 6),
        "enable_chunked_prefill": st.booleans(),
        "max_num_batched_tokens": st.sampled_from([16, 24, 48, 256]),
        "enable_prefix_caching": st.just(True),
    }
)
operations = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort", "interrupt", "generate", "beam"]),
        st.integers(0, 10**6),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=engine_settings, ops=operations)
def test_random_operations_with_interrupts_keep_every_promise(tiny_model, config, ops):
    """add / step / abort / interrupted steps / generate / beam search, in any order, on tight pools and budgets:
    no leaked block, every request finished or aborted exactly once, greedy outputs equal a roomy run, and the
    prefix cache holds only computed K/V."""
    llm = make_tiny_llm(tiny_model, **config)
    engine = llm.engine
    prefix_of = record_cached_prefixes(llm)
    shared = random_prompts(1, seed=0, low=9, high=10)[0]
    roomy = make_tiny_llm(tiny_model, num_blocks=256)
    added, ended = {}, {}  # request id -> (prompt, params); request id -> "finished" / "aborted"

    def end(request_id, how):
        assert request_id not in ended, f"request {request_id} ended twice"
        ended[request_id] = how

    def finish(outputs):
        for output in outputs:
            end(output.request_id, "finished")
            prompt, params = added[output.request_id]
            if params.greedy:
                assert output.outputs[0].token_ids == tokens(roomy.generate(prompt, params, use_tqdm=False))[0]

    def new_request(value):
        prompt = (shared if value % 3 else []) + random_prompts(1, seed=value, low=1, high=12)[0]
        n = 1 + value % 3
        params = SamplingParams(
            n=n, temperature=0.0 if n == 1 and value % 2 else 1.0, max_tokens=1 + value % 6, seed=value, ignore_eos=True
        )
        return prompt, params

    for op, value in ops:
        if op == "add":
            prompt, params = new_request(value)
            try:
                request = engine.make_request(prompt, params)
            except ValueError:
                continue  # can never fit this pool: refused, nothing queued
            added[engine.add_request(request)] = (prompt, params)
        elif op == "abort" and engine.requests:
            request_id = sorted(engine.requests)[value % len(engine.requests)]
            engine.abort_request(request_id)
            end(request_id, "aborted")
        elif op == "interrupt" and engine.has_unfinished_requests():
            engine.forward_observers[:] = [FailOnForward(1)]
            with pytest.raises(Interrupt):
                finish(engine.step())
            engine.forward_observers.clear()
            cached_blocks_hold_their_tokens(llm, tiny_model, prefix_of)
        elif op in ("generate", "beam") and not engine.has_unfinished_requests():
            batch = [new_request(value + i)[0] for i in range(1 + value % 3)]
            engine.forward_observers[:] = [FailOnForward(1 + value % 4)] if value % 2 else []
            try:
                if op == "generate":
                    outs = llm.generate(batch, GREEDY, use_tqdm=False)
                    assert tokens(outs) == tokens(roomy.generate(batch, GREEDY, use_tqdm=False))
                else:
                    llm.beam_search(batch, beam_width=2, max_tokens=3)
            except (Interrupt, ValueError):
                pass
            engine.forward_observers.clear()
            assert not engine.has_unfinished_requests() and engine.requests == {}
        elif op == "step":
            finish(engine.step())
    while engine.has_unfinished_requests():
        finish(engine.step())
    assert set(ended) == set(added)
    assert engine.requests == {}
    assert_pool_empty(llm)
    cached_blocks_hold_their_tokens(llm, tiny_model, prefix_of)
