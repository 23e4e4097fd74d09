"""Chapter 06's pictures (guide §10): forks and copy-on-write step by step, beam search on shared blocks, and what
sharing saves beside the paper's figures."""

import matplotlib.pyplot as plt

from paged.analysis.sharing import BlockSteps, on_forward
from paged.viz.ch03_block_tables import PoolSnapshot, snapshot
from paged.viz.common import PALETTE, html_table


def sequences_snapshot(engine, num_tokens: dict[int, int] | None = None, caption: str = "") -> PoolSnapshot:
    """The engine's block tables, one label per sequence ("seq 3 · req 0": forks share their request).
    num_tokens defaults to each running sequence's computed tokens."""
    running = {seq.seq_id: seq for seq in engine.scheduler.running}
    if num_tokens is None:
        num_tokens = {seq_id: seq.num_computed_tokens for seq_id, seq in running.items()}
    labels = {seq_id: f"seq {seq_id} · req {seq.request.request_id}" for seq_id, seq in running.items()}
    return snapshot(engine.block_manager, num_tokens, labels, caption)


def fork_caption(step: int, tables: dict[int, list[int]], copies: list[tuple[int, int]], before: set[int]) -> str:
    """'step 3: seq 5 forked; seq 2 freed; copy-on-write 4→9; 7 blocks held, 12 without sharing'.
    tables: seq_id -> block table now; before: the sequences of the previous frame. A new sequence whose first
    block an older one holds too is a fork; any other new sequence has started."""
    new = set(tables) - before
    forked = {
        seq_id
        for seq_id in new
        if any(other < seq_id and table[:1] == tables[seq_id][:1] for other, table in tables.items())
    }
    events = [
        f"seq {', '.join(map(str, sorted(ids)))} {what}"
        for ids, what in ((new - forked, "started"), (forked, "forked"), (before - set(tables), "freed"))
        if ids
    ]
    if copies:
        events.append("copy-on-write " + ", ".join(f"{src}→{dst}" for src, dst in copies))
    held = BlockSteps.of(tables.values())
    return f"step {step}: {'; '.join(events + [f'{held.physical} blocks held, {held.logical} without sharing'])}"


def beam_search_frames(llm, prompt, beam_width: int, max_tokens: int):
    """Run llm.beam_search on one prompt and snapshot the pool at every step as its forward pass sees it: after the
    scheduler grew the beams' tables and made the step's copy-on-write copies. Returns (BeamSearchOutput, frames).
    The engine is otherwise idle."""
    engine = llm.engine
    frames = []

    def take_snapshot(plan):
        before = set(frames[-1].tables) if frames else set()
        caption = fork_caption(len(frames) + 1, engine.block_manager.block_tables, plan.blocks_to_copy, before)
        num_tokens = {seq.seq_id: seq.num_computed_tokens + num_new for seq, num_new in plan.scheduled}
        frames.append(sequences_snapshot(engine, num_tokens, caption))

    with on_forward(engine, take_snapshot):
        output = llm.beam_search([prompt], beam_width, max_tokens)[0]
    return output, frames


def plot_usage_over_time(series: dict[str, list[BlockSteps]]):
    """Blocks held at each step with sharing (solid) and without (dashed), one colour per run."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for colour, (name, usage) in zip(PALETTE, series.items()):
        steps = range(1, len(usage) + 1)
        ax.plot(steps, [u.logical for u in usage], color=colour, linestyle="--", label=f"{name}: without sharing")
        ax.plot(
            steps, [u.physical for u in usage], color=colour, marker="o", markersize=3, label=f"{name}: shared blocks"
        )
    ax.set(xlabel="engine step", ylabel="KV blocks held", ylim=(0, None), title="What sharing saves, step by step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def savings_table_html(rows: list[dict]) -> str:
    """Measured savings beside the paper's range (its range runs over n or width = 2, 4, 6)."""
    table = [
        {
            "method": r["method"],
            "model": r["model"],
            "trace": r["trace"],
            "n or width": r["n"],
            "measured": r["saving"],
            "paper (n = 2-6)": "{:.1%} - {:.1%}".format(*r["paper"]) if r["paper"] else "-",
        }
        for r in rows
    ]
    return html_table(table, formats={"measured": ".1%"})


def plot_savings(rows: list[dict]):
    """Measured saving against n (parallel sampling) and beam width, one line per (trace, model); the paper's
    range for each trace as a band of the same colour."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.6 * len(methods), 3.4), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        ours = [r for r in rows if r["method"] == method]
        for (trace, model), marker in zip(dict.fromkeys((r["trace"], r["model"]) for r in ours), "osD^v"):
            line = [r for r in ours if (r["trace"], r["model"]) == (trace, model)]
            ax.plot(
                [r["n"] for r in line],
                [r["saving"] for r in line],
                marker=marker,
                color=PALETTE[traces.index(trace)],
                label=f"{trace}, {model}",
            )
        for trace in dict.fromkeys(r["trace"] for r in ours if r["paper"]):
            low, high = next(r["paper"] for r in ours if r["trace"] == trace)
            ax.axhspan(low, high, color=PALETTE[traces.index(trace)], alpha=0.15, label=f"{trace}, paper")
        widths = sorted({r["n"] for r in ours})
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set(xlabel="n" if method == "parallel sampling" else "beam width", title=method, ylim=(0, 1))
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:.0%}")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("KV memory saved")
    fig.tight_layout()
    return fig
