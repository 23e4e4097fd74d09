"""What tensor parallelism costs and saves (paged/analysis/parallel_cost.py): the KV heads and bytes of each rank against
hand-computed values, vLLM's replication rule, the guide's §1 and §8 deployments, the all-reduce model, data
parallelism against tensor parallelism, and a real all-reduce between spawned gloo ranks."""

import multiprocessing

import pytest

from paged.analysis.parallel_cost import (
    H100_NVLINK,
    LLAMA3_70B,
    NVLINK4_H100_ONE_WAY,
    SMOLLM2,
    AllReduceTimes,
    Link,
    all_reduce_bytes,
    all_reduce_seconds,
    all_reduces_per_step,
    blocks_per_rank,
    bytes_per_token_per_rank,
    deployment,
    first_replicating_tp_size,
    fit_all_reduce,
    free_kv_bytes_per_card,
    kv_head_copies,
    kv_heads_by_rank,
    measure_all_reduce,
    parallel_plans,
    rank_pools,
    ring_all_reduce_bytes,
    smollm2_sizes,
    tp_step_seconds,
    vllm_accepts,
)
from paged.geometry import GiB, KiB, KVGeometry, MiB

LLAMA = KVGeometry.llama3_70b()


def test_heads_are_split_in_runs_and_replicated_past_their_number():
    assert kv_heads_by_rank(8, 1) == [tuple(range(8))]
    assert kv_heads_by_rank(8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert kv_heads_by_rank(8, 8) == [(h,) for h in range(8)]
    assert kv_heads_by_rank(8, 16) == [(r // 2,) for r in range(16)]  # vLLM: head = rank // (N / heads)
    assert kv_heads_by_rank(2, 4) == [(0,), (0,), (1,), (1,)]
    assert kv_head_copies(8, 4) == [1] * 8 and kv_head_copies(8, 16) == [2] * 8 and kv_head_copies(2, 8) == [4, 4]
    assert kv_heads_by_rank(3, 2) == [(0,), (1, 2)]  # uneven: vLLM refuses it, see below
    for heads, n in [(8, 3), (3, 4), (3, 5), (8, 64)]:
        held = kv_heads_by_rank(heads, n)
        assert len(held) == n and all(held) and sorted({h for r in held for h in r}) == list(range(heads))
    with pytest.raises(ValueError, match="tp_size"):
        kv_heads_by_rank(8, 0)


def test_vllm_accepts_sizes_that_divide_the_heads():
    assert [n for n in range(1, 65) if vllm_accepts(64, 8, n)] == [1, 2, 4, 8, 16, 32, 64]
    assert [n for n in range(1, 10) if vllm_accepts(9, 3, n)] == [1, 3, 9]  # SmolLM2: not 2
    assert first_replicating_tp_size(64, 8) == 16
    assert first_replicating_tp_size(9, 3) == 9
    assert first_replicating_tp_size(32, 32) is None  # query heads run out with the KV heads


def test_bytes_per_token_per_rank_by_hand():
    # Llama-3-70B fp16: 2 x 80 layers x 8 heads x 128 x 2 B = 320 KiB; each rank keeps its heads' share
    assert [bytes_per_token_per_rank(LLAMA, n) for n in (1, 2, 4, 8)] == [327_680, 163_840, 81_920, 40_960]
    assert bytes_per_token_per_rank(LLAMA, 16) == 40_960  # replicated: stops shrinking at 1 head
    pools = rank_pools(LLAMA, 4, block_size=16)
    assert [p.kv_head_ids for p in pools] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(p.block_bytes == 16 * 81_920 for p in pools)  # 1.25 MiB: 5 MiB over 4
    smol = SMOLLM2.geometry(4)  # 46,080 B in fp32, 3 KV heads
    assert smol.bytes_per_token == 46_080
    assert [p.bytes_per_token for p in rank_pools(smol, 3)] == [15_360] * 3
    assert [p.bytes_per_token for p in rank_pools(smol, 2)] == [15_360, 30_720]


def test_one_table_for_all_ranks_so_the_fullest_rank_counts_the_blocks():
    smol = SMOLLM2.geometry(4)
    block_1head = 16 * 15_360
    assert blocks_per_rank(smol, 3, 10 * block_1head) == 10
    assert blocks_per_rank(smol, 2, 10 * block_1head) == 5  # rank 1 holds two heads
    assert blocks_per_rank(LLAMA, 1, 40 * GiB) == 8192  # chapter 1's pool


def test_the_guide_s_section_1_two_cards():
    # the guide's own round figures: 2 x 80 GB - 140 GB leaves 20 GB for both cards, 10 GB each
    nominal = deployment(LLAMA, 140e9, 2, card_bytes=80e9)
    assert nominal.free_bytes_per_card == pytest.approx(10e9)
    assert nominal.bytes_per_token_per_rank == 160 * KiB
    assert nominal.tokens == 10e9 // (16 * 160 * KiB) * 16 == 61_024
    assert nominal.requests == 29  # 2,048-token requests, not ~50
    # as NVML counts an H100 (81,559 MiB) with 70.6 B weights: about 15 GB a card, 44 requests
    real = deployment(LLAMA, LLAMA3_70B.weight_bytes(2), 2)
    assert real.free_bytes_per_card / 1e9 == pytest.approx(14.92, abs=0.01)
    assert real.requests == 44
    assert deployment(LLAMA, LLAMA3_70B.weight_bytes(2), 1).fits is False  # one card cannot hold 141 GB
    # vLLM's default share of the card leaves much less
    assert deployment(LLAMA, LLAMA3_70B.weight_bytes(2), 2, utilization=0.92).requests == 24


def test_the_guide_s_section_8_four_cards():
    four = deployment(LLAMA, LLAMA3_70B.weight_bytes(2), 4)
    assert four.free_bytes_per_card / GiB == pytest.approx(46.8, abs=0.05)  # the guide's "~50 GiB"
    assert four.bytes_per_token_per_rank == 80 * KiB
    assert four.tokens == four.blocks * 16 and four.blocks == int(four.free_bytes_per_card // (16 * 80 * KiB))
    assert four.requests == 299  # 187 GiB / 640 MiB
    assert deployment(LLAMA, 140e9, 4, card_bytes=80e9).free_bytes_per_card == pytest.approx(45e9)
    assert free_kv_bytes_per_card(80e9, 140e9, 4, utilization=0.92) == pytest.approx(0.92 * 80e9 - 35e9)
    with pytest.raises(ValueError, match="utilization"):
        free_kv_bytes_per_card(80e9, 140e9, 4, utilization=1.5)


def test_ring_all_reduce_and_its_time():
    assert ring_all_reduce_bytes(1000, 2) == 1000  # 2 (N-1)/N = 1 at N = 2
    assert ring_all_reduce_bytes(1000, 4) == 1500
    assert ring_all_reduce_bytes(1000, 1) == 0
    assert all_reduce_seconds(1000, 1, 1e9) == 0  # nothing to add up on one rank
    assert all_reduce_seconds(900, 4, 450e9, latency=10e-6) == pytest.approx(10e-6 + 1350 / 450e9)
    assert all_reduces_per_step(30) == 61 and all_reduces_per_step(80, vocab_parallel_embedding=False) == 160
    assert all_reduce_bytes(64, 8192, 2) == MiB  # 64 decode tokens of 70B in bf16
    assert smollm2_sizes() == {"decode step": 32 * 576 * 4, "prefill chunk": 512 * 576 * 4}
    with pytest.raises(ValueError, match="bandwidth"):
        all_reduce_seconds(1000, 2, 0)


def test_tp_pays_for_the_70b_and_not_for_smollm2():
    step = {n: tp_step_seconds(LLAMA3_70B, n, H100_NVLINK, num_tokens=64) for n in (1, 2, 4, 8)}
    assert step[2]["weights_s"] == pytest.approx(141.2e9 / 2 / 3.35e12)
    assert step[1]["all_reduce_s"] == 0 and step[8]["all_reduces"] == 161
    assert step[8]["all_reduce_s"] == pytest.approx(161 * (10e-6 + 2 * 7 / 8 * MiB / NVLINK4_H100_ONE_WAY))
    assert step[2]["step_s"] > step[4]["step_s"] > step[8]["step_s"]
    for latency in (5e-6, 50e-6):  # the assumption does not decide it
        link = Link("nvlink", 3.35e12, NVLINK4_H100_ONE_WAY, latency)
        assert tp_step_seconds(LLAMA3_70B, 8, link, 64)["step_s"] < tp_step_seconds(LLAMA3_70B, 4, link, 64)["step_s"]
        assert tp_step_seconds(SMOLLM2, 3, link, 64)["step_s"] > tp_step_seconds(SMOLLM2, 1, link, 64)["step_s"]
    cores = Link("cores", 10e9, 2e9, 200e-6, shared_memory=True)
    one, two = (tp_step_seconds(SMOLLM2, n, cores, 32, 4) for n in (1, 2))
    assert two["weights_s"] == one["weights_s"] and two["step_s"] > one["step_s"]  # shared memory: no gain


def test_model_shapes():
    assert SMOLLM2.params == 134_515_008  # SmolLM2-135M, tied embeddings
    assert LLAMA3_70B.weight_bytes(2) == pytest.approx(141.2e9)
    assert SMOLLM2.geometry(2).bytes_per_token == 23_040


def test_data_parallel_against_tensor_parallel():
    plans = {(p.tp_size, p.dp_size): p for p in parallel_plans(LLAMA3_70B, 8)}
    assert sorted(plans) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert not plans[1, 8].fits and plans[1, 8].tokens_total == 0  # the 70B fits no single card
    assert plans[8, 1].tokens_total > plans[4, 2].tokens_total > plans[2, 4].tokens_total  # copies of the weights
    assert plans[2, 4].weight_copies == 4 and plans[2, 4].all_reduces_per_step == 161
    small = {(p.tp_size, p.dp_size): p for p in parallel_plans(SMOLLM2, 3)}
    assert sorted(small) == [(1, 3), (3, 1)]  # 3 cards: TP 3 or three replicas
    assert small[1, 3].fits and small[1, 3].all_reduces_per_step == 0
    assert small[1, 3].tokens_total / small[3, 1].tokens_total > 0.99  # the copies cost next to nothing
    assert small[1, 3].tokens_per_replica < small[3, 1].tokens_per_replica  # but one request sees one pool


def test_fit_recovers_the_model():
    fastest = {s: 1e-4 + ring_all_reduce_bytes(s, 2) / 2e9 for s in (4096, 65536, 1 << 20, 1 << 22)}
    latency, bandwidth = fit_all_reduce(AllReduceTimes(2, fastest, True))
    assert latency == pytest.approx(1e-4, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_measure_all_reduce_between_spawned_ranks():
    sizes, before = smollm2_sizes(), set(multiprocessing.active_children())
    times = measure_all_reduce(world_size=2, sizes=sizes.values(), repeats=5)
    assert times.correct and times.world_size == 2
    assert sorted(times.fastest) == sorted(sizes.values())
    assert all(t > 0 for t in times.fastest.values())
    assert set(multiprocessing.active_children()) <= before  # every rank has exited
    with pytest.raises(ValueError, match="world_size"):
        measure_all_reduce(world_size=1)
    with pytest.raises(ValueError, match="multiples of 4"):
        measure_all_reduce(sizes=[6])


def test_prefill_splits_the_flops_and_pays_all_reduces_that_grow_with_the_tokens():
    from paged.analysis.parallel_cost import tp_prefill_seconds

    one = tp_prefill_seconds(LLAMA3_70B, 1, H100_NVLINK, 2048)
    assert one["compute_s"] == pytest.approx(2 * 70.6e9 * 2048 / (989.4e12 * 0.5)) and one["all_reduce_s"] == 0
    eight = tp_prefill_seconds(LLAMA3_70B, 8, H100_NVLINK, 2048)
    assert eight["compute_s"] == pytest.approx(one["compute_s"] / 8)
    assert eight["bytes_per_all_reduce"] == 2048 * 8192 * 2
    share = {n: tp_prefill_seconds(LLAMA3_70B, 8, H100_NVLINK, n, efficiency=0.5) for n in (2048, 8192)}
    ratio = [s["all_reduce_s"] / s["compute_s"] for s in share.values()]
    assert ratio[0] == pytest.approx(ratio[1], rel=0.1)  # the latency is small beside the bytes


def test_launch_env_numbers_ranks_node_by_node():
    from paged.analysis.parallel_cost import launch_env

    env = launch_env(nnodes=2, nproc_per_node=8, master_addr="10.0.0.1")
    assert len(env) == 16 and [e["RANK"] for e in env] == list(range(16))
    assert env[9] == {
        "GROUP_RANK": 1,
        "LOCAL_RANK": 1,
        "RANK": 9,
        "WORLD_SIZE": 16,
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": 29500,
    }


def test_ranks_that_overrun_the_timeout_are_killed():
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="timed out"):
        measure_all_reduce(world_size=2, repeats=1, timeout=0.01)
    assert set(multiprocessing.active_children()) <= before
