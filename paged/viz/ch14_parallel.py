"""Chapter 14's pictures (guide §1, §8): one block table over N ranks whose pools each hold their own KV heads, an
all-reduce's time against its bytes (measured points and the alpha-beta line), and a step's time against the
tensor-parallel size for a model that needs it and one that does not."""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter, ScalarFormatter

from paged.analysis.parallel_cost import AllReduceTimes, kv_head_copies, kv_heads_by_rank, ring_all_reduce_bytes
from paged.viz.ch03_block_tables import FREE_COLOUR
from paged.viz.common import PALETTE


def shared_table_layout(num_kv_heads: int, tp_size: int, tables: dict[str, list[int]], num_blocks: int) -> list[dict]:
    """What each rank's pool holds, as plain data: per rank its KV heads (global ids, with which copy of the head
    it is when heads are replicated) and, for each physical block, the sequence whose table names it (None: free).
    Every rank holds the same block ids for the same sequences: only the heads differ."""
    owner = [None] * num_blocks
    for name, table in tables.items():
        for block in table:
            if not 0 <= block < num_blocks:
                raise ValueError(f"block {block} of {name!r} is outside a pool of {num_blocks} blocks")
            owner[block] = name
    copies, seen = kv_head_copies(num_kv_heads, tp_size), [0] * num_kv_heads
    ranks = []
    for rank, heads in enumerate(kv_heads_by_rank(num_kv_heads, tp_size)):
        rows = []
        for head in heads:
            seen[head] += 1
            rows.append({"head": head, "copy": seen[head], "copies": copies[head]})
        ranks.append({"rank": rank, "heads": rows, "blocks": list(owner)})
    return ranks


def draw_shared_block_table(
    num_kv_heads: int, tp_size: int, tables: dict[str, list[int]], num_blocks: int, title: str = ""
):
    """The block tables at the top, then one pool per rank: a row per KV head the rank holds, a column per physical
    block, each block coloured by the sequence whose table names it. The same columns light up on every rank."""
    layout = shared_table_layout(num_kv_heads, tp_size, tables, num_blocks)
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(tables)}
    rows = len(tables) + 1 + sum(len(r["heads"]) + 1 for r in layout)
    fig, ax = plt.subplots(figsize=(2.2 + 0.42 * max(num_blocks, max(map(len, tables.values()))), 0.34 * rows + 0.8))
    y = 0.0

    def cell(x, y, colour, text="", hatch=None):
        ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, facecolor=colour, edgecolor="#555", lw=0.6, hatch=hatch))
        if text != "":
            ax.text(x + 0.45, y + 0.4, str(text), ha="center", va="center", fontsize=7)

    ax.text(-0.2, y + 0.4, "block tables (logical -> physical)", ha="right", va="center", fontsize=8, weight="bold")
    for name, table in tables.items():
        y += 1
        ax.text(-0.2, y + 0.4, name, ha="right", va="center", fontsize=8, color=colours[name])
        for logical, block in enumerate(table):
            cell(logical, y, colours[name], block)
    for rank in layout:
        y += 1.6
        ax.text(-0.2, y + 0.4, f"rank {rank['rank']}: its pool", ha="right", va="center", fontsize=8, weight="bold")
        for x in range(num_blocks):
            ax.text(x + 0.45, y + 0.4, str(x), ha="center", va="center", fontsize=6, color="#666")
        for head in rank["heads"]:
            y += 1
            label = f"KV head {head['head']}" + (
                f" (copy {head['copy']} of {head['copies']})" if head["copies"] > 1 else ""
            )
            ax.text(-0.2, y + 0.4, label, ha="right", va="center", fontsize=7)
            for x, name in enumerate(rank["blocks"]):
                cell(x, y, colours[name] if name else FREE_COLOUR, hatch="///" if head["copy"] > 1 and name else None)
    ax.set_xlim(-0.1, max(num_blocks, max(map(len, tables.values()))) + 0.1)
    ax.set_ylim(y + 1, -0.4)
    ax.axis("off")
    ax.set_title(title or f"one block table, {tp_size} ranks, {num_kv_heads} KV heads", fontsize=9)
    fig.tight_layout()
    return fig


