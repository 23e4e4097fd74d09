"""The chapter-10 handoff drawing (paged/viz/ch10_disaggregation.py): one frame per block, pools that add up, and
HTML that shows each block where it is; checked without a browser."""

from html.parser import HTMLParser

import matplotlib.pyplot as plt
from helpers import player_frames

from paged.viz.ch10_disaggregation import handoff_frame_html, handoff_player, handoff_replay, plot_decode_gaps


class Blocks(HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.blocks: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("class") == "block":
            self.blocks.append(attrs)


def test_a_handoff_moves_one_block_per_frame_into_other_block_ids():
    frames = handoff_replay(
        prompt_len=20, block_size=8, num_blocks=10, block_bytes=1000, prefill_others=[8], decode_others=[24]
    )
    assert len(frames) == 1 + 3 + 1  # prefilled, 3 blocks on the wire, done
    first, *moving, last = frames
    assert [first.prefill_pool.index(f"req:{i}") for i in range(3)] == [1, 2, 3]  # block 0 is the other sequence's
    assert all(state in (None, "other") for state in first.decode_pool)
    for i, frame in enumerate(moving):
        assert frame.in_flight == i
        assert [frame.decode_pool.index(f"req:{j}") for j in range(i + 1)] == [3 + j for j in range(i + 1)]
        assert frame.decode_pool.count("reserved") == 2 - i
        assert "3,000" not in frame.caption and "1,000 B" in frame.caption
    assert all(state in (None, "other") for state in last.prefill_pool)  # the prefill worker let its copy go
    assert sum(s is not None and s.startswith("req:") for s in last.decode_pool) == 3  # 21 tokens: still 3 blocks
    assert "3,000 B moved" in last.caption


def test_the_frame_html_draws_every_block_and_marks_the_one_in_flight():
    frames = handoff_replay(prompt_len=16, block_size=8, num_blocks=4, block_bytes=10)
    blocks = Blocks(handoff_frame_html(frames[1])).blocks
    assert len(blocks) == 8  # two pools of four
    assert [b["data-state"] for b in blocks[4:]] == ["req:0", "reserved", "free", "free"]
    assert sum("outline" in b["style"] for b in blocks) == 2  # block 0 on both sides of the wire
    assert len(player_frames(handoff_player(frames))) == len(frames)


def test_plot_decode_gaps_draws_one_line_per_configuration():
    ax = plot_decode_gaps({"colocated": [0.01, 0.5, 0.01], "disaggregated": [0.01, 0.01, 0.01]})
    assert len(ax.lines) == 2 and ax.get_yscale() == "log"
    plt.close(ax.figure)
