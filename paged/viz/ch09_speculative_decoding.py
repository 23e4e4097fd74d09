"""Pictures for chapter 09, speculative decoding (guide §14): each verify step's drafts and blocks, the speedup
curves of the cost model with measured points on them (against acceptance, and against batch size), and token
histograms with and without speculation.

`record_verifies` steps an engine and returns plain data; the drawing functions take that data and return HTML or a
matplotlib figure, so tests check them without a browser.
"""

import html

import matplotlib.pyplot as plt
import numpy as np

from paged.analysis.speculative_cost import crossover_batch, expected_tokens, verify_speedup


def record_verifies(engine, max_steps: int = 1000) -> list[dict]:
    """Step the engine until it is idle (or max_steps); one record per sequence per step that verified drafts:
    step, seq_id, drafts, tokens appended, accepted count, its block table's length before the step, at the verify
    and after the rollback, and its computed tokens after it."""
    records, at_verify = [], {}

    def observe(plan):
        at_verify.clear()
        for seq, _ in plan.scheduled:
            if seq.spec_token_ids:
                at_verify[seq.seq_id] = (
                    seq,
                    list(seq.spec_token_ids),
                    seq.num_tokens,
                    seq.request.metrics.num_accepted_tokens,
                    len(engine.block_manager.block_tables[seq.seq_id]),
                )

    engine.forward_observers.append(observe)
    try:
        for step in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            blocks_before = {
                s.seq_id: len(engine.block_manager.block_tables.get(s.seq_id, ())) for s in engine.scheduler.running
            }
            engine.step()
            for seq_id, (seq, drafts, num_tokens, accepted_before, blocks_at_verify) in at_verify.items():
                records.append(
                    {
                        "step": step,
                        "seq_id": seq_id,
                        "drafts": drafts,
                        "appended": seq.token_ids[num_tokens:],
                        "num_accepted": seq.request.metrics.num_accepted_tokens - accepted_before,
                        "blocks_before": blocks_before.get(seq_id, 0),
                        "blocks_at_verify": blocks_at_verify,
                        "blocks_after": len(engine.block_manager.block_tables.get(seq_id, ())),
                        "num_computed_after": seq.num_computed_tokens,
                        "finished": seq.is_finished,
                    }
                )
    finally:
        engine.forward_observers.remove(observe)
    return records


def verify_steps_html(records: list[dict], decode=str, limit: int = 12) -> str:
    """A table of verify steps: drafts accepted (green), rejected (red, struck), the target's own token (blue),
    and the blocks the sequence held before the step, at the verify (lookahead slots) and after the rollback."""
    style = {
        "accepted": "background:#c8e6c9",
        "rejected": "background:#ffcdd2;text-decoration:line-through",
        "target": "background:#bbdefb",
    }

    def cell(token, kind):
        return (
            f'<span style="{style[kind]};padding:1px 3px;margin:1px;font-family:monospace">'
            f"{html.escape(decode(token))}</span>"
        )

    rows = []
    for r in records[:limit]:
        a = r["num_accepted"]
        drafts = "".join(cell(t, "accepted" if i < a else "rejected") for i, t in enumerate(r["drafts"]))
        extra = r["appended"][a : a + 1]
        appended = "".join(cell(t, "accepted") for t in r["appended"][:a]) + "".join(cell(t, "target") for t in extra)
        blocks = f"{r['blocks_before']} &rarr; {r['blocks_at_verify']} &rarr; {r['blocks_after']}"
        rows.append(
            f"<tr><td>{r['step']}</td><td>{r['seq_id']}</td><td>{drafts}</td><td>{a}/{len(r['drafts'])}</td>"
            f'<td>{appended}</td><td style="text-align:center">{blocks}</td></tr>'
        )
    head = (
        "<tr><th>step</th><th>seq</th><th>drafts (kept / rejected)</th><th>kept</th>"
        "<th>appended (+ target's token)</th><th>blocks: before &rarr; verify &rarr; after</th></tr>"
    )
    return f'<table style="border-collapse:collapse">{head}{"".join(rows)}</table>'


