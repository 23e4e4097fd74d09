"""Chapter 02's pictures (guide §1, §3, §8): length histograms, the memory map of a pool and a widget that scrubs it
through time, utilisation over time, where the pool goes, and the block-size sweep."""

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

from paged.analysis.fragmentation import PAPER_ORCA_USAGE, PAPER_VLLM_USAGE, STATE_NAMES, SimulationResult
from paged.analysis.traces import TraceRequest
from paged.viz.common import html_table


def plot_length_histograms(traces: dict[str, list[TraceRequest]], bins: int = 40):
    """Histograms of input and output lengths (shared log-spaced bins, each trace's bars sum to 1)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    longest = max(max(r.input_len, r.output_len) for trace in traces.values() for r in trace)
    edges = np.geomspace(1, longest + 1, bins)
    for name, trace in traces.items():
        for ax, lengths in zip(axes, ([r.input_len for r in trace], [r.output_len for r in trace])):
            ax.hist(
                lengths,
                bins=edges,
                weights=np.full(len(lengths), 1 / len(lengths)),
                alpha=0.5,
                label=f"{name} (mean {np.mean(lengths):.0f})",
            )
    for ax, what in zip(axes, ("input", "output")):
        ax.set(xscale="log", xlabel=f"{what} tokens", ylabel="share of requests", title=f"{what} lengths")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


STATE_COLORS = {
    "free": "#f2f2f2",
    "live": "#2e8b57",
    "reserved": "#f4b942",
    "internal": "#d9534f",
    "external": "#7b5ea7",
}


def state_legend_html() -> str:
    items = "".join(
        f"<span style='display:inline-block;width:12px;height:12px;background:{STATE_COLORS[name]};"
        f"border:1px solid #999;margin:0 4px 0 12px;vertical-align:middle'></span>{name}"
        for name in STATE_NAMES
    )
    return f"<div style='font-size:12px;margin:4px 0'>{items}</div>"


def cell_fractions(states: np.ndarray, slots_per_cell: int) -> np.ndarray:
    """Share of each slot state in each cell of slots_per_cell consecutive slots: float [num_cells, 5]."""
    if slots_per_cell < 1 or len(states) % slots_per_cell:
        raise ValueError(f"slots_per_cell must be >= 1 and divide the {len(states)} slots, got {slots_per_cell}")
    cells = states.reshape(-1, slots_per_cell)  # [num_cells, slots_per_cell]
    return np.stack([(cells == code).mean(1) for code in range(len(STATE_NAMES))], axis=1)


def _cell_background(fractions: np.ndarray) -> str:
    # A vertical stack of the states present in the cell, bottom to top in STATE_NAMES order.
    stops, edge = [], 0.0
    for name, share in zip(STATE_NAMES, fractions):
        if share > 0:
            stops.append(f"{STATE_COLORS[name]} {100 * edge:.0f}% {100 * (edge + share):.0f}%")
            edge += share
    return stops[0].split()[0] if len(stops) == 1 else f"linear-gradient(to top, {', '.join(stops)})"


def memory_map_html(states: np.ndarray, slots_per_cell: int = 16, columns: int = 64, title: str = "") -> str:
    """The pool as a grid of cells, each slots_per_cell consecutive slots, coloured by the states it holds.

    states: int8 [capacity] slot states (fragmentation.slot_states). Address 0 is top left, row by row.
    """
    fractions = cell_fractions(states, slots_per_cell)  # [num_cells, 5]
    cells = "".join(f"<div style='background:{_cell_background(f)}'></div>" for f in fractions)
    counts = np.bincount(states, minlength=len(STATE_NAMES))
    caption = ", ".join(f"{name} {count:,}" for name, count in zip(STATE_NAMES, counts))
    grid = (
        f"<div style='display:grid;grid-template-columns:repeat({columns}, 8px);grid-auto-rows:14px;gap:1px;"
        f"background:#ccc;padding:1px;width:max-content'>{cells}</div>"
    )
    heading = f"<div style='font-weight:bold'>{html.escape(title)}</div>" if title else ""
    return (
        f"<div>{heading}{grid}<div style='font-size:12px'>{len(states):,} slots, {slots_per_cell} per cell: "
        f"{caption}</div>{state_legend_html()}</div>"
    )


def memory_map_widget(results: list[SimulationResult], slots_per_cell: int = 16, columns: int = 64):
    """Scrub through time: a dropdown picks the scheme, a slider picks a recorded step, the map redraws."""
    by_scheme = {r.scheme: r for r in results if r.layouts}
    if not by_scheme:
        raise ValueError("results hold no memory maps: simulate with layout_every > 0")
    scheme = widgets.Dropdown(options=list(by_scheme), description="scheme")
    step = widgets.IntSlider(description="step", layout=widgets.Layout(width="600px"))
    view = widgets.HTML()

    def redraw(_=None):
        result = by_scheme[scheme.value]
        snapped = min(result.layouts, key=lambda s: abs(s - step.value))  # nearest recorded step
        view.value = memory_map_html(
            result.layouts[snapped],
            slots_per_cell,
            columns,
            title=f"{result.scheme}, step {snapped}: {step_caption(result, snapped)}",
        )

    def rescale(_=None):
        recorded = sorted(by_scheme[scheme.value].layouts)
        step.max = max(step.max, recorded[-1])  # widen first, so min never passes max
        step.min, step.max = recorded[0], recorded[-1]
        step.step = recorded[1] - recorded[0] if len(recorded) > 1 else 1
        redraw()

    scheme.observe(rescale, "value")
    step.observe(redraw, "value")
    rescale()
    return widgets.VBox([widgets.HBox([scheme, step]), view])


def step_caption(result: SimulationResult, step: int) -> str:
    """'12 running, 30 waiting, utilisation 41.0 %' for a recorded step."""
    row = int(np.flatnonzero(result.steps == step)[0])
    return (
        f"{result.running[row]} running, {result.waiting[row]} waiting, "
        f"utilisation {100 * result.utilisation[row]:.1f} %"
    )


def utilisation_series(result: SimulationResult, window: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """(steps, live / pool) smoothed by a moving mean over `window` records, over the steps under load."""
    mask = result.loaded
    steps, values = result.steps[mask], result.live_share[mask]
    if len(values) > window:
        values = np.convolve(values, np.ones(window) / window, mode="valid")
        steps = steps[window // 2 : window // 2 + len(values)]
    return steps, values


def plot_utilisation_over_time(results: list[SimulationResult], title: str = ""):
    """The share of the KV pool holding tokens (live / pool) against step, one line per scheme, with the paper's
    ranges, which are shares of the same whole."""
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axhspan(
        PAPER_ORCA_USAGE["max"],
        PAPER_ORCA_USAGE["oracle"],
        color="#d9534f",
        alpha=0.12,
        label="paper: existing systems 20.4-38.2 %",
    )
    ax.axhline(PAPER_VLLM_USAGE, color="#2e8b57", linestyle="--", label="paper: vLLM 96.3 %")
    for result in results:
        steps, values = utilisation_series(result)
        ax.plot(steps, values, label=result.scheme, linewidth=1.2)
    ax.set(xlabel="decode step", ylabel="live / KV pool", ylim=(0, 1.02), title=title or "KV memory holding tokens")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def plot_breakdown(summaries: list[dict], title: str = ""):
    """Stacked bars: where the pool's slots went (mean under load), one bar per scheme; paper values as marks."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = [s["scheme"] for s in summaries]
    bottom = np.zeros(len(summaries))
    for state in ("live", "reserved", "internal", "external", "free"):
        values = np.array([s[f"{state}_fraction"] for s in summaries])
        ax.bar(names, values, bottom=bottom, color=STATE_COLORS[state], edgecolor="#666", label=state)
        bottom += values
    paper = {**{f"naive-{policy}": value for policy, value in PAPER_ORCA_USAGE.items()}, "paged-16": PAPER_VLLM_USAGE}
    marked = [(i, paper[name]) for i, name in enumerate(names) if name in paper]
    if marked:
        ax.scatter(*zip(*marked), marker="_", s=600, color="black", linewidths=2, zorder=3, label="paper: token states")
    ax.set(ylabel="fraction of the KV pool", ylim=(0, 1), title=title or "Where the KV pool goes")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def plot_block_size_sweep(summaries_by_trace: dict[str, list[dict]]):
    """Paged allocation at each block size: live / pool (left) and max concurrency (right), one line per trace."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for trace_name, summaries in summaries_by_trace.items():
        paged = [s for s in summaries if s["scheme"].startswith("paged-")]
        sizes = [int(s["scheme"].removeprefix("paged-")) for s in paged]
        left.plot(sizes, [s["live_fraction"] for s in paged], marker="o", label=trace_name)
        right.plot(sizes, [s["max_concurrency"] for s in paged], marker="o", label=trace_name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
    left.axhline(PAPER_VLLM_USAGE, color="grey", linestyle="--", label="paper: vLLM 96.3 %")
    left.set(ylabel="live / KV pool", title="Smaller blocks waste less")
    right.set(yscale="log", ylabel="requests running at once", title="Max concurrency in the same pool")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


SUMMARY_FORMATS = {
    "utilisation": ".1%",
    "live/pool": ".1%",
    "reserved": ".1%",
    "internal": ".1%",
    "external": ".1%",
    "mean running": ".1f",
}


def summary_table_html(summaries: list[dict]) -> str:
    """The figures chapter 02 reports for each scheme, as an HTML table (fractions are of the pool, under load)."""
    rows = [
        {
            "scheme": s["scheme"],
            "utilisation": s["utilisation"],
            "live/pool": s["live_fraction"],
            "reserved": s["reserved_fraction"],
            "internal": s["internal_fraction"],
            "external": s["external_fraction"],
            "mean running": s["mean_concurrency"],
            "max running": s["max_concurrency"],
            "steps": s["num_steps"],
            "preemptions": s["preemptions"],
        }
        for s in summaries
    ]
    return html_table(rows, formats=SUMMARY_FORMATS)
