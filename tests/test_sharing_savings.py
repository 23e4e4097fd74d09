"""Memory saved by sharing blocks (paged/analysis/sharing.py) and the chapter-06 drawings (paged/viz/ch06_copy_on_write.py)."""

import matplotlib.pyplot as plt
import pytest
from helpers import assert_pool_empty, make_tiny_llm, random_prompts

from paged import SamplingParams
from paged.analysis.sharing import (
    BlockSteps,
    beam_search_rows,
    beam_search_saving,
    on_forward,
    parallel_sampling_rows,
    parallel_sampling_saving,
    parallel_sampling_usage,
)
from paged.analysis.traces import TraceRequest, alpaca_trace, sharegpt_trace
from paged.viz import beam_search_frames, fork_caption, plot_savings, savings_table_html, sequences_snapshot


def test_block_steps_count_a_shared_block_once():
    step = BlockSteps.of([[0, 1, 2], [0, 1, 3], [0, 4]])
    assert step == BlockSteps(physical=5, logical=8)
    assert (step + step).saving == pytest.approx(3 / 8)


def test_parallel_sampling_by_hand():
    # 6-token prompt, block size 4, n = 2, 3 new tokens (the K/V of the first two are written):
    #   step 0 (prefill): blocks [0, 1], held once; without sharing each completion holds both   -> 2 of 4
    #   step 1: the first writer into the shared partial block 1 gets a copy; the other keeps it  -> 3 of 4
    #   step 2: 8 tokens still fit two blocks each                                                 -> 3 of 4
    assert parallel_sampling_usage(6, 3, n=2, block_size=4) == BlockSteps(physical=8, logical=12)
    # 32 tokens fill two blocks of 16 exactly: nothing to copy, each completion opens its own third block
    assert parallel_sampling_usage(32, 5, n=2, block_size=16) == BlockSteps(2 + 4 * 4, 4 + 4 * 6)


def test_one_completion_saves_nothing():
    usage = parallel_sampling_saving(alpaca_trace(20, seed=1), n=1)
    assert usage.physical == usage.logical and usage.saving == 0


def test_parallel_sampling_saves_more_with_n_and_with_longer_prompts():
    rows = parallel_sampling_rows({"alpaca": alpaca_trace(60), "sharegpt": sharegpt_trace(15)})
    saving = {(r["trace"], r["n"]): r["saving"] for r in rows}
    for trace in ("alpaca", "sharegpt"):
        assert 0 < saving[trace, 2] < saving[trace, 4] < saving[trace, 6]
        for n in (2, 4, 6):
            assert saving[trace, n] < 1 - 1 / n  # every completion holds at least its own blocks
    assert all(saving["sharegpt", n] > saving["alpaca", n] for n in (2, 4, 6))
    assert {r["paper"] for r in rows} == {(0.061, 0.098), (0.162, 0.305)}


def test_beam_search_savings(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=256, block_size=8)
    prompts, output_lens = random_prompts(3, seed=5, low=10, high=40), [6, 12, 9]
    assert beam_search_saving(llm, prompts, output_lens, beam_width=1).saving == 0  # one beam shares nothing
    savings = [beam_search_saving(llm, prompts, output_lens, width).saving for width in (2, 4)]
    assert 0 < savings[0] < savings[1] < 1 - 1 / 4
    assert_pool_empty(llm)


@pytest.mark.parametrize("prompt_len", [13, 16])
def test_block_usage_is_counted_at_the_forward_pass(tiny_model, prompt_len):
    """Block size 8, beam width 4, 10 new tokens (the K/V of the first nine are written). At every decode's forward
    pass each beam writes into its last block, which is therefore its own: shared a moment before (a fork's
    partial block, already copied) or opened this step. Counted between steps, right after the forks, the first
    decode would read (2, 8) instead: four tables sharing the prompt's two blocks.
      13 tokens: prefill: blocks [A, B], B holds 5 tokens                                  -> (2, 2)
                 decodes 1-3 write positions 13-15 into B: A shared, four private B's      -> (1 + 4, 4 * 2)
                 decodes 4-9 open a third block each: A, 1 to 4 distinct B's, 4 new blocks  -> (6..9, 4 * 3)
      16 tokens: prefill: two full blocks                                                  -> (2, 2)
                 decodes 1-8 write positions 16-23 into a third block each                 -> (2 + 4, 4 * 3)
                 decode 9 opens a fourth: 2 shared, 1 to 4 distinct third blocks, 4 new    -> (7..10, 4 * 4)"""
    llm = make_tiny_llm(tiny_model, num_blocks=256, block_size=8)
    prompt = random_prompts(1, seed=6, low=prompt_len, high=prompt_len + 1)[0]
    usage = llm.beam_search([prompt], beam_width=4, max_tokens=10)[0].block_usage
    assert len(usage) == 10  # prefill + nine decodes
    if prompt_len == 13:
        assert usage[:4] == [(2, 2)] + [(5, 8)] * 3
        assert all(logical == 12 and 6 <= physical <= 9 for physical, logical in usage[4:])
    else:
        assert usage[:9] == [(2, 2)] + [(6, 12)] * 8
        assert usage[9][1] == 16 and 7 <= usage[9][0] <= 10
    assert beam_search_saving(llm, [prompt], [10], beam_width=4) == sum(
        (BlockSteps(physical, logical) for physical, logical in usage), BlockSteps()
    )
    assert_pool_empty(llm)


