"""Chapter 10's pictures (guide §15, §17): the memory tiers, blocks moving between the pool and its two offload
tiers step by step, and the swap-or-recompute crossover."""

import html
from dataclasses import dataclass, field

import matplotlib.pyplot as plt

from paged.viz.ch03_block_tables import FREE_COLOUR, seq_colour
from paged.viz.common import player

# (name, what it holds, bandwidth to the level above in bytes/s, a typical size) for an H100 server
TIERS = [
    ("GPU HBM: the pool", "blocks being read by attention", 3.35e12, "80 GB"),
    ("host DRAM, pinned", "swapped sequences, offloaded prefix blocks", 64e9, "0.5-2 TB"),
    ("local NVMe SSD", "a prefix cache that outlives the pool and the host tier", 7e9, "several TB"),
]


def tiers_html() -> str:
    """The three tiers stacked, with the link between each and the one above."""
    rows = []
    for i, (name, holds, bandwidth, size) in enumerate(TIERS):
        link = (
            ""
            if i == 0
            else (f"<div class='link' style='text-align:center;color:#555'>&#8597; {bandwidth / 1e9:,.0f} GB/s</div>")
        )
        rows.append(
            f"{link}<div class='tier' data-tier='{i}' style='border:2px solid #4e79a7;border-radius:6px;"
            f"padding:6px 10px;margin:2px auto;width:{60 + 12 * i}%;background:#eef3f8'>"
            f"<b>{html.escape(name)}</b> ({size}): {html.escape(holds)}</div>"
        )
    return "<div style='font-family:sans-serif;font-size:13px'>" + "".join(rows) + "</div>"


@dataclass(frozen=True)
class TierSnapshot:
    """The pool and both tiers after one engine step, as plain data."""

    step: int
    pool: list[int | None]  # block id -> the sequence holding it (the lowest id), None if free
    cached: frozenset[int]  # pool blocks named in the prefix cache
    swap: list[int | None]  # swap slot -> the sequence whose block it holds
    prefix: list[str | None]  # prefix-tier slot -> the name of the hash it holds (#1, #2, ...)
    moved: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # "swap out" -> [(block, slot)], ...
    queues: dict[str, list[int]] = field(default_factory=dict)  # running / swapped / waiting seq ids
    caption: str = ""


def tier_snapshot(engine, step: int, names: dict[bytes, str], stored: list[tuple[int, int]]) -> TierSnapshot:
    """Snapshot an engine with a swap space and a prefix tier, right after a step. names: hash -> drawn name,
    extended here in order of first appearance; stored: the step's (pool block, prefix slot) stores."""
    manager, plan = engine.block_manager, engine.last_schedule
    pool = [None] * manager.num_blocks
    for seq_id, table in sorted(manager.block_tables.items(), reverse=True):
        for block_id in table:
            pool[block_id] = seq_id
    swap = [None] * engine.swap_space.tier.num_slots
    for seq_id, slots in engine.swap_space.slots.items():
        for slot in slots:
            swap[slot] = seq_id
    prefix = [None] * engine.prefix_tier.tier.num_slots
    for block_hash, (_, slot) in engine.prefix_tier.entries.items():
        prefix[slot] = names.setdefault(block_hash, f"#{len(names) + 1}")
    moved = {
        "swap out": plan.blocks_to_swap_out,
        "swap in": [(b, s) for s, b in plan.blocks_to_swap_in],
        "load": [(b, s) for s, b in plan.blocks_to_load],
        "store": stored,
    }
    scheduler = engine.scheduler
    queues = {
        "running": [s.seq_id for s in scheduler.running],
        "swapped": [s.seq_id for s in scheduler.swapped],
        "waiting": [s.seq_id for s in scheduler.waiting],
    }
    events = [f"{what} {len(pairs)}" for what, pairs in moved.items() if pairs]
    caption = (
        f"step {step}: "
        + ("; ".join(events) or "no block moves")
        + "".join(f"; {name} {ids}" for name, ids in queues.items() if ids)
    )
    return TierSnapshot(
        step,
        pool,
        frozenset(b.block_id for b in manager.cached.values()),
        swap,
        prefix,
        {k: list(v) for k, v in moved.items()},
        queues,
        caption,
    )