def plot_all_reduce(times: AllReduceTimes, latency: float, bandwidth: float, marks: dict[str, int] | None = None):
    """The fastest measured time of one all-reduce against the tensor's bytes (log-log), the fitted alpha-beta line
    (latency + ring bytes / bandwidth), and vertical marks at named sizes (a decode step, a prefill chunk)."""
    sizes = np.array(sorted(times.fastest))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(
        sizes,
        [times.fastest[s] * 1e3 for s in sizes],
        "o",
        color=PALETTE[0],
        label=f"measured, {times.world_size} ranks (fastest call)",
    )
    grid = np.geomspace(sizes.min(), sizes.max(), 50)
    model = latency + np.array([ring_all_reduce_bytes(s, times.world_size) for s in grid]) / bandwidth
    ax.plot(grid, model * 1e3, "-", color=PALETTE[1], label="latency + 2(N-1)/N x bytes / bandwidth")
    for i, (label, size) in enumerate((marks or {}).items()):
        ax.axvline(size, color=PALETTE[2 + i], ls=":", lw=1.2, label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="bytes of the tensor (fp32)",
        ylabel="ms per all-reduce",
        title="one all-reduce between processes (gloo)",
    )
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_tp_step_time(big: dict, small: dict[str, list[dict]], does_not_fit=()):
    """Left: a step of a big model at each tensor-parallel size, its weight read and its all-reduces stacked (ms);
    sizes in does_not_fit hatched. Right: small-model steps relative to one device, one line per setting; above 1,
    tensor parallelism makes the step slower. big: {"label": str, "rows": [tp_step_seconds rows]}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = big["rows"]
    x = np.arange(len(rows))
    weights = np.array([r["weights_s"] for r in rows]) * 1e3
    comm = np.array([r["all_reduce_s"] for r in rows]) * 1e3
    hatches = ["xx" if r["tp_size"] in does_not_fit else None for r in rows]
    for i in range(len(rows)):
        left.bar(x[i], weights[i], color=PALETTE[0], hatch=hatches[i], edgecolor="white")
        left.bar(x[i], comm[i], bottom=weights[i], color=PALETTE[1])
    left.legend(
        handles=[Patch(color=PALETTE[0], label="weight read / N"), Patch(color=PALETTE[1], label="all-reduces")],
        fontsize=8,
    )
    left.set_xticks(
        x, [f"N = {r['tp_size']}" + ("\n(does not fit)" if r["tp_size"] in does_not_fit else "") for r in rows]
    )
    left.set(ylabel="ms per decode step", title=big["label"])
    for i, (label, series) in enumerate(small.items()):
        base = series[0]["step_s"]
        right.plot(
            [r["tp_size"] for r in series],
            [r["step_s"] / base for r in series],
            "o-",
            color=PALETTE[2 + i],
            label=label,
        )
    right.axhline(1, color="grey", ls="--", lw=1, label="one device")
    right.set(
        xscale="log",
        ylim=(0, None),
        xlabel="tensor-parallel size N",
        ylabel="step time / step time at N = 1",
        title="SmolLM2",
    )
    sizes = sorted({r["tp_size"] for series in small.values() for r in series})
    right.set_xticks(sizes, [str(s) for s in sizes])
    right.minorticks_off()
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_engine_rates(rates: dict[str, float], title: str):
    """Output tokens per second of the same batch on engines of different tensor-parallel sizes, as bars."""
    fig, ax = plt.subplots(figsize=(5.5, 2.6))
    ax.barh(list(rates), list(rates.values()), color=PALETTE[: len(rates)])
    ax.invert_yaxis()
    ax.set_xlabel("output tokens per second (measured)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
