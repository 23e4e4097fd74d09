"""Chapter 09's pictures render from data the engine records: verify steps, speedup curves, token histograms."""

import matplotlib
from helpers import make_tiny_llm, random_prompts

from paged import SamplingParams
from paged.analysis.speculative_cost import expected_tokens
from paged.geometry import cdiv
from paged.viz import (
    plot_speedup_curves,
    plot_speedup_vs_batch,
    plot_token_histograms,
    record_verifies,
    verify_steps_html,
)

matplotlib.use("Agg")


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.75, 5) == sum(0.75**i for i in range(6))
    assert round(expected_tokens(0.75, 5), 1) == 3.3  # not the guide's 4
    assert expected_tokens(1.0, 3) == 4 and expected_tokens(0.0, 3) == 1


def test_recorded_verifies_match_the_engine_and_render(tiny_model):
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=128,
        block_size=2,
        speculative_config={
            "method": "draft_model",
            "model": tiny_model,
            "num_speculative_tokens": 3,
            "draft_layers": 1,
        },
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in random_prompts(3, seed=40):
        llm.engine.add_request(llm.engine.make_request(prompt, params))
    records = record_verifies(llm.engine)
    stats = llm.spec_stats()
    assert len(records) == stats["num_drafts"]
    assert sum(r["num_accepted"] for r in records) == stats["num_accepted_tokens"]
    for r in records:
        assert r["appended"][: r["num_accepted"]] == r["drafts"][: r["num_accepted"]]
        assert r["blocks_at_verify"] * 2 >= r["num_computed_after"]
        if not r["finished"]:
            assert r["blocks_after"] == cdiv(r["num_computed_after"], 2)
    page = verify_steps_html(records, limit=len(records))
    assert page.count("<tr>") == len(records) + 1
    assert page.count("line-through") == sum(len(r["drafts"]) - r["num_accepted"] for r in records)


def test_plots_draw_their_curves_and_points():
    fig = plot_speedup_curves(ks=(1, 3), costs=(0.0, 0.5), points=[(0.8, 1.7, "ngram")])
    assert len(fig.axes) == 2 and len(fig.axes[1].lines) == 3  # two curves and the break-even line
    assert len(fig.axes[0].lines) == 4  # and the measured point, on the c = 0 panel
    from paged.analysis.step_cost import StepCost

    cost = StepCost(fixed=10.0, per_token=1.0, per_seq=0.0, per_pair=0.0)  # E(0.5, 3) stops paying at batch 5
    fig = plot_speedup_vs_batch(cost, [0.5, 1.0], max_batch=64, points=[(4, 1.1, "measured"), (4, 1.1, "again")])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["a = 0.50: stops at batch 5", "a = 1.00: pays up to 64", "measured", "again"]
    assert len(fig.axes[0].lines) == 5  # two curves, the break-even line, two measured points
    assert not fig.axes[0].texts  # named in the legend, not beside points that may coincide
    fig = plot_speedup_vs_batch(cost, [0.5, 1.0], max_batch=64, verify_costs={1: 2.0, 8: 4.0})
    timed = [line for line in fig.axes[0].lines if line.get_marker() == "x" and len(line.get_xdata())]
    assert [list(line.get_ydata()) for line in timed] == [
        [expected_tokens(a, 3) / c for c in (2.0, 4.0)] for a in (0.5, 1.0)
    ]
    fig = plot_token_histograms({1: 5, 2: 3}, {1: 4, 3: 1}, "t")
    assert len(fig.axes[0].patches) == 6  # three tokens, two bars each
