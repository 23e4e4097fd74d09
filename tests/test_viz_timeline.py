"""The chapter-07/08 drawings (paged/viz/ch07_continuous_batching.py, ch08_chunked_prefill_goodput.py): the scheduler
timeline from step records, its HTML and player, and the latency plots, checked without a browser."""

import re

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
from helpers import make_tiny_llm, player_frames

from paged.analysis.replay import ReplayResult, replay
from paged.analysis.traces import TraceRequest
from paged.engine.metrics import SLO, RequestRecord, StepRecord
from paged.viz import (
    empirical_cdf,
    plot_goodput,
    plot_latency_cdfs,
    plot_token_gaps,
    schedule_caption,
    timeline_html,
    timeline_player,
    timeline_states,
)


def hand_made() -> ReplayResult:
    """TraceRequest 0 runs alone, request 1 arrives at 0.5, joins, is preempted at step 2 and recomputed; request 2
    arrives at 3.5."""
    records = [
        RequestRecord("0", 4, 3, 0.0, 0.0, 1.0, 3.0),
        RequestRecord("1", 6, 2, 0.5, 1.0, 4.0, 5.0),
        RequestRecord("2", 2, 1, 3.5, 4.0, 5.0, 5.0),
    ]
    steps = [
        StepRecord(0, 0.0, 1.0, (("0", 4),), (), (), (), 10),
        StepRecord(1, 1.0, 1.0, (("1", 3),), ("0",), (), (), 11),
        StepRecord(2, 2.0, 1.0, (), ("0",), ("1",), ("0",), 6),
        StepRecord(3, 3.0, 1.0, (("1", 6),), (), (), (), 21),
        StepRecord(4, 4.0, 1.0, (("2", 2),), ("1",), (), ("1", "2"), 10),
    ]
    return ReplayResult(records, [], steps)


def cell_classes(page: str) -> list[list[str]]:
    """Each row's state per step: a cell spanning n steps counts n times."""
    rows = re.findall(r'<tr><td class="label">[^<]*</td>(.*?)</tr>', page)
    cells = [re.findall(r'<td(?: colspan=(\d+))? class="s-(\w+)', row) for row in rows]
    return [[state for span, state in row for _ in range(int(span or 1))] for row in cells]


def test_timeline_states_follow_the_steps():
    assert timeline_states(hand_made()) == [
        ["prefill", "decode", "decode", "finished", "finished"],
        ["", "prefill", "preempted", "prefill", "decode"],
        ["", "", "", "", "prefill"],
    ]


def test_timeline_html_draws_a_window_and_outlines_the_current_step():
    result = hand_made()
    page = timeline_html(result)
    assert cell_classes(page) == [[s or "none" for s in row] for row in timeline_states(result)]
    assert page.count(" now") == 3  # one outlined cell per request, in the last column
    assert "step 4: clock 4.000 to 5.000, 3 tokens = 1 decodes + prefill chunks [req 2: 2]; finished: req 1, 2" in page
    window = timeline_html(result, upto=2, window=2)
    assert cell_classes(window) == [["decode", "decode"], ["prefill", "preempted"], ["none", "none"]]
    assert "preempted: req 1" in window
    assert (
        schedule_caption(result.steps[0])
        == "step 0: clock 0.000 to 1.000, 4 tokens = 0 decodes + prefill chunks [req 0: 4]"
    )


def test_timeline_player_holds_a_frame_per_step_and_starts_at_the_last():
    result = hand_made()
    player = timeline_player(result, window=10)
    assert player_frames(player) == [timeline_html(result, step, 10) for step in range(5)]
    assert player.children[1].selected_index == 4
    assert cell_classes(player_frames(player)[1])[0] == ["prefill", "decode"]


def test_timeline_of_a_real_replay_with_preemption(tiny_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from a second thread
    llm = make_tiny_llm(tiny_model, num_blocks=12)
    result = replay(llm.engine, [TraceRequest(i, 20, 24, 0.1 * i) for i in range(4)])
    torch.set_num_threads(threads)
    states = timeline_states(result)
    assert any("preempted" in row for row in states)
    for record, row in zip(result.requests, states):
        # every output token after the first comes from a decode, or from the recompute after a preemption
        assert row.count("decode") == record.num_output_tokens - 1 - record.num_preemptions
        assert set(row[: row.index("prefill")]) <= {"", "waiting"}  # nothing happens before its first prefill
        last = max(k for k, state in enumerate(row) if state == "decode")
        assert set(row[last + 1 :]) <= {"finished"}


def test_latency_plots_build():
    result = hand_made()
    records = [
        RequestRecord(
            str(i), 4, 5, 0.0, 0.0, 0.1 * (i + 1), 0.1 * (i + 1) + 0.4, tuple(0.1 * (i + 1) + 0.1 * k for k in range(5))
        )
        for i in range(4)
    ]
    replayed = ReplayResult(records, [], result.steps)
    x, y = empirical_cdf([3.0, 1.0, 2.0, 2.0])
    assert x.tolist() == [1.0, 2.0, 2.0, 3.0] and y.tolist() == [0.25, 0.5, 0.75, 1.0]
    by_rate = {"A": {1.0: replayed, 2.0: replayed}, "B": {1.0: replayed, 2.0: replayed}}
    slo = SLO(ttft=0.25, tpot=0.2)
    cdfs = plot_latency_cdfs(by_rate, slo)
    assert len(cdfs.axes) == 6  # TTFT, TPOT, worst gap x two rates
    assert [len(ax.get_lines()) for ax in cdfs.axes] == [3, 3, 3, 3, 2, 2]  # 2 curves + a dashed limit, none for itl
    panels = plot_goodput(by_rate, {"fast": slo, "any": SLO()}).axes
    assert np.allclose(panels[0].get_lines()[0].get_ydata(), [2 / 0.8, 2 / 0.8])  # 2 of 4 meet TTFT <= 0.25
    assert np.allclose(panels[1].get_lines()[0].get_ydata(), [4 / 0.8, 4 / 0.8])
    assert len(plot_token_gaps({"A": replayed}, ["0", "1"]).axes[0].get_lines()) == 2
    with pytest.raises(KeyError):
        plot_latency_cdfs({"A": {1.0: replayed}, "B": {2.0: replayed}})
