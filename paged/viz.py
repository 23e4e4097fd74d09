"""Widgets and plots for the chapters, by guide section.

Each picture is built in two layers: a pure function that returns data or an HTML string (tested without a
browser), and a thin matplotlib or ipywidgets wrapper that shows it. This is the only module of `paged` that
imports matplotlib or ipywidgets; nothing else in the package imports this one.
"""

import html
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

from paged.block_manager import BlockManager
from paged.fragmentation import PAPER_ORCA_USAGE, PAPER_VLLM_USAGE, STATE_NAMES, SimulationResult
from paged.geometry import H100_SXM_BANDWIDTH, H100_SXM_BF16_FLOPS, KVGeometry, decode_step_flops_per_byte
from paged.metrics import SLO, ReplayResult, StepRecord
from paged.sharing import BlockSteps, on_forward
from paged.traces import Request

# ---------------------------------------------------------------------------------------------------------------
# shared: tables
# ---------------------------------------------------------------------------------------------------------------


def html_table(rows: list[dict], columns: list[str] | None = None, formats: dict | None = None) -> str:
    """An HTML table of dict rows; formats maps a column to a format spec ('.1%') or a function."""
    columns = columns or list(rows[0])
    formats = formats or {}

    def cell(column, value):
        spec = formats.get(column)
        text = spec(value) if callable(spec) else format(value, spec) if spec else str(value)
        align = "left" if column == columns[0] else "right"         # labels left, figures right
        return f"<td style='text-align:{align}'>{html.escape(text)}</td>"

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cell(c, row[c]) for c in columns) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---------------------------------------------------------------------------------------------------------------
# §1-§2 what the cache holds, and why decode is memory-bound (chapter 01)
# ---------------------------------------------------------------------------------------------------------------


def request_bytes_series(geometries: dict[str, KVGeometry], context_lens) -> dict[str, np.ndarray]:
    """KV bytes of one request at each context length, per named model: name -> float [len(context_lens)]."""
    return {name: np.array([g.request_bytes(n) for n in context_lens], dtype=float) for name, g in geometries.items()}


def plot_request_bytes(geometries: dict[str, KVGeometry], context_lens=(256, 512, 1024, 2048, 4096, 8192)):
    """Log-log lines: KV bytes of one request against its context length, one line per model."""
    series = request_bytes_series(geometries, context_lens)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        ax.plot(context_lens, values / 2 ** 20, marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="tokens in the request", ylabel="KV cache (MiB)",
           title="One request's KV cache grows linearly with its length")
    ax.set_xticks(context_lens, [str(n) for n in context_lens])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def decode_intensity_series(geometry: KVGeometry, num_params: float, batch_sizes, context_lens) -> dict[int, np.ndarray]:
    """FLOPs per byte of a decode step: context_len -> float [len(batch_sizes)]."""
    return {n: np.array([decode_step_flops_per_byte(geometry, num_params, b, n) for b in batch_sizes])
            for n in context_lens}


def plot_decode_intensity(geometry: KVGeometry, num_params: float, batch_sizes=(1, 4, 16, 64, 256, 1024),
                          context_lens=(512, 2048, 8192), flops=H100_SXM_BF16_FLOPS, bandwidth=H100_SXM_BANDWIDTH):
    """Arithmetic intensity of a decode step against batch size, with the GPU's ridge point (flops / bandwidth).
    Below the ridge a step's time is set by bytes read, not by FLOPs: decode is memory-bound."""
    series = decode_intensity_series(geometry, num_params, batch_sizes, context_lens)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for context_len, values in series.items():
        ax.plot(batch_sizes, values, marker="o", label=f"context {context_len}")
    ax.axhline(flops / bandwidth, color="black", linestyle="--", label=f"H100 ridge {flops / bandwidth:.0f} FLOP/B")
    ax.axhline(geometry.attention_flops_per_byte, color="grey", linestyle=":",
               label=f"attention alone {geometry.attention_flops_per_byte:.0f} FLOP/B")
    ax.set(xscale="log", yscale="log", xlabel="batch size (sequences per decode step)", ylabel="FLOP per byte read",
           title="A decode step stays under the ridge: memory-bound")
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------------
# §1, §3, §8 fragmentation: memory maps, utilisation over time, breakdowns, block-size sweep (chapter 02)
# ---------------------------------------------------------------------------------------------------------------

