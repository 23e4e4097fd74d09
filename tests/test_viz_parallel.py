"""Chapter 14's pictures (paged/viz/ch14_parallel.py): the layout of one block table over N ranks' pools as plain
data, and the three figures built with their labels."""

import matplotlib.pyplot as plt
import pytest

from paged.analysis.parallel_cost import (
    H100_NVLINK,
    LLAMA3_70B,
    SMOLLM2,
    AllReduceTimes,
    Link,
    ring_all_reduce_bytes,
    tp_step_seconds,
)
from paged.viz import draw_shared_block_table, plot_all_reduce, plot_tp_step_time, shared_table_layout

TABLES = {"seq 0": [4, 1, 6], "seq 1": [0, 3]}


def test_every_rank_holds_the_same_blocks_for_its_own_heads():
    layout = shared_table_layout(8, 4, TABLES, num_blocks=8)
    assert [[h["head"] for h in rank["heads"]] for rank in layout] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    expected = ["seq 1", "seq 0", None, "seq 1", "seq 0", None, "seq 0", None]
    assert all(rank["blocks"] == expected for rank in layout)


def test_replicated_heads_are_numbered_copy_by_copy():
    layout = shared_table_layout(2, 4, TABLES, num_blocks=8)
    assert [(r["heads"][0]["head"], r["heads"][0]["copy"], r["heads"][0]["copies"]) for r in layout] == [
        (0, 1, 2),
        (0, 2, 2),
        (1, 1, 2),
        (1, 2, 2),
    ]
    with pytest.raises(ValueError, match="outside a pool of 4 blocks"):
        shared_table_layout(2, 2, TABLES, num_blocks=4)


def test_the_drawing_names_every_rank_and_head():
    fig = draw_shared_block_table(2, 4, TABLES, num_blocks=8)
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {f"rank {r}: its pool" for r in range(4)} <= texts
    assert {"KV head 0 (copy 1 of 2)", "KV head 1 (copy 2 of 2)", "seq 0", "seq 1"} <= texts
    assert len(fig.axes[0].patches) == 5 + 4 * 8  # table cells, then a row per rank
    plt.close(fig)


def test_plot_all_reduce_draws_points_the_line_and_the_marks():
    fastest = {s: 2e-4 + ring_all_reduce_bytes(s, 2) / 1e9 for s in (2304, 73728, 1179648)}
    fig = plot_all_reduce(AllReduceTimes(2, fastest, True), 2e-4, 1e9, {"decode step": 73728})
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert len(ax.lines) == 3 and list(ax.lines[0].get_xdata()) == sorted(fastest)
    assert "bytes" in ax.get_xlabel() and "ms" in ax.get_ylabel()
    plt.close(fig)


def test_plot_tp_step_time_stacks_the_big_model_and_relates_the_small_one():
    big = {"label": "Llama-3-70B", "rows": [tp_step_seconds(LLAMA3_70B, n, H100_NVLINK, 64) for n in (1, 2, 4, 8)]}
    cores = Link("cores", 10e9, 2e9, 2e-4, shared_memory=True)
    small = {
        "H100s": [tp_step_seconds(SMOLLM2, n, H100_NVLINK, 64) for n in (1, 3, 9)],
        "cores": [tp_step_seconds(SMOLLM2, n, cores, 32, 4) for n in (1, 2)],
    }
    fig = plot_tp_step_time(big, small, does_not_fit={1})
    left, right = fig.axes
    assert len(left.patches) == 2 * 4 and left.get_title() == "Llama-3-70B"
    assert "does not fit" in left.get_xticklabels()[0].get_text()
    assert [line.get_ydata()[0] for line in right.lines[:2]] == [1, 1]  # each line starts at one device
    assert right.lines[0].get_ydata()[-1] > 1  # SmolLM2 is slower split
    plt.close(fig)
