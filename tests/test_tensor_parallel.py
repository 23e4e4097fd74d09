"""Tensor parallelism (model/tensor_parallel.py, engine/multiproc_executor.py): N ranks give the tokens one rank gives.

Every engine here is rank 0 of two (three for SmolLM2) processes over gloo. The models are random, with the shapes
that make sharding go wrong: GQA 1:1 and 4:1, fewer KV heads than ranks (each rank holds a copy of one), Qwen2's
q/k/v biases, Qwen3's q/k norms, a vocabulary of 331 (odd: the last rank's slice is padded). Each run has the prefix
cache, chunked prefill, preemption and n > 1 at work. fp32 sums of partial products in another order may move a
near-tie: where tokens part, the test prints the margin and requires it to be one of rounding.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import assert_near_tie, assert_pool_empty, tiny_llama
from test_checkpoints import ENGINE, PROMPTS, random_model, save

from paged import LLM, SamplingParams
from paged.model.tensor_parallel import check_tensor_parallel, plan_shard

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TWO = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, n=2)  # forks, copy-on-write
FP32_TIE = 1e-4  # a margin fp32 rounding can cross: 1e-4 of the largest logit


def run(llm: LLM) -> list[list[list[int]]]:
    params = [TWO] + [GREEDY] * (len(PROMPTS) - 1)
    return [[c.token_ids for c in out.outputs] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_same_tokens(label: str, model, ours, theirs) -> None:
    """The sampled completions (first prompt) equal; a seeded draw lands within rounding of a boundary between two
    tokens with a probability of about 1e-6. Greedy ones equal up to near-ties."""
    assert ours[0] == theirs[0]
    for prompt, a, b in zip(PROMPTS[1:], ours[1:], theirs[1:]):
        assert_near_tie(label, model, prompt, a[0], b[0], relative=FP32_TIE)


def tp_vs_single(model, **settings):
    """(tp=1 outputs, tp=2 outputs, the tp=2 LLM still running) on the same model and settings."""
    single = LLM(model=model, **{**ENGINE, **settings})
    expected = run(single)
    llm = LLM(model=model, tensor_parallel_size=2, **{**ENGINE, **settings})
    return single, expected, llm, run(llm)


@pytest.mark.parametrize("name", ["llama-1to1-hd64", "qwen2-4to1-hd64", "qwen3-1to1-hd64", "qwen3-4to1-hd128"])
def test_two_ranks_give_one_ranks_tokens(name):
    model = random_model(name)
    single, expected, llm, got = tp_vs_single(model)
    try:
        assert llm.kv_stats()["num_preemptions"] > 0 and llm.kv_stats()["prefix_hit_tokens"] > 0
        assert_same_tokens(name, model, got, expected)
        assert_pool_empty(llm)
    finally:
        llm.shutdown()


def test_gqa_4_to_1_with_a_kv_head_per_rank_and_each_pool_holds_its_heads():
    """8 query heads, 2 KV heads, 2 ranks: each rank's pool holds one KV head, and exactly what one rank's pool holds
    for that head, block for block (the block tables are the same on every rank)."""
    model = tiny_llama(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    single, expected, llm, got = tp_vs_single(model, num_blocks=64, block_size=8)
    try:
        assert_same_tokens("gqa 4:1", model, got, expected)
        info = llm.collective_rpc("kv_cache_info")
        assert [i["kv_head_ids"] for i in info] == [[0], [1]]
        assert [i["q_head_ids"] for i in info] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        whole = single.engine.kv_cache
        assert all(i["bytes_per_token"] * 2 == whole.nbytes // (whole.num_blocks * whole.block_size) for i in info)
        assert all(i["num_blocks"] == single.engine.block_manager.num_blocks for i in info)
        blocks = list(range(16))  # written by the run, identically scheduled on both engines
        for rank, pool in enumerate(llm.collective_rpc("read_blocks", (blocks,))):
            torch.testing.assert_close(pool, whole.storage[:, :, blocks, :, rank : rank + 1], atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_fewer_kv_heads_than_ranks_are_copied():
    shard = [plan_shard(random_model("qwen2-4to1-hd64").config, 331, rank, 2) for rank in range(2)]
    assert [list(s.kv_heads) for s in shard] == [[0], [0]]
    assert [list(s.q_heads) for s in shard] == [[0, 1], [2, 3]]
    assert [len(s.vocab) for s in shard] == [166, 165] and shard[1].vocab_per_rank == 166


def test_sizes_that_do_not_split_the_model_are_refused():
    config = tiny_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8).config
    for size, words in [
        (4, "query heads"),
        (2, "KV heads"),
        (3, "intermediate_size"),
        (0, "positive"),
        (True, "positive"),
    ]:
        with pytest.raises(ValueError, match=f"tensor_parallel_size.*{words}|{words}.*tensor_parallel_size"):
            check_tensor_parallel(config, size)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(
            model=tiny_llama(),
            tensor_parallel_size=2,
            device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_smollm2_on_three_ranks(smollm2, chat_prompts):
    """9 query heads and 3 KV heads: three ranks of one KV head each; two ranks do not divide them."""
    hf_model, _ = smollm2
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the model's 9 query heads"):
        LLM(model="smollm2", tensor_parallel_size=2)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    settings = dict(num_blocks=64, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(model="smollm2", **settings).generate(chat_prompts[:3], params, use_tqdm=False)
    ]
    llm = LLM(model="smollm2", tensor_parallel_size=3, **settings)
    try:
        outputs = llm.generate(chat_prompts[:3], params, use_tqdm=False)
        for prompt, out, tokens in zip(chat_prompts, outputs, expected):
            assert_near_tie(
                "smollm2 tp=3", hf_model, out.prompt_token_ids, out.outputs[0].token_ids, tokens, relative=FP32_TIE
            )
        assert [i["kv_head_ids"] for i in llm.collective_rpc("kv_cache_info")] == [[0], [1], [2]]
    finally:
        llm.shutdown()


def test_aborts_leave_nothing_and_a_killed_rank_is_named():
    model = tiny_llama()
    llm = LLM(model=model, tensor_parallel_size=2, device="cpu", num_blocks=32, block_size=8)
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request(engine.make_request(prompt, GREEDY))
    engine.step()
    engine.step()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    assert_pool_empty(llm)
    assert [len(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == [10] * 4
    worker = llm.engine.executor.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while llm.engine.executor.health.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) died with exit code -9"):
        llm.engine.check_health()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not any(p.is_alive() for p in llm.engine.executor.processes)


def test_a_step_cut_short_stops_the_engine_and_shutdown_ends_the_workers():
    llm = LLM(model=tiny_llama(), tensor_parallel_size=2, device="cpu", num_blocks=32, block_size=8)
    forward = llm.engine.model.forward

    def fails_halfway(*args, **kwargs):
        llm.engine.model.forward = forward  # once
        raise KeyboardInterrupt

    llm.engine.model.forward = fails_halfway
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_pool_empty(llm)  # the step was undone on rank 0
    with pytest.raises(RuntimeError, match="a step was cut short"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not any(p.is_alive() for p in llm.engine.executor.processes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_started_as_torchrun_starts_them(tmp_path, monkeypatch):
    """Rank 1 is `python -m paged worker`, a process of its own that only knows torchrun's variables; rank 0 is
    this process's LLM. The worker gets the model folder from rank 0, and stops when rank 0 shuts down."""
    model = random_model("llama-1to1-hd64")
    folder = save(model, tmp_path / "model")
    expected = LLM(model=str(folder), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "paged", "worker"], env={**os.environ, **world, "RANK": "1"})
    try:
        for name, value in {**world, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        llm = LLM(model=str(folder), tensor_parallel_size=2, **ENGINE)
        assert llm.engine.executor.processes == []  # nothing spawned: the launcher started rank 1
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, out, want in zip(PROMPTS, got, expected):
            assert_near_tie(
                "two nodes", model, prompt, out.outputs[0].token_ids, want.outputs[0].token_ids, relative=FP32_TIE
            )
        llm.shutdown()
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()


def test_the_server_on_two_ranks_answers_as_generate_and_reports_a_dead_rank():
    """python -m paged serve --tensor-parallel-size 2, in process: completions equal LLM.generate's on the same
    engine; /health turns 503, naming the rank, once a worker is killed."""
    import httpx

    from paged.serving.api_server import build_app, serve_in_thread, serving_llm

    llm, _ = serving_llm(
        tiny_llama(), tensor_parallel_size=2, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, device="cpu"
    )
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        with serve_in_thread(build_app(llm, "m")) as url:
            for prompt, tokens in zip(PROMPTS, expected):
                answer = httpx.post(
                    f"{url}/v1/completions",
                    timeout=30,
                    json={
                        "model": "m",
                        "prompt": prompt,
                        "max_tokens": 10,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                ).json()
                assert answer["choices"][0]["token_ids"] == tokens
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            worker = llm.engine.executor.processes[0]
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(timeout=10)
            deadline = time.monotonic() + 10
            while llm.engine.executor.health.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            health = httpx.get(f"{url}/health", timeout=30)
            assert health.status_code == 503 and "rank 1" in health.json()["error"]
    finally:
        llm.shutdown()