def plot_length_histograms(traces: dict[str, list[Request]], bins: int = 40):
    """Histograms of input and output lengths (shared log-spaced bins, each trace's bars sum to 1)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    longest = max(max(r.input_len, r.output_len) for trace in traces.values() for r in trace)
    edges = np.geomspace(1, longest + 1, bins)
    for name, trace in traces.items():
        for ax, lengths in zip(axes, ([r.input_len for r in trace], [r.output_len for r in trace])):
            ax.hist(lengths, bins=edges, weights=np.full(len(lengths), 1 / len(lengths)), alpha=0.5,
                    label=f"{name} (mean {np.mean(lengths):.0f})")
    for ax, what in zip(axes, ("input", "output")):
        ax.set(xscale="log", xlabel=f"{what} tokens", ylabel="share of requests", title=f"{what} lengths")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


STATE_COLORS = {"free": "#f2f2f2", "live": "#2e8b57", "reserved": "#f4b942", "internal": "#d9534f",
                "external": "#7b5ea7"}


def state_legend_html() -> str:
    items = "".join(f"<span style='display:inline-block;width:12px;height:12px;background:{STATE_COLORS[name]};"
                    f"border:1px solid #999;margin:0 4px 0 12px;vertical-align:middle'></span>{name}"
                    for name in STATE_NAMES)
    return f"<div style='font-size:12px;margin:4px 0'>{items}</div>"


def cell_fractions(states: np.ndarray, slots_per_cell: int) -> np.ndarray:
    """Share of each slot state in each cell of slots_per_cell consecutive slots: float [num_cells, 5]."""
    if slots_per_cell < 1 or len(states) % slots_per_cell:
        raise ValueError(f"slots_per_cell must be >= 1 and divide the {len(states)} slots, got {slots_per_cell}")
    cells = states.reshape(-1, slots_per_cell)                                     # [num_cells, slots_per_cell]
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
    fractions = cell_fractions(states, slots_per_cell)                              # [num_cells, 5]
    cells = "".join(f"<div style='background:{_cell_background(f)}'></div>" for f in fractions)
    counts = np.bincount(states, minlength=len(STATE_NAMES))
    caption = ", ".join(f"{name} {count:,}" for name, count in zip(STATE_NAMES, counts))
    grid = (f"<div style='display:grid;grid-template-columns:repeat({columns}, 8px);grid-auto-rows:14px;gap:1px;"
            f"background:#ccc;padding:1px;width:max-content'>{cells}</div>")
    heading = f"<div style='font-weight:bold'>{html.escape(title)}</div>" if title else ""
    return (f"<div>{heading}{grid}<div style='font-size:12px'>{len(states):,} slots, {slots_per_cell} per cell: "
            f"{caption}</div>{state_legend_html()}</div>")


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
        snapped = min(result.layouts, key=lambda s: abs(s - step.value))      # nearest recorded step
        view.value = memory_map_html(result.layouts[snapped], slots_per_cell, columns,
                                     title=f"{result.scheme}, step {snapped}: {step_caption(result, snapped)}")

    def rescale(_=None):
        recorded = sorted(by_scheme[scheme.value].layouts)
        step.max = max(step.max, recorded[-1])          # widen first, so min never passes max
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
    return (f"{result.running[row]} running, {result.waiting[row]} waiting, "
            f"utilisation {100 * result.utilisation[row]:.1f} %")


def utilisation_series(result: SimulationResult, window: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """(steps, utilisation) smoothed by a moving mean over `window` records, over the steps under load."""
    mask = result.loaded
    steps, values = result.steps[mask], result.utilisation[mask]
    if len(values) > window:
        values = np.convolve(values, np.ones(window) / window, mode="valid")
        steps = steps[window // 2: window // 2 + len(values)]
    return steps, values


def plot_utilisation_over_time(results: list[SimulationResult], title: str = ""):
    """Utilisation (live / allocated) against step, one line per scheme, with the paper's ranges."""
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axhspan(PAPER_ORCA_USAGE["max"], PAPER_ORCA_USAGE["oracle"], color="#d9534f", alpha=0.12,
               label="paper: existing systems 20.4-38.2 %")
    ax.axhline(PAPER_VLLM_USAGE, color="#2e8b57", linestyle="--", label="paper: vLLM 96.3 %")
    for result in results:
        steps, values = utilisation_series(result)
        ax.plot(steps, values, label=result.scheme, linewidth=1.2)
    ax.set(xlabel="decode step", ylabel="live / allocated KV", ylim=(0, 1.02), title=title or "Utilisation under load")
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
        ax.scatter(*zip(*marked), marker="_", s=600, color="black", linewidths=2, zorder=3,
                   label="paper: token states")
    ax.set(ylabel="fraction of the KV pool", ylim=(0, 1), title=title or "Where the KV pool goes")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def plot_block_size_sweep(summaries_by_trace: dict[str, list[dict]]):
    """Paged allocation at each block size: utilisation (left) and max concurrency (right), one line per trace."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for trace_name, summaries in summaries_by_trace.items():
        paged = [s for s in summaries if s["scheme"].startswith("paged-")]
        sizes = [int(s["scheme"].removeprefix("paged-")) for s in paged]
        left.plot(sizes, [s["utilisation"] for s in paged], marker="o", label=trace_name)
        right.plot(sizes, [s["max_concurrency"] for s in paged], marker="o", label=trace_name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
    left.axhline(PAPER_VLLM_USAGE, color="grey", linestyle="--", label="paper: vLLM 96.3 %")
    left.set(ylabel="live / allocated KV", title="Smaller blocks waste less")
    right.set(yscale="log", ylabel="requests running at once", title="Max concurrency in the same pool")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


SUMMARY_FORMATS = {"utilisation": ".1%", "live/pool": ".1%", "reserved": ".1%", "internal": ".1%",
                   "external": ".1%", "mean running": ".1f"}


def summary_table_html(summaries: list[dict]) -> str:
    """The figures chapter 02 reports for each scheme, as an HTML table (fractions are of the pool, under load)."""
    rows = [{"scheme": s["scheme"], "utilisation": s["utilisation"], "live/pool": s["live_fraction"],
             "reserved": s["reserved_fraction"], "internal": s["internal_fraction"],
             "external": s["external_fraction"], "mean running": s["mean_concurrency"],
             "max running": s["max_concurrency"], "steps": s["num_steps"], "preemptions": s["preemptions"]}
            for s in summaries]
    return html_table(rows, formats=SUMMARY_FORMATS)


# ---------------------------------------------------------------------------------------------------------------
# §5-§6 block tables and the physical pool (chapter 03)
# ---------------------------------------------------------------------------------------------------------------

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7"]
FREE_COLOUR = "#d9d9d9"


def seq_colour(seq_id: int) -> str:
    """One colour per sequence, the same in its block table and in the pool."""
    return PALETTE[seq_id % len(PALETTE)]


@dataclass(frozen=True)
class PoolSnapshot:
    """What a BlockManager holds at one moment, as plain data: enough to draw it, and to test the drawing."""
    block_size: int
    tables: dict[int, list[int]]  # seq_id -> physical block ids, in logical order
    ref_counts: list[int]         # block_id -> number of tables that hold it
    free_queue: list[int]         # free block ids, in the order they will be handed out
    num_tokens: dict[int, int]    # seq_id -> tokens it holds (they fill its blocks' slots in order)
    labels: dict[int, str]        # seq_id -> the name drawn for it
    caption: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    def owner(self, block_id: int) -> int | None:
        """The lowest seq_id whose table holds block_id (its colour is the block's), None if the block is free."""
        holders = [seq_id for seq_id, table in self.tables.items() if block_id in table]
        return min(holders) if holders else None

    def tokens_in(self, seq_id: int, logical: int) -> int:
        """Slots of seq_id's logical block `logical` that hold a token."""
        return max(0, min(self.block_size, self.num_tokens[seq_id] - logical * self.block_size))


def snapshot(manager: BlockManager, num_tokens: dict[int, int] | None = None, labels: dict[int, str] | None = None,
             caption: str = "") -> PoolSnapshot:
    """Copy a BlockManager's tables, ref counts and free queue. num_tokens defaults to full blocks."""
    tables = {seq_id: list(table) for seq_id, table in sorted(manager.block_tables.items())}
    num_tokens = num_tokens or {}
    labels = labels or {}
    return PoolSnapshot(
        block_size=manager.block_size,
        tables=tables,
        ref_counts=[block.ref_count for block in manager.blocks],
        free_queue=[block.block_id for block in manager.free_queue],
        num_tokens={s: num_tokens.get(s, len(t) * manager.block_size) for s, t in tables.items()},
        labels={s: labels.get(s, f"seq {s}") for s in tables},
        caption=caption)


def engine_snapshot(engine, caption: str = "") -> PoolSnapshot:
    """The live block tables of an LLMEngine, each labelled with its request and filled to its computed tokens."""
    running = {seq.seq_id: seq for seq in engine.scheduler.running}
    return snapshot(engine.block_manager,
                    num_tokens={i: seq.num_computed_tokens for i, seq in running.items()},
                    labels={i: f"request {seq.request.request_id}" for i, seq in running.items()},
                    caption=caption)


def replay(num_blocks: int, block_size: int, events: list[tuple]) -> list[PoolSnapshot]:
    """Run events through a fresh BlockManager; one snapshot before the first event and one after each.

    An event names a BlockManager method and its arguments: ("allocate", seq_id, num_tokens) grows seq_id's
    table to hold num_tokens tokens, ("fork", parent_id, child_id) shares the parent's blocks with the child,
    ("free", seq_id) drops a table.
    """
    manager = BlockManager(num_blocks, block_size)
    num_tokens: dict[int, int] = {}
    frames = [snapshot(manager, caption=f"an empty pool of {num_blocks} blocks of {block_size} slots")]
    for kind, seq_id, *rest in events:
        if kind == "allocate":
            (count,) = rest
            before = len(manager.block_tables.get(seq_id, ()))
            table = manager.allocate(seq_id, count)
            num_tokens[seq_id] = count
            new = table[before:]
            plural = "s" if len(new) > 1 else ""
            what = f"new block{plural} {', '.join(map(str, new))}" if new else f"fits in block {table[-1]}"
            caption = f"seq {seq_id} holds {count} tokens: {what}"
        elif kind == "fork":
            (child_id,) = rest
            manager.fork(seq_id, child_id)
            num_tokens[child_id] = num_tokens[seq_id]
            caption = f"seq {child_id} forks from seq {seq_id}: shares its blocks, ref counts go up"
        elif kind == "free":
            freed = [b for b in manager.block_tables[seq_id] if manager.ref_count(b) == 1]
            manager.free(seq_id)
            del num_tokens[seq_id]
            returned = (f"block {freed[0]} returns" if len(freed) == 1 else
                        f"blocks {', '.join(map(str, freed))} return" if freed else "no block returns")
            caption = f"seq {seq_id} finishes: {returned} to the free queue"
        else:
            raise ValueError(f"unknown event kind {kind!r}; use 'allocate', 'fork' or 'free'")
        frames.append(snapshot(manager, num_tokens, caption=caption))
    return frames


def decode_script(requests: list[tuple[int, int, int]]) -> list[tuple]:
    """Events for requests (arrival_step, prompt_len, new_tokens) decoded together, one token per step each:
    at arrival a request holds its prompt, each later step one more token, and it is freed after new_tokens
    steps, before that step's growth (so others can take its blocks at once). Sequences are numbered in order."""
    events = []
    last_step = max(arrival + new for arrival, _, new in requests)
    for step in range(last_step + 1):
        events += [("free", seq_id) for seq_id, (arrival, _, new) in enumerate(requests) if step == arrival + new]
        events += [("allocate", seq_id, prompt_len + step - arrival)
                   for seq_id, (arrival, prompt_len, new) in enumerate(requests) if arrival <= step < arrival + new]
    return events


_BLOCK_STYLE = ("display:inline-block;width:38px;height:34px;margin:2px;border-radius:4px;text-align:center;"
                "font:12px/16px monospace;color:#111;vertical-align:top;box-sizing:border-box;padding-top:1px;")


def _block_cell(block_id: int, colour: str, filled: int, block_size: int, ref_count: int, attrs: str) -> str:
    """One block: its id, its slots filled left to right (a lighter tint for empty ones), its ref count if shared."""
    share = round(100 * filled / block_size)
    background = f"linear-gradient(to right, {colour} {share}%, {colour}55 {share}%)"
    border = "2px dashed #111" if ref_count > 1 else "1px solid #888"
    badge = f"<br><b>&times;{ref_count}</b>" if ref_count > 1 else "<br>&nbsp;"
    title = f"block {block_id}: {filled}/{block_size} slots, ref count {ref_count}"
    return (f'<div class="blk" {attrs} data-block="{block_id}" data-ref="{ref_count}" title="{title}" '
            f'style="{_BLOCK_STYLE}background:{background};border:{border}">{block_id}{badge}</div>')


def block_tables_html(snap: PoolSnapshot) -> str:
    """One row per sequence: its name, token count, and the physical block behind each logical block."""
    if not snap.tables:
        return '<div class="tables"><i>no block tables: nothing is running</i></div>'
    rows = []
    for seq_id, table in snap.tables.items():
        cells = "".join(
            _block_cell(block, seq_colour(snap.owner(block)), snap.tokens_in(seq_id, logical), snap.block_size,
                        snap.ref_counts[block], f'data-seq="{seq_id}" data-logical="{logical}"')
            for logical, block in enumerate(table))
        name = html.escape(snap.labels[seq_id])
        rows.append(f'<div class="table-row" data-seq="{seq_id}" style="white-space:nowrap">'
                    f'<span style="display:inline-block;width:170px;font:12px monospace;color:{seq_colour(seq_id)}">'
                    f'<b>{name}</b> ({snap.num_tokens[seq_id]} tok)</span>{cells}</div>')
    return ('<div class="tables"><b>block tables</b> (logical block 0, 1, 2, ... &rarr; physical block)'
            + "".join(rows) + "</div>")


def physical_pool_html(snap: PoolSnapshot) -> str:
    """Every physical block in id order: coloured by the sequence that holds it, grey when free, with the
    free queue's order (the next blocks handed out) written below."""
    cells = []
    for block_id, ref_count in enumerate(snap.ref_counts):
        owner = snap.owner(block_id)
        if owner is None:
            cells.append(_block_cell(block_id, FREE_COLOUR, 0, snap.block_size, 0, 'data-free="1"'))
        else:
            logical = snap.tables[owner].index(block_id)
            cells.append(_block_cell(block_id, seq_colour(owner), snap.tokens_in(owner, logical), snap.block_size,
                                     ref_count, f'data-seq="{owner}"'))
    queue = " &rarr; ".join(map(str, snap.free_queue)) or "empty"
    used = snap.num_blocks - len(snap.free_queue)
    return (f'<div class="pool"><b>physical pool</b> ({used} of {snap.num_blocks} blocks used)'
            f'<div style="max-width:640px">{"".join(cells)}</div>'
            f'<div class="free-queue" style="font:12px monospace">free queue: {queue}</div></div>')


def snapshot_html(snap: PoolSnapshot) -> str:
    """The caption, every block table, then the physical pool."""
    caption = f'<div class="caption" style="font:13px sans-serif;margin:4px 0">{html.escape(snap.caption)}</div>'
    return f'<div class="pool-snapshot">{caption}{block_tables_html(snap)}{physical_pool_html(snap)}</div>'


def player(num_frames: int, render, interval_ms: int = 700, start: int = 0, label: str = "frame") -> widgets.VBox:
    """A Play button and a slider over frames 0..num_frames-1; render(i) returns the HTML of frame i."""
    play = widgets.Play(min=0, max=num_frames - 1, interval=interval_ms, description="play")
    slider = widgets.IntSlider(min=0, max=num_frames - 1, value=start, description=label)
    widgets.jslink((play, "value"), (slider, "value"))
    view = widgets.HTML(render(start))
    slider.observe(lambda change: setattr(view, "value", render(change["new"])), names="value")
    return widgets.VBox([widgets.HBox([play, slider]), view])


def pool_player(frames: list[PoolSnapshot], interval_ms: int = 700) -> widgets.VBox:
    """Step through snapshots, redrawing the tables and the pool."""
    return player(len(frames), lambda i: snapshot_html(frames[i]), interval_ms)


# ---------------------------------------------------------------------------------------------------------------
# §9 Prefix caching (chapter 05): chained block hashes, shared blocks, eviction order, TTFT
# ---------------------------------------------------------------------------------------------------------------

IDLE_CACHED_COLOUR = "#c6dbef"  # a block no table holds that keeps its tokens and its hash
CACHED_OUTLINE = "#08519c"      # drawn around every block the prefix cache holds
_HASH_STYLE = ("display:inline-block;min-width:34px;height:22px;margin:2px;padding:0 3px;border-radius:4px;"
               "text-align:center;font:12px/22px monospace;color:#111;border:1px solid #888;")


def hash_names(chains: dict[str, list[int]]) -> dict[str, list[str]]:
    """Name each distinct block hash #1, #2, ... in order of first appearance, so that equal hashes read equal.
    (The numbers themselves differ from one Python process to the next; the names do not.)"""
    names: dict[int, str] = {}
    return {label: [names.setdefault(h, f"#{len(names) + 1}") for h in chain] for label, chain in chains.items()}


def hash_chain_html(chains: dict[str, list[int]], block_texts: dict[str, list[str]] | None = None) -> str:
    """One row per prompt, one cell per full block, named and coloured by its hash: a shared prefix is a run of
    equal cells from the left. block_texts, the decoded tokens of each block, become the cells' tooltips."""
    block_texts = block_texts or {}
    rows = []
    for label, names in hash_names(chains).items():
        texts = block_texts.get(label, [""] * len(names))
        cells = "".join(f'<div class="hash" data-hash="{name}" title="{html.escape(text)}" style="{_HASH_STYLE}'
                        f'background:{PALETTE[(int(name[1:]) - 1) % len(PALETTE)]}">{name}</div>'
                        for name, text in zip(names, texts))
        rows.append(f'<div class="hash-row" style="white-space:nowrap"><span style="display:inline-block;'
                    f'width:220px;font:12px monospace">{html.escape(label)}</span>{cells}</div>')
    return ('<div class="hash-chains"><b>block hashes</b> (block 0, 1, 2, ... of each prompt; equal name = equal '
            'hash)' + "".join(rows) + "</div>")


@dataclass(frozen=True)
class CacheSnapshot:
    """A PoolSnapshot plus the blocks the prefix cache holds."""
    pool: PoolSnapshot
    cached: frozenset[int]  # block ids registered under a hash, whether a table holds them or not

    @property
    def next_evicted(self) -> int | None:
        """The cached block the pool will reuse first: the first cached block in the free queue (the blocks ahead of
        it hold nothing worth keeping). None when no idle block is cached."""
        return next((block_id for block_id in self.pool.free_queue if block_id in self.cached), None)


def _cached_ids(manager: BlockManager) -> frozenset[int]:
    return frozenset(block.block_id for block in manager.cached.values())


def cache_snapshot(manager: BlockManager, num_tokens: dict[int, int] | None = None,
                   labels: dict[int, str] | None = None, caption: str = "") -> CacheSnapshot:
    """Copy a prefix-caching BlockManager's tables, ref counts, free queue and cached blocks."""
    return CacheSnapshot(snapshot(manager, num_tokens, labels, caption), _cached_ids(manager))


def engine_cache_snapshot(engine, caption: str = "") -> CacheSnapshot:
    """engine_snapshot plus the blocks the engine's prefix cache holds."""
    return CacheSnapshot(engine_snapshot(engine, caption), _cached_ids(engine.block_manager))


def prefix_replay(manager: BlockManager, events: list[tuple]) -> list[CacheSnapshot]:
    """Drive a prefix-caching BlockManager as the scheduler and the engine do; one snapshot before the first event
    and one after each.

    ("prefill", seq_id, token_ids): find the prompt's cached prefix, allocate the rest of its blocks (evicting from
    the head of the free queue if need be) and, as if the step had run, register its full blocks in the cache.
    ("free", seq_id): the sequence finishes and its blocks join the back of the free queue, last block first.
    """
    num_tokens: dict[int, int] = {}
    frames = [cache_snapshot(manager, caption=f"a pool of {manager.num_blocks} blocks of {manager.block_size} slots")]
    for kind, seq_id, *rest in events:
        if kind == "prefill":
            (token_ids,) = rest
            hits = manager.find_cached_prefix(token_ids)
            was_cached = _cached_ids(manager)
            new = manager.allocate(seq_id, len(token_ids), hits)[len(hits):]
            manager.cache_full_blocks(seq_id, token_ids, len(token_ids))
            num_tokens[seq_id] = len(token_ids)
            evicted = [block_id for block_id in new if block_id in was_cached]
            caption = (f"seq {seq_id} ({len(token_ids)} tokens): {len(hits) * manager.block_size} from the cache "
                       f"{[block.block_id for block in hits]}, new blocks {new}"
                       + (f", evicting {evicted}" if evicted else ""))
        elif kind == "free":
            returned = [b for b in reversed(manager.block_tables[seq_id]) if manager.ref_count(b) == 1]
            manager.free(seq_id)
            del num_tokens[seq_id]
            caption = f"seq {seq_id} finishes: blocks {returned} join the back of the free queue"
        else:
            raise ValueError(f"unknown event kind {kind!r}; use 'prefill' or 'free'")
        frames.append(cache_snapshot(manager, num_tokens, caption=caption))
    return frames


def cache_pool_html(snap: CacheSnapshot) -> str:
    """The physical pool as in chapter 03, every cached block outlined, idle cached blocks (ref count 0, tokens
    kept) pale blue instead of grey; then the free queue head first, * marking cached blocks, and the next eviction."""
    pool = snap.pool
    cells = []
    for block_id, ref_count in enumerate(pool.ref_counts):
        owner = pool.owner(block_id)
        if owner is not None:
            filled = pool.tokens_in(owner, pool.tables[owner].index(block_id))
            cell = _block_cell(block_id, seq_colour(owner), filled, pool.block_size, ref_count, f'data-seq="{owner}"')
        elif block_id in snap.cached:
            cell = _block_cell(block_id, IDLE_CACHED_COLOUR, pool.block_size, pool.block_size, 0, 'data-free="1"')
        else:
            cell = _block_cell(block_id, FREE_COLOUR, 0, pool.block_size, 0, 'data-free="1"')
        if block_id in snap.cached:
            cell = (f'<span class="cached" data-block="{block_id}" style="display:inline-block;vertical-align:top;'
                    f'border-radius:6px;outline:2px solid {CACHED_OUTLINE};outline-offset:-1px">{cell}</span>')
        cells.append(cell)
    queue = " &rarr; ".join(f"{b}*" if b in snap.cached else str(b) for b in pool.free_queue) or "empty"
    evicted = snap.next_evicted
    held = sum(1 for b in snap.cached if pool.ref_counts[b] > 0)
    legend = (f'<span style="outline:2px solid {CACHED_OUTLINE}">&nbsp;outlined&nbsp;</span> in the prefix cache, '
              f'<span style="background:{IDLE_CACHED_COLOUR}">&nbsp;pale blue&nbsp;</span> cached and idle (ref count '
              f'0, tokens kept), <span style="background:{FREE_COLOUR}">&nbsp;grey&nbsp;</span> empty')
    return (f'<div class="pool"><b>physical pool</b> ({pool.num_blocks - len(pool.free_queue)} of {pool.num_blocks} '
            f'blocks held; {len(snap.cached)} cached: {held} held, {len(snap.cached) - held} idle)'
            f'<div style="font:11px sans-serif;margin:2px 0">{legend}</div>'
            f'<div style="max-width:680px">{"".join(cells)}</div>'
            f'<div class="free-queue" style="font:12px monospace">free queue (head first, * cached): {queue}</div>'
            f'<div class="next-evicted" style="font:12px monospace">next eviction: '
            f'{"none" if evicted is None else f"block {evicted}"}</div></div>')


def cache_snapshot_html(snap: CacheSnapshot) -> str:
    """The caption, every block table (shared blocks carry their ref count), then the pool with the cache marked."""
    caption = f'<div class="caption" style="font:13px sans-serif;margin:4px 0">{html.escape(snap.pool.caption)}</div>'
    return f'<div class="cache-snapshot">{caption}{block_tables_html(snap.pool)}{cache_pool_html(snap)}</div>'


def cache_player(frames: list[CacheSnapshot], interval_ms: int = 900) -> widgets.VBox:
    """pool_player for CacheSnapshots."""
    return player(len(frames), lambda i: cache_snapshot_html(frames[i]), interval_ms)


def scheduled_prefills(engine) -> list[dict]:
    """The prompts the engine's last step worked on: per request its prompt length, the tokens whose K/V were in the
    pool before the step (for a prompt's first chunk: its prefix-cache hit) and the tokens the step computed.
    Read it right after engine.step()."""
    rows = []
    for seq, num_new in engine.last_schedule.scheduled:
        start = seq.num_computed_tokens - num_new
        if start < seq.num_prompt_tokens:  # a decode starts at or past the prompt's end
            rows.append({"request": seq.request.request_id, "prompt_tokens": seq.num_prompt_tokens,
                         "cached_tokens": start, "computed_tokens": num_new})
    return rows


def plot_ttft(ttfts: dict[str, list[float]], title: str = ""):
    """Time to first token per case: a bar at the median, a dot per measurement, log scale."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for x, (label, values) in enumerate(ttfts.items()):
        ax.bar(x, np.median(values), color=PALETTE[x % len(PALETTE)], alpha=0.7)
        ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        ax.annotate(f"{np.median(values):.2f} s", (x, np.median(values)), ha="center", va="bottom")
    ax.set_xticks(range(len(ttfts)), list(ttfts))
    ax.set(yscale="log", ylabel="time to first token (s)", title=title or "TTFT")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------------
# §10 Copy-on-write (chapter 06): forks over time, parallel sampling and beam search, savings against the paper
# ---------------------------------------------------------------------------------------------------------------


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
    forked = {seq_id for seq_id in new if any(other < seq_id and table[:1] == tables[seq_id][:1]
                                              for other, table in tables.items())}
    events = [f"seq {', '.join(map(str, sorted(ids)))} {what}"
              for ids, what in ((new - forked, "started"), (forked, "forked"), (before - set(tables), "freed")) if ids]
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
        ax.plot(steps, [u.physical for u in usage], color=colour, marker="o", markersize=3,
                label=f"{name}: shared blocks")
    ax.set(xlabel="engine step", ylabel="KV blocks held", ylim=(0, None), title="What sharing saves, step by step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def savings_table_html(rows: list[dict]) -> str:
    """Measured savings beside the paper's range (its range runs over n or width = 2, 4, 6)."""
    table = [{"method": r["method"], "model": r["model"], "trace": r["trace"], "n or width": r["n"],
              "measured": r["saving"],
              "paper (n = 2-6)": "{:.1%} - {:.1%}".format(*r["paper"]) if r["paper"] else "-"} for r in rows]
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
            ax.plot([r["n"] for r in line], [r["saving"] for r in line], marker=marker,
                    color=PALETTE[traces.index(trace)], label=f"{trace}, {model}")
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


# ---------------------------------------------------------------------------------------------------------------
# §11-§13 continuous batching, chunked prefill, goodput (chapters 07 and 08)
# ---------------------------------------------------------------------------------------------------------------

TIMELINE_STATES = {  # state -> (colour, legend)
    "": ("#ffffff", "not arrived"),
    "waiting": ("#f1ce63", "waiting"),
    "prefill": ("#4e79a7", "prefill (prompt chunk or recompute)"),
    "decode": ("#59a14f", "decode (one token)"),
    "preempted": ("#e15759", "preempted (blocks freed)"),
    "finished": ("#e8e8e8", "finished"),
}
_TIMELINE_STYLE = ("<style>.tl{border-collapse:collapse;font:10px monospace}.tl td{width:7px;height:12px;padding:0;"
                   "border:1px solid #fff}.tl td.label{width:auto;padding-right:4px;border:0}.tl td.now{outline:"
                   "2px solid #111}" + "".join(f".tl .s-{state or 'none'}{{background:{colour}}}"
                                             for state, (colour, _) in TIMELINE_STATES.items()) + "</style>")


def timeline_states(result: ReplayResult) -> list[list[str]]:
    """What each request did in each step of a replay: rows = requests (trace order), columns = steps, each a key
    of TIMELINE_STATES. A request is waiting from its arrival until a step schedules it (or after a preemption)."""
    grid, done = [], set()
    for step in result.steps:
        prefills = {request_id for request_id, _ in step.prefills}
        column = []
        for record in result.requests:
            rid = record.request_id
            column.append("finished" if rid in done else "decode" if rid in step.decodes else
                          "prefill" if rid in prefills else "preempted" if rid in step.preempted else
                          "waiting" if record.arrival_time <= step.start else "")
        grid.append(column)
        done.update(step.finished)
    return [list(row) for row in zip(*grid)] if grid else [[] for _ in result.requests]


def schedule_caption(step: StepRecord) -> str:
    """One line on what a step ran: its clock interval, its tokens, prefill chunks, decodes, preemptions, finishes."""
    chunks = ", ".join(f"req {request_id}: {n}" for request_id, n in step.prefills) or "none"
    text = (f"step {step.index}: clock {step.start:.3f} to {step.start + step.duration:.3f}, "
            f"{step.num_batched_tokens} tokens = {len(step.decodes)} decodes + prefill chunks [{chunks}]")
    if step.preempted:
        text += f"; preempted: req {', '.join(step.preempted)}"
    if step.finished:
        text += f"; finished: req {', '.join(step.finished)}"
    return text


def timeline_html(result: ReplayResult, upto: int | None = None, window: int = 60) -> str:
    """The timeline of steps [upto - window + 1, upto] (default: the last `window` steps), rows = requests; the column
    of step `upto` is outlined and captioned. Each cell's class is s-<state> (s-none: not arrived)."""
    states = timeline_states(result)
    upto = len(result.steps) - 1 if upto is None else upto
    first = max(0, upto - window + 1)
    head = "".join(f'<td style="text-align:left">{k}</td>' if k % 10 == 0 else "<td></td>"
                   for k in range(first, upto + 1))
    rows = [f'<tr class="steps"><td class="label">step</td>{head}</tr>']
    for record, row in zip(result.requests, states):
        cells = "".join(f'<td class="s-{row[k] or "none"}{" now" if k == upto else ""}"></td>'
                        for k in range(first, upto + 1))
        rows.append(f'<tr><td class="label">req {html.escape(record.request_id)}</td>{cells}</tr>')
    legend = " ".join(f'<span class="s-{state or "none"}" style="display:inline-block;width:10px;height:10px;'
                      f'border:1px solid #999"></span> {name}' for state, (_, name) in TIMELINE_STATES.items())
    caption = html.escape(schedule_caption(result.steps[upto])) if result.steps else "no steps"
    return (f'<div class="timeline">{_TIMELINE_STYLE}<div style="font:12px monospace;margin:2px 0">{caption}</div>'
            f'<table class="tl">{"".join(rows)}</table><div style="font:11px sans-serif">{legend}</div></div>')


def timeline_player(result: ReplayResult, window: int = 60, interval_ms: int = 250) -> widgets.VBox:
    """A Play button and a slider over the steps of a replay, redrawing the timeline up to the chosen step."""
    last = len(result.steps) - 1
    return player(last + 1, lambda step: timeline_html(result, step, window), interval_ms, start=last, label="step")


def plot_token_gaps(results: dict[str, ReplayResult], request_ids: list[str], title: str = ""):
    """For each replay, the gap before each output token of the given requests against the time it appeared:
    a long prefill in the batch shows as a spike in every running decode's gap."""
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.2), sharey=True, squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        for record in result.requests:
            if record.request_id in request_ids:
                ax.plot(record.token_times[1:], record.itl, marker=".", label=f"req {record.request_id}")
        ax.set(title=label, xlabel="clock (s)")
    axes[0][0].set_ylabel("gap before the token (s)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def empirical_cdf(values) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of values <= each."""
    x = np.sort(np.asarray(values, dtype=float))
    return x, np.arange(1, x.size + 1) / x.size


def plot_latency_cdfs(results: dict[str, dict[float, ReplayResult]], slo: SLO | None = None):
    """Distributions of TTFT, TPOT and each request's worst inter-token gap (rows), one column per request rate,
    one curve per configuration; an SLO's finite limits as dashed lines."""
    rates = sorted(next(iter(results.values())))
    metrics = [("TTFT (s)", lambda r: [r.ttft], "ttft"), ("TPOT (s)", lambda r: [r.tpot] if r.tpot else [], "tpot"),
               ("worst gap between tokens (s)", lambda r: [max(r.itl)] if r.itl else [], "itl")]
    fig, axes = plt.subplots(len(metrics), len(rates), figsize=(3.6 * len(rates), 2.6 * len(metrics)), squeeze=False)
    for row, (name, values, limit) in enumerate(metrics):
        for col, rate in enumerate(rates):
            ax = axes[row][col]
            for label, by_rate in results.items():
                ax.step(*empirical_cdf([v for r in by_rate[rate].requests for v in values(r)]), where="post",
                        label=label)
            if slo is not None and np.isfinite(getattr(slo, limit)):
                ax.axvline(getattr(slo, limit), color="k", ls="--", lw=1)
            ax.set(xlabel=name, ylim=(0, 1.02))
        axes[row][0].set_ylabel("fraction of requests")
    for col, rate in enumerate(rates):
        axes[0][col].set_title(f"{rate:g} requests/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_goodput(results: dict[str, dict[float, ReplayResult]], slos: dict[str, SLO]):
    """One panel per SLO: goodput (solid) and throughput (dotted) of each configuration against the offered rate."""
    fig, axes = plt.subplots(1, len(slos), figsize=(4.4 * len(slos), 3.4), sharey=True, squeeze=False)
    for ax, (title, slo) in zip(axes[0], slos.items()):
        for k, (label, by_rate) in enumerate(results.items()):
            rates = sorted(by_rate)
            summaries = [by_rate[rate].summary(slo) for rate in rates]
            colour = PALETTE[k % len(PALETTE)]
            ax.plot(rates, [s["goodput_rps"] for s in summaries], "o-", color=colour, label=f"{label}")
            ax.plot(rates, [s["throughput_rps"] for s in summaries], ":", color=colour)
        ax.set(xlabel="offered load (requests/s)", title=title)
    axes[0][0].set_ylabel("goodput (solid), throughput (dotted), req/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig
