"""Disaggregated prefill and decode (paged/disagg.py): the same tokens as transformers and the colocated LLM, blocks
that arrive bit-exact, and workers that die or hang giving a clear error with no process left behind.

Starting a pair of workers costs seconds (each imports torch and builds its engine), so the correctness tests share
one pair; the fault tests need their own.
"""

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from helpers import hf_greedy, make_tiny_llm, random_prompts, tiny_llama

from paged import SamplingParams
from paged.disagg import DisaggregatedLLM, WorkerError
from paged.geometry import KVGeometry, cdiv

BLOCK_SIZE = 8
NUM_BLOCKS = 48  # 384 token slots per worker: a batch of long requests makes the decode worker wait for room


def start_pair(model, **kwargs) -> DisaggregatedLLM:
    kwargs.setdefault("num_blocks", NUM_BLOCKS)
    return DisaggregatedLLM(model, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32, **kwargs)


def assert_gone(pids) -> None:
    """The workers have exited and were reaped: no such process remains."""
    alive = {child.pid for child in multiprocessing.active_children()}
    for pid in pids:
        assert pid not in alive
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def pair(tiny_model):
    with start_pair(tiny_model, verify_transfers=True) as llm:
        pids = list(llm.pids.values())
        yield llm
    assert_gone(pids)  # leaving the with block stopped both workers


def test_greedy_tokens_equal_transformers(pair, tiny_model):
    prompts = random_prompts(6, seed=1)
    outs = pair.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [out.prompt_token_ids for out in outs] == prompts  # in prompt order
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 24, stop_at_eos=False)
        assert out.outputs[0].finish_reason == "length"
        times = out.metrics.token_times  # all from the decode worker, which samples the first token again
        assert len(times) == 24 and times == sorted(times) and times[0] == out.metrics.first_token_time
        assert out.metrics.arrival_time <= times[0] <= out.metrics.finished_time


def test_greedy_with_eos_and_a_crowded_decode_pool_equals_colocated(pair, tiny_model):
    """Twelve requests of up to 60 + 64 tokens need more than the decode worker's 384 slots: it takes requests in
    as blocks free up, and may preempt (recompute locally); the tokens and their log-probabilities stay those of
    one colocated LLM."""
    prompts = random_prompts(12, seed=2)
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=1)
    expected = make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False)
    outs = pair.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    for out, colocated in zip(outs, expected):
        ours, theirs = out.outputs[0].logprobs, colocated.outputs[0].logprobs
        assert [list(entry) for entry in ours] == [list(entry) for entry in theirs]
        assert [lp.logprob for entry in ours for lp in entry.values()] == pytest.approx(
            [lp.logprob for entry in theirs for lp in entry.values()], abs=1e-4
        )
    assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in expected]
    for out in outs + expected:  # one time per output token, in both engines
        assert len(out.metrics.token_times) == len(out.outputs[0].token_ids)


def test_seeded_sampling_draws_the_colocated_stream(pair, tiny_model):
    """The decode worker's sequence seeds its generator from the request's seed, as the colocated LLM's does, and
    draws every token from it, the first one again (the prefill worker drew it only to learn whether to go on)."""
    prompts = random_prompts(4, seed=3)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i) for i in range(4)]
    expected = make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False)
    outs = pair.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_blocks_arrive_bit_exact_and_only_the_prompts_blocks_move(pair, tiny_model):
    prompts = [list(range(1, 1 + n)) for n in (1, 7, 8, 9, 33)]  # block boundaries: 1, 1, 1, 2, 5 blocks
    before = len(pair.transfer_log())
    outs = pair.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    log = pair.transfer_log()[before:]
    assert sorted(t["request_id"] for t in log) == sorted(o.request_id for o in outs)
    geometry = KVGeometry.from_config(tiny_model.config, torch.float32)
    by_id = {t["request_id"]: t for t in log}
    for prompt, out in zip(prompts, outs):
        record = by_id[out.request_id]
        assert record["num_blocks"] == cdiv(len(prompt), BLOCK_SIZE)
        assert record["num_bytes"] == record["num_blocks"] * geometry.block_bytes(BLOCK_SIZE)
        assert record["received_digest"] == record["sent_digest"]  # what arrived is what was sent
    assert len({t["sent_digest"] for t in log}) == len(log)  # each request's K/V differ
    stats = pair.transfer_stats()
    assert stats["blocks_sent"] == sum(t["num_blocks"] for t in pair.transfer_log())
    assert stats["bytes_sent"] == sum(t["num_bytes"] for t in pair.transfer_log())
    assert stats["seconds"] > 0


