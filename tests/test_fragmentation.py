"""Naive slabs vs paged blocks: the guide's four-request example, the arena, and invariants over random traces."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.analysis.fragmentation import (
    EXTERNAL,
    INTERNAL,
    LIVE,
    PAPER_ORCA_USAGE,
    PAPER_VLLM_USAGE,
    RESERVED,
    FirstFitArena,
    compare,
    four_request_example,
    reservation_tokens,
    simulate,
)
from paged.analysis.traces import TraceRequest, sharegpt_trace


def test_four_request_example():
    example = four_request_example()
    naive, paged = example["naive"].breakdown, example["paged"].breakdown
    assert np.bincount(example["naive"].states, minlength=5)[LIVE] == 2880
    assert (naive.live, naive.allocated) == (2880, 8192)
    assert f"{100 * naive.wasted_fraction:.1f}" == "64.8"
    assert (naive.reserved, naive.internal) == (920, 4392)
    assert (paged.live, paged.allocated) == (2880, 181 * 16)
    assert paged.wasted_fraction < 0.01


def test_reservation_policies():
    assert [reservation_tokens(p, 300, 2048) for p in ("max", "pow2", "oracle")] == [2048, 512, 300]
    assert reservation_tokens("pow2", 256, 2048) == 256
    with pytest.raises(ValueError, match="policy must be one of"):
        reservation_tokens("best", 300, 2048)


def test_first_fit_strands_free_space():
    arena = FirstFitArena(10)
    starts = [arena.allocate(3), arena.allocate(3), arena.allocate(3)]
    assert starts == [0, 3, 6]
    arena.free(0, 3)
    arena.free(6, 3)  # 7 slots free, in holes of 3 and 4
    assert (arena.free_slots, arena.largest_hole) == (7, 4)
    assert arena.allocate(5) is None  # fits in the total, in no hole: external fragmentation
    arena.free(3, 3)  # the holes merge back into one
    assert arena.holes == [(0, 10)]


def test_external_fragmentation_makes_a_request_wait():
    # A, B, C fill a 12-slot arena with 4-slot slabs; A and C finish after one step and leave two 4-slot holes.
    # D needs 6 slots: 8 are free, but not in one piece, so it waits until B in the middle finishes too.
    trace = [TraceRequest(i, n_in, n_out, 0.0) for i, (n_in, n_out) in enumerate([(3, 1), (1, 3), (3, 1), (5, 1)])]
    naive = simulate(trace, "oracle", capacity=12, max_model_len=16, layout_every=1)
    assert naive.counts[:, EXTERNAL].tolist() == [0, 8, 8, 0]
    assert naive.layouts[1].tolist() == [EXTERNAL] * 4 + [LIVE] * 3 + [RESERVED] + [EXTERNAL] * 4
    paged = simulate(trace, 2, capacity=12, max_model_len=16)  # blocks need no single hole
    assert paged.counts[:, EXTERNAL].sum() == 0
    assert (naive.finished, paged.finished) == (4, 4)
    assert len(paged.steps) < len(naive.steps)


def test_paged_only_wastes_the_tail_of_the_last_block():
    trace = sharegpt_trace(60, seed=1)
    for block_size in (8, 16, 32, 64, 128):
        result = simulate(trace, block_size, capacity=8192)
        assert result.max_slack.max() < block_size
        assert result.counts[:, EXTERNAL].sum() == 0


def test_utilisation_is_ordered_like_the_paper():
    summaries = {r.scheme: r.summary() for r in compare(sharegpt_trace(150, seed=0), capacity=8192)}
    utilisation = {name: s["utilisation"] for name, s in summaries.items()}
    assert utilisation["naive-max"] < utilisation["naive-pow2"] < utilisation["naive-oracle"] < utilisation["paged-16"]
    assert abs(utilisation["naive-max"] - PAPER_ORCA_USAGE["max"]) < 0.05
    assert utilisation["paged-16"] > PAPER_VLLM_USAGE - 0.02
    assert utilisation["paged-8"] >= utilisation["paged-16"] >= utilisation["paged-128"]
    assert summaries["paged-16"]["max_concurrency"] > 3 * summaries["naive-max"]["max_concurrency"]


def test_live_share_is_the_papers_quantity():
    """The paper's Figure 2 counts token states against the whole KV memory: live / pool, never above live /
    allocated, and below it by exactly the share of the pool held by external fragmentation and free slots."""
    result = simulate(sharegpt_trace(150, seed=0), "pow2", capacity=8192)
    allocated = result.counts[:, [LIVE, RESERVED, INTERNAL]].sum(1)
    np.testing.assert_allclose(result.live_share, result.counts[:, LIVE] / 8192)
    assert (result.live_share <= result.utilisation + 1e-12).all()
    loaded = result.loaded
    np.testing.assert_allclose(result.live_share[loaded] * 8192, result.utilisation[loaded] * allocated[loaded])
    summary = result.summary()
    assert summary["live_fraction"] == pytest.approx(result.live_share[loaded].mean())
    assert summary["live_fraction"] < summary["utilisation"]  # pow2 strands memory in holes


def test_breakdown_fields_sum_to_capacity_and_layouts_agree():
    result = simulate(sharegpt_trace(40, seed=2), "pow2", capacity=4096, layout_every=25)
    assert (result.counts.sum(1) == 4096).all()
    for step, states in result.layouts.items():
        row = int(np.flatnonzero(result.steps == step)[0])
        assert np.bincount(states, minlength=5).tolist() == result.counts[row].tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scheme="best"), "policy must be one of"),
        (dict(scheme=12), "block_size must be a power of two"),
        (dict(scheme=16, capacity=0), "capacity must be a positive number"),
        (dict(scheme="max", capacity=1000), "needs more than the pool's capacity"),
        (dict(scheme=16, max_model_len=100), "more than max_model_len"),
        (dict(scheme=16, step_time=0), "step_time must be > 0"),
        (dict(scheme=16, max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(scheme=16, layout_every=-1), "layout_every must be an integer >= 0"),
        (dict(scheme=16, trace=[]), "trace must hold at least one request"),
    ],
)
def test_bad_arguments(kwargs, message):
    kwargs = dict(trace=[TraceRequest(0, 100, 100, 0.0)], capacity=4096) | kwargs
    with pytest.raises(ValueError, match=message):
        simulate(**kwargs)


def test_max_num_seqs_caps_the_batch():
    result = simulate(sharegpt_trace(50), 16, capacity=16_384, max_num_seqs=4)
    assert result.running.max() == 4 and result.finished == 50


requests = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40), st.floats(0, 3)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(requests, st.sampled_from(["max", "pow2", "oracle", 1, 2, 8, 16, 32]), st.integers(128, 400))
def test_every_request_finishes_and_everything_is_freed(lengths, scheme, capacity):
    trace = [TraceRequest(i, n_in, n_out, t) for i, (n_in, n_out, t) in enumerate(lengths)]
    result = simulate(trace, scheme, capacity, max_model_len=128, step_time=0.5)
    assert result.finished == len(trace)
    assert result.final_free_slots == (capacity if isinstance(scheme, str) else capacity // scheme * scheme)
    assert (result.counts.sum(1) == result.counts[0].sum()).all()
    if isinstance(scheme, int):
        assert (result.max_slack < scheme).all()  # paged waste per request < block_size
        assert result.counts[:, EXTERNAL].sum() == 0
    else:
        assert result.preemptions == result.recomputed_tokens == 0  # a slab never grows: nothing is preempted
    assert result.recomputed_tokens >= result.preemptions  # a victim holds at least one token


def test_a_preemption_counts_the_tokens_a_recompute_prefills_again():
    # Two 3-token prompts in two 4-slot blocks: each writes its 4th token, then both need a second block. The
    # older gets it; the newer is preempted holding 4 tokens, which a recompute would prefill again.
    result = simulate([TraceRequest(0, 3, 4, 0.0), TraceRequest(1, 3, 4, 0.0)], 4, 8)
    assert (result.preemptions, result.recomputed_tokens) == (1, 4)
    assert result.summary()["recomputed_tokens"] == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 30)), max_size=60))
def test_arena_slabs_never_overlap(operations):
    arena, slabs = FirstFitArena(100), []
    for allocate, size in operations:
        if allocate:
            start = arena.allocate(size)
            if start is not None:
                slabs.append((start, size))
        elif slabs:
            arena.free(*slabs.pop(size % len(slabs)))
        used = np.zeros(100, dtype=int)
        for start, size in slabs:
            used[start : start + size] += 1
        for start, size in arena.holes:
            used[start : start + size] += 1
        assert (used == 1).all()  # every slot in exactly one slab or one hole
        assert all(a[0] + a[1] < b[0] for a, b in zip(arena.holes, arena.holes[1:]))  # holes coalesced