def test_on_forward_sees_the_step_copies(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=64, block_size=8)
    engine = llm.engine
    seen = []
    with on_forward(engine, lambda plan: seen.append((len(plan.scheduled), plan.blocks_to_copy))):
        llm.generate(
            [random_prompts(1, seed=7, low=21, high=22)[0]],  # its third block is shared and partial
            SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=0, ignore_eos=True),
            use_tqdm=False,
        )
    assert seen[0] == (1, [])  # the prefill: one sequence, nothing to copy
    assert seen[1][0] == 3 and len(seen[1][1]) == 2  # first decode: two of three writers copy the partial block
    assert engine.forward_observers == []  # the observer is gone again


def test_beam_search_rows_on_a_trace(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=512, block_size=16)
    trace = [TraceRequest(0, input_len=20, output_len=12, arrival_time=0.0), TraceRequest(1, 9, 8, 0.0)]
    rows = beam_search_rows(llm, "tiny", {"alpaca": trace}, widths=(2, 4))
    assert [(r["method"], r["model"], r["n"]) for r in rows] == [("beam search", "tiny", 2), ("beam search", "tiny", 4)]
    assert all(0 < r["saving"] < 1 and r["paper"] == (0.376, 0.552) for r in rows)


def test_fork_caption():
    caption = fork_caption(3, {0: [0, 1], 2: [0, 2]}, [(1, 2)], before={0, 1})
    assert caption == "step 3: seq 2 forked; seq 1 freed; copy-on-write 1→2; 3 blocks held, 4 without sharing"
    assert fork_caption(1, {0: [0]}, [], before=set()) == "step 1: seq 0 started; 1 blocks held, 1 without sharing"
    prefilled_and_forked = fork_caption(1, {0: [4, 5], 1: [4, 5], 2: [4, 5], 3: [6]}, [], before=set())
    assert prefilled_and_forked == "step 1: seq 0, 3 started; seq 1, 2 forked; 3 blocks held, 7 without sharing"


def test_sequences_snapshot_labels_each_fork(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=64, block_size=8)
    engine = llm.engine
    engine.add_request(
        engine.make_request(
            random_prompts(1, seed=8, low=20, high=21)[0], SamplingParams(n=3, max_tokens=4, seed=0, ignore_eos=True)
        )
    )
    engine.step()
    snap = sequences_snapshot(engine)
    assert snap.labels == {0: "seq 0 · req 0", 1: "seq 1 · req 0", 2: "seq 2 · req 0"}
    assert set(snap.num_tokens.values()) == {20} and snap.tables[0] == snap.tables[1] == snap.tables[2]
    assert [snap.ref_counts[b] for b in snap.tables[0]] == [3, 3, 3]


def test_beam_search_frames(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=128, block_size=4)
    output, frames = beam_search_frames(llm, random_prompts(1, seed=3, low=10, high=11)[0], 3, 8)
    assert len(frames) == 8 and len(frames[0].tables) == 1 and frames[0].caption.startswith("step 1: seq 0 started")
    assert all(len(frame.tables) <= 3 for frame in frames)
    # each frame is the pool as its forward pass sees it, as block_usage counts it
    assert [BlockSteps.of(frame.tables.values()) for frame in frames] == [BlockSteps(*u) for u in output.block_usage]
    assert llm.engine.forward_observers == []
    assert_pool_empty(llm)


def test_savings_table_and_plot():
    rows = parallel_sampling_rows({"alpaca": alpaca_trace(10)}, widths=(2, 4))
    html = savings_table_html(rows)
    assert "6.1% - 9.8%" in html and html.count("<tr>") == 3
    fig = plot_savings(rows + [dict(rows[0], method="beam search", paper=None)])
    assert len(fig.axes) == 2
    plt.close(fig)