MARKERS = "os^Dv<>"


def plot_speedup_curves(ks=(1, 3, 5), costs=(0.0, 0.1, 0.3), points=()):
    """speedup = E(a, k) / (1 + k c) against the per-position acceptance a, one panel per draft cost c; points:
    (a, speedup, label) measured for a proposer that costs nothing (prompt lookup), drawn on the first panel, each
    with its own marker and named in the legend (labels beside points that coincide would print over each other)."""
    fig, axes = plt.subplots(1, len(costs), figsize=(4 * len(costs), 3.4), sharey=True)
    grid = [i / 100 for i in range(100)]
    for ax, c in zip(axes, costs):
        for k in ks:
            ax.plot(grid, [expected_tokens(a, k) / (1 + k * c) for a in grid], label=f"k = {k}")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"draft cost c = {c}")
        ax.set_xlabel("per-position acceptance a")
    for (a, speedup, label), marker in zip(points, MARKERS):
        axes[0].plot([a], [speedup], marker, color="black", fillstyle="none", ls="none", label=label)
    axes[0].set_ylabel("tokens per target pass / cost")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_speedup_vs_batch(
    step_cost, acceptances, num_drafts: int = 3, context: int = 200, max_batch: int = 512, points=(), verify_costs=None
):
    """The modelled speedup of a free proposer (prompt lookup) against batch size, one curve per per-position
    acceptance a, each step priced by step_cost (paged.analysis.step_cost.StepCost); where a curve crosses 1 is where
    speculation stops paying. points: (batch, speedup, label) measured, each with its own marker in the legend.
    verify_costs: {batch: a verify's timed cost in decode steps}; each curve then gets E(a, k) / that cost at those
    batch sizes, dotted, in its colour: the speedup at the timed verify cost instead of the modelled one."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    batches = np.unique(np.geomspace(1, max_batch, 64).round().astype(int)).tolist()
    for a in acceptances:
        stops = crossover_batch(step_cost, num_drafts, a, context, max_batch=max_batch)
        label = f"a = {a:.2f}: " + (
            "never pays" if stops == 1 else f"stops at batch {stops}" if stops else f"pays up to {max_batch}"
        )
        (line,) = ax.plot(batches, [verify_speedup(step_cost, b, num_drafts, a, context) for b in batches], label=label)
        if verify_costs:
            timed = sorted(verify_costs)
            ax.plot(
                timed, [expected_tokens(a, num_drafts) / verify_costs[b] for b in timed], "x:", color=line.get_color()
            )
    if verify_costs:
        ax.plot([], [], "x:", color="grey", label="x: at the timed verify cost")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    for (batch, speedup, label), marker in zip(points, MARKERS):
        ax.plot([batch], [speedup], marker, color="black", fillstyle="none", ls="none", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"k = {num_drafts}, context {context}: E(a, k) x t_decode / t_verify, curves from the step cost")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_token_histograms(without: dict, with_spec: dict, title: str):
    """Two histograms over the same tokens: counts without and with speculation (dicts token -> count)."""
    tokens = sorted(set(without) | set(with_spec), key=lambda t: -(without.get(t, 0) + with_spec.get(t, 0)))[:20]
    fig, ax = plt.subplots(figsize=(8, 3))
    xs = range(len(tokens))
    ax.bar([x - 0.2 for x in xs], [without.get(t, 0) for t in tokens], width=0.4, label="without speculation")
    ax.bar([x + 0.2 for x in xs], [with_spec.get(t, 0) for t in tokens], width=0.4, label="with speculation")
    ax.set_xticks(list(xs), [str(t) for t in tokens], fontsize=7)
    ax.set_xlabel("token id")
    ax.set_ylabel("count")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
