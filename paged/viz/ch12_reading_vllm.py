"""Chapter 12's picture (guide §7, §8, §11): where a decode step's time goes, part by part, against the time its bytes
take to read once (the memory floor), for a few batches and both kinds of sampling."""

import matplotlib.pyplot as plt

from paged.analysis.host_time import PARTS
from paged.viz.common import PALETTE


def step_part_bars(rows: dict[str, dict], bandwidth: float) -> list[dict]:
    """As plain data: for each labelled row of decode_step_times, its parts in ms with where each bar starts, and
    its memory floor in ms (the row's bytes at `bandwidth` bytes a second)."""
    bars = []
    for label, row in rows.items():
        left, parts = 0.0, []
        for part in PARTS:
            width = row[f"{part}_s"] * 1e3
            parts.append({"part": part, "left": left, "width": width})
            left += width
        bars.append({"label": label, "parts": parts, "floor_ms": row["bytes"] / bandwidth * 1e3})
    return bars


def plot_step_parts(rows: dict[str, dict], bandwidth: float):
    """One horizontal bar per row, cut into the step's parts (host ms), with a mark at the memory floor."""
    bars = step_part_bars(rows, bandwidth)
    fig, ax = plt.subplots(figsize=(7.2, 1.3 + 0.55 * len(bars)))
    for y, bar in enumerate(bars):
        for colour, part in zip(PALETTE, bar["parts"]):
            ax.barh(
                y, part["width"], left=part["left"], color=colour, height=0.6, label=part["part"] if y == 0 else None
            )
        ax.plot(
            [bar["floor_ms"]] * 2,
            [y - 0.4, y + 0.4],
            color="black",
            lw=2,
            label="memory floor (bytes read once)" if y == 0 else None,
        )
    ax.set_yticks(range(len(bars)), [bar["label"] for bar in bars])
    ax.invert_yaxis()
    ax.set(xlabel="ms per decode step (host time, the engine's own timers)", title="one decode step, part by part")
    ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.6 / len(bars)))
    fig.tight_layout()
    return fig
