"""Prefix caching and copy-on-write: sharing blocks must never change what a sequence computes."""

from collections import Counter

from helpers import assert_pool_empty, make_tiny_llm, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(count: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    prefix = random_prompts(1, seed=seed, low=prefix_len, high=prefix_len + 1)[0]
    return [prefix + tail for tail in random_prompts(count, seed=seed + 1, low=1, high=20)]


def check_books(engine) -> None:
    """Ref counts equal the tables holding each block; a referenced block is never free; cache map is consistent."""
    manager = engine.block_manager
    holders = Counter(b for table in manager.block_tables.values() for b in table)
    free = {block.block_id for block in manager.free_queue}
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id]
        assert (block.block_id in free) == (block.ref_count == 0)
    for block_hash, block in manager.cached.items():
        assert block.block_hash == block_hash


def test_prefix_caching_keeps_outputs_and_hits(tiny_model):
    prompts = shared_prefix_prompts(6, prefix_len=40)
    plain = make_tiny_llm(tiny_model, num_blocks=128).generate(prompts, GREEDY, use_tqdm=False)
    llm = make_tiny_llm(tiny_model, num_blocks=128, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in plain]
    stats = llm.kv_stats()
    assert stats["prefix_hit_tokens"] == 5 * 40  # the 40-token prefix is five full blocks of 8, hit five times
    assert stats["prefix_query_tokens"] == sum(len(p) for p in prompts)
    assert stats["num_cached_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_model):
    prompt = random_prompts(1, seed=9, low=32, high=33)[0]  # exactly four blocks of 8
    llm = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    once = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert once == again
    assert llm.kv_stats()["prefix_hit_tokens"] == 24  # three blocks: the fourth holds the last prompt token


def test_eviction_reuses_the_least_recently_used_cached_block(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=12, enable_prefix_caching=True)
    prompts = random_prompts(6, seed=11, low=30, high=40)
    expected = [o.outputs[0].token_ids for o in make_tiny_llm(tiny_model).generate(prompts, GREEDY, use_tqdm=False)]
    got = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]  # pool churns
    assert got == expected
    check_books(llm.engine)


def test_parallel_sampling_on_shared_blocks_equals_independent_requests(tiny_model):
    """n completions fork from one prefill and share the prompt's blocks; each must sample exactly what an
    independent request with the same seed samples, so no child may see another child's writes."""
    prompt = random_prompts(1, seed=12, low=21, high=22)[0]  # 21 tokens: the third block is shared and partial
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=100, ignore_eos=True)
    llm = make_tiny_llm(tiny_model, num_blocks=64)
    engine = llm.engine
    engine.add_request(engine.make_request(prompt, params))
    engine.step()  # prefill + fork: four sequences now share three blocks
    manager = engine.block_manager
    tables = [manager.block_tables[seq.seq_id] for seq in engine.scheduler.running]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert [manager.ref_count(b) for b in tables[0]] == [4, 4, 4]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = {c.index: c.token_ids for c in out.outputs}
    for index in range(4):
        alone = SamplingParams(temperature=1.0, max_tokens=10, seed=100 + index, ignore_eos=True)
        assert outputs[index] == llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(t) for t in outputs.values()}) > 1
    assert_pool_empty(llm)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=40,
    )
)
def test_random_operations_keep_the_books(tiny_model, ops):
    """Requests with shared prefixes, n > 1, aborts and a small pool, in any order: no leak, exact ref counts."""
    llm = make_tiny_llm(tiny_model, num_blocks=24, block_size=4, enable_prefix_caching=True, max_num_seqs=6)
    engine = llm.engine
    prefix = random_prompts(1, seed=0, low=12, high=13)[0]
    for op, value in ops:
        if op == "add":
            tail = random_prompts(1, seed=value, low=1, high=10)[0]
            n = 1 + value % 3
            params = SamplingParams(
                n=n,
                temperature=0.0 if n == 1 and value % 2 else 1.0,
                max_tokens=1 + value % 7,
                ignore_eos=True,
                seed=value,
            )
            engine.add_request(engine.make_request(prefix + tail if value % 4 else tail, params))
        elif op == "abort" and engine.requests:
            engine.abort_request(sorted(engine.requests)[value % len(engine.requests)])
        else:
            engine.step()
        check_books(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_books(engine)
    assert engine.requests == {}
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and manager.block_tables == {}


def test_requests_admitted_in_one_step_share_a_prefix(tiny_model):
    """Blocks are registered when scheduled, so the second request of a step reuses what the first computes in
    that same forward pass (each layer writes the step's K/V before attention reads them)."""
    prompts = shared_prefix_prompts(6, prefix_len=40)
    plain = make_tiny_llm(tiny_model, num_blocks=128).generate(prompts, GREEDY, use_tqdm=False)
    llm = make_tiny_llm(tiny_model, num_blocks=128, enable_prefix_caching=True)
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in plain]
    assert llm.kv_stats()["prefix_hit_tokens"] == 5 * 40