def test_a_request_the_first_token_ends_moves_no_blocks(pair, tiny_model):
    prompts = random_prompts(3, seed=4)
    before = pair.transfer_stats()["blocks_sent"]
    outs = pair.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    expected = make_tiny_llm(tiny_model).generate(
        prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert pair.transfer_stats()["blocks_sent"] == before


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([300], SamplingParams(), "vocabulary"),
        ([1] * 600, SamplingParams(), "max_model_len"),
        ([1] * 300, SamplingParams(max_tokens=100), "decode worker's KV pool"),
        ([1, 2], SamplingParams(n=2, temperature=1.0), "n must be 1"),
        ([1, 2], "greedy", "SamplingParams"),
        ("text", SamplingParams(), "tokenizer"),
    ],
)
def test_bad_input_is_refused_before_anything_is_sent(pair, prompt, params, match):
    before = pair.transfer_stats()
    with pytest.raises(ValueError, match=match):
        pair.generate([[5, 6, 7], prompt], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert pair.transfer_stats() == before
    out = pair.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # still serves
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": "soon"}, "timeout"),
        ({"startup_timeout": -1}, "startup_timeout"),
        ({"num_threads": 0}, "num_threads"),
        ({"block_size": 12}, "block_size"),
        ({"preemption_mode": "swap"}, "preemption_mode"),
        # the engines' own arguments, checked in the caller as each engine would
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 2.5}, "num_blocks"),
        ({"kv_cache_memory": 1000}, "kv_cache_memory"),
        ({"kv_cache_memory": "1GiB"}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": None}, "max_num_batched_tokens"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"dtype": "float16"}, "dtype"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"speculative_config": {"method": "magic"}}, "speculative_config"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 1e-9}, "kv_offloading_size"),
        ({"kv_offloading_size": 0.01}, "kv_offloading_size needs enable_prefix_caching"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 0.01, "kv_offload_dir": ""}, "kv_offload_dir"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 1e6}, "kv_offloading_size .* available host memory"),
        ({"enable_lora": True}, "enable_lora"),
        ({"num_gpu_blocks": 64}, "'num_gpu_blocks' is not an engine argument"),
    ],
)
def test_bad_settings_are_refused_before_a_worker_starts(tiny_model, kwargs, match):
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=match):
        DisaggregatedLLM(tiny_model, **{"block_size": BLOCK_SIZE, **kwargs})
    with pytest.raises(ValueError, match="model"):
        DisaggregatedLLM("gpt2")
    assert {child.pid for child in multiprocessing.active_children()} == before


@pytest.mark.parametrize(
    "overrides, match", [(dict(attention_bias=True), "attention_bias"), (dict(hidden_act="gelu"), "hidden_act")]
)
def test_a_model_the_engine_cannot_run_is_refused_before_a_worker_starts(overrides, match):
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=match):
        start_pair(tiny_llama(**overrides))
    assert {child.pid for child in multiprocessing.active_children()} == before


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_worker_that_dies_while_starting_is_named_at_once(tiny_model, role):
    """A worker killed as it starts (the out-of-memory killer, say) leaves its peer waiting for it in the
    rendezvous; the caller watches both from the start and names the dead one, long before startup_timeout."""
    killed_at, before = [], {child.pid for child in multiprocessing.active_children()}  # other tests' workers

    def kill_when_started():
        while True:
            for child in multiprocessing.active_children():
                if child.name == f"paged-{role}-worker" and child.pid not in before | {None}:
                    os.kill(child.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_when_started, daemon=True)
    killer.start()
    with pytest.raises(WorkerError, match=f"the {role} worker .* died with exit code -9"):
        start_pair(tiny_model, startup_timeout=600)
    named_at = time.monotonic()
    killer.join()
    assert named_at - killed_at[0] < 10  # seconds, against a startup_timeout of 600
    assert {child.pid for child in multiprocessing.active_children()} <= before


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_worker_is_a_clear_error_and_nothing_is_left(tiny_model, role):
    llm = start_pair(tiny_model, timeout=30)
    pids = list(llm.pids.values())
    prompts = random_prompts(32, seed=5)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)  # seconds of work: killed midway
    killer = threading.Timer(0.5, os.kill, (llm.pids[role], signal.SIGKILL))
    killer.start()
    with pytest.raises(WorkerError, match=f"the {role} worker .* died with exit code -9"):
        llm.generate(prompts, params, use_tqdm=False)
    killer.join()
    assert_gone(pids)
    with pytest.raises(WorkerError, match="closed"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)


def test_a_worker_that_stops_answering_times_out(tiny_model):
    llm = start_pair(tiny_model, timeout=2)
    pids = list(llm.pids.values())
    os.kill(llm.pids["decode"], signal.SIGSTOP)  # alive, but silent
    with pytest.raises(WorkerError, match="no answer .* in 2 s"):
        llm.generate(random_prompts(2, seed=6), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert_gone(pids)


def test_dropping_the_object_stops_its_workers(tiny_model):
    llm = start_pair(tiny_model)
    pids = list(llm.pids.values())
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    del llm
    gc.collect()
    assert_gone(pids)


def test_the_two_workers_own_their_tier_files_in_one_folder(tiny_model, tmp_path):
    """Both workers keep a prefix tier in the same folder: each in its own file, so the prefill worker's tier hits
    (a system prompt its small pool forgot) are its own K/V, and the tokens equal transformers'. A first request
    that ends at its first token fills slots in the prefill worker's tier only: from then on the two tiers would
    put different blocks in the same slots of a shared file."""
    system = random_prompts(1, seed=7, low=40, high=41)[0]
    fillers = random_prompts(3, seed=8, low=80, high=81)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with start_pair(
        tiny_model, num_blocks=12, enable_prefix_caching=True, kv_offloading_size=0.01, kv_offload_dir=tmp_path
    ) as llm:
        pids = list(llm.pids.values())
        assert len(list(tmp_path.glob("paged-prefix-*.kv"))) == 2
        llm.generate(random_prompts(1, seed=10, low=16, high=17), SamplingParams(max_tokens=1), use_tqdm=False)
        for question in random_prompts(3, seed=9, low=5, high=9):
            prompt = system + question
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, 12, stop_at_eos=False)
            llm.generate([fillers.pop()], params, use_tqdm=False)  # the pools forget the system prompt
    assert_gone(pids)
    assert list(tmp_path.iterdir()) == []  # each worker deleted its own file as it stopped


def test_smollm2_answers_paris_disaggregated(smollm2, chat_prompts):
    """The bundled model, with its tokenizer in the caller: text decoded, tokens equal transformers'."""
    model, _ = smollm2
    with DisaggregatedLLM("smollm2", block_size=16, num_blocks=64, device="cpu", dtype=torch.float32) as llm:
        pids = list(llm.pids.values())
        out = llm.generate(chat_prompts[0], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert_gone(pids)  # leaving the with block stopped both workers
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 16)
