"""The chapter-10 drawings (paged/viz/ch10_offload.py): the tiers, frames of blocks moving between the pool and
its two tiers, checked through the data-* attributes of every drawn cell, and the plots."""

from html.parser import HTMLParser

import matplotlib
import pytest
from helpers import make_tiny_llm, player_frames, random_prompts

from paged import SamplingParams
from paged.viz.ch10_offload import (
    TIERS,
    plot_crossover,
    plot_ttft_tiers,
    record_tier_frames,
    tier_player,
    tier_snapshot_html,
    tiers_html,
)

matplotlib.use("Agg")


class Cells(HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.cells: dict[str, list[dict]] = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("class") == "blk":
            self.cells.setdefault(attrs["data-tier"], []).append(attrs)


@pytest.fixture(scope="module")
def frames(tiny_model):
    block_bytes = 4096  # the tiny Llama's block of 8 tokens, both layers, K and V, fp32
    prompts = random_prompts(5, seed=13, low=26, high=27)
    prompts[4] = prompts[0][:24] + [7, 7, 7]  # the first prompt's three full blocks, long after they left the pool
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=12,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=3,
        preemption_mode="swap",
        swap_space=6 * block_bytes / 2**30,
        enable_prefix_caching=True,
        kv_offloading_size=16 * block_bytes / 2**30,
    )
    return llm, record_tier_frames(llm, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))


def test_the_tiers_are_drawn_top_down_with_their_links():
    text = tiers_html()
    assert text.count("class='tier'") == len(TIERS) == 3
    assert text.count("class='link'") == 2 and "64 GB/s" in text


def test_frames_show_every_kind_of_move_once_per_block(frames):
    llm, frames = frames
    kinds = {kind for frame in frames for kind, pairs in frame.moved.items() if pairs}
    assert kinds == {"swap out", "swap in", "load", "store"}
    swapped_out = sum(len(frame.moved["swap out"]) for frame in frames)
    assert swapped_out == llm.kv_stats()["swap_out_blocks"] > 0
    assert sum(len(frame.moved["load"]) for frame in frames) * 8 == llm.kv_stats()["offload_hit_tokens"]


def test_a_swap_out_frame_draws_the_blocks_in_the_swap_tier_and_frames_what_moved(frames):
    _, frames = frames
    frame = next(f for f in frames if f.moved["swap out"])
    cells = Cells(tier_snapshot_html(frame)).cells
    assert len(cells["pool"]) == 12 and len(cells["swap"]) == 6 and len(cells["prefix"]) == 16
    victim = frame.queues["swapped"][0]
    swap_cells = [c for c in cells["swap"] if c["data-seq"] == str(victim)]
    assert {int(c["data-index"]) for c in swap_cells} == {slot for _, slot in frame.moved["swap out"]}
    assert all(c["data-moved"] == "swap out" for c in swap_cells)
    assert not any(c["data-seq"] == str(victim) for c in cells["pool"])  # never in two places at once
    assert "swap out 4" in frame.caption


def test_the_player_holds_one_frame_per_step(frames):
    _, frames = frames
    assert len(player_frames(tier_player(frames))) == len(frames)
    assert player_frames(tier_player(frames, start=3))[3] == tier_snapshot_html(frames[3])


def test_the_plots_draw_one_line_per_series_and_one_bar_per_case():
    fig = plot_crossover([128, 256], {"swap": [1e-3, 2e-3], "recompute": [1e-2, 3e-2]}, "t")
    assert len(fig.axes[0].lines) == 2
    fig = plot_ttft_tiers({"nowhere": 1.0, "tier": 0.3, "pool": 0.1}, "t")
    assert len(fig.axes[0].patches) == 3