def record_tier_frames(llm, prompts, params, max_steps: int = 200) -> list[TierSnapshot]:
    """Run prompts through llm (swap preemption and a prefix tier on), one snapshot per step."""
    engine = llm.engine
    store = engine.prefix_tier.store
    stored: list[tuple[int, int]] = []

    def recording_store(blocks):
        before = dict(engine.prefix_tier.entries)
        store(blocks)
        stored.extend(
            (block.block_id, engine.prefix_tier.entries[block.block_hash][1])
            for block in blocks
            if block.block_hash in engine.prefix_tier.entries and block.block_hash not in before
        )

    engine.prefix_tier.store = recording_store
    names: dict[bytes, str] = {}
    frames = []
    try:
        for prompt in prompts:
            engine.add_request(engine.make_request(prompt, params))
        while engine.has_unfinished_requests() and len(frames) < max_steps:
            stored.clear()
            engine.step()
            frames.append(tier_snapshot(engine, len(frames) + 1, names, list(stored)))
    finally:
        engine.prefix_tier.store = store
    return frames


def _cell(tier: str, index: int, seq: int | None, text: str, moved: str | None, cached: bool = False) -> str:
    colour = FREE_COLOUR if seq is None and not text else ("#f2e6c9" if seq is None else seq_colour(seq))
    border = "3px solid #000" if moved else ("2px solid #1f77b4" if cached else "1px solid #fff")
    mark = {"swap out": "&#8595;", "swap in": "&#8593;", "load": "&#8593;", "store": "&#8595;"}.get(moved, "")
    attrs = f"class='blk' data-tier='{tier}' data-index='{index}' data-seq='{'' if seq is None else seq}'"
    attrs += f" data-moved='{moved or ''}'"
    return (
        f"<div {attrs} title='{tier} {index}' style='display:inline-block;width:26px;height:26px;margin:1px;"
        f"background:{colour};border:{border};font:10px sans-serif;text-align:center;line-height:26px;"
        f"color:#111'>{mark}{html.escape(text)}</div>"
    )


def tier_snapshot_html(snap: TierSnapshot) -> str:
    """Three rows of cells: the pool (coloured by sequence, outlined if cached), the swap tier (coloured by the
    swapped sequence) and the prefix tier (named by hash); the blocks this step moved are framed in black."""
    pool_moves = {b: m for m in ("swap out", "swap in", "load", "store") for b, _ in snap.moved.get(m, [])}
    swap_moves = {s: m for m in ("swap out", "swap in") for _, s in snap.moved.get(m, [])}
    prefix_moves = {s: m for m in ("load", "store") for _, s in snap.moved.get(m, [])}
    rows = [
        (
            "pool",
            [
                _cell("pool", i, seq, "" if seq is None else str(seq), pool_moves.get(i), i in snap.cached)
                for i, seq in enumerate(snap.pool)
            ],
        ),
        (
            "swap tier",
            [
                _cell("swap", i, seq, "" if seq is None else str(seq), swap_moves.get(i))
                for i, seq in enumerate(snap.swap)
            ],
        ),
        (
            "prefix tier",
            [_cell("prefix", i, None, name or "", prefix_moves.get(i)) for i, name in enumerate(snap.prefix)],
        ),
    ]
    body = "".join(
        f"<div><span style='display:inline-block;width:80px;font:12px sans-serif'>{label}</span>{''.join(cells)}</div>"
        for label, cells in rows
    )
    return (
        f"<div style='font-family:sans-serif'><div style='font-size:12px;margin-bottom:4px'>"
        f"{html.escape(snap.caption)}</div>{body}</div>"
    )


def tier_player(frames: list[TierSnapshot], interval_ms: int = 800, start: int = 0):
    """A player over the frames, opening on frame `start`."""
    return player([tier_snapshot_html(f) for f in frames], interval_ms, start=start, label="step")


def plot_crossover(lengths, series: dict[str, list[float]], title: str, ylabel: str = "seconds"):
    """Swap and recompute cost against context length, log-log, one line per series."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, values in series.items():
        ax.plot(lengths, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context of the preempted sequence (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_ttft_tiers(ttft: dict[str, float], title: str):
    """TTFT of one prompt with its prefix nowhere, in the tier, in the pool."""
    cases = ["nowhere", "tier", "pool"]
    fig, ax = plt.subplots(figsize=(5.2, 2.8))
    ax.barh(cases, [ttft[c] * 1e3 for c in cases], color=["#e15759", "#f28e2b", "#59a14f"])
    ax.set_xlabel("time to first token (ms)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
