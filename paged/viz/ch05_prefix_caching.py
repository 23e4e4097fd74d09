"""Chapter 05's pictures (guide §9): chained block hashes by name, snapshots and replays of a prefix-caching pool,
the eviction order, what each step prefilled, and time to first token."""

import html
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

from paged.core.block_manager import BlockManager
from paged.viz.ch03_block_tables import (
    BLOCK_CSS,
    FREE_COLOUR,
    PoolSnapshot,
    block_cell,
    block_tables_html,
    engine_snapshot,
    seq_colour,
    snapshot,
)
from paged.viz.common import PALETTE, player

IDLE_CACHED_COLOUR = "#c6dbef"  # a block no table holds that keeps its tokens and its hash
CACHED_OUTLINE = "#08519c"  # drawn around every block the prefix cache holds
_HASH_STYLE = (
    "display:inline-block;min-width:34px;height:22px;margin:2px;padding:0 3px;border-radius:4px;"
    "text-align:center;font:12px/22px monospace;color:#111;border:1px solid #888;"
)


def hash_names(chains: dict[str, list[bytes]]) -> dict[str, list[str]]:
    """Name each distinct block hash #1, #2, ... in order of first appearance, so that equal hashes read equal
    (a SHA-256 digest is 32 bytes: too long to read in a cell)."""
    names: dict[bytes, str] = {}
    return {label: [names.setdefault(h, f"#{len(names) + 1}") for h in chain] for label, chain in chains.items()}


def hash_chain_html(chains: dict[str, list[bytes]], block_texts: dict[str, list[str]] | None = None) -> str:
    """One row per prompt, one cell per full block, named and coloured by its hash: a shared prefix is a run of
    equal cells from the left. block_texts, the decoded tokens of each block, become the cells' tooltips."""
    block_texts = block_texts or {}
    rows = []
    for label, names in hash_names(chains).items():
        texts = block_texts.get(label, [""] * len(names))
        cells = "".join(
            f'<div class="hash" data-hash="{name}" title="{html.escape(text)}" style="{_HASH_STYLE}'
            f'background:{PALETTE[(int(name[1:]) - 1) % len(PALETTE)]}">{name}</div>'
            for name, text in zip(names, texts)
        )
        rows.append(
            f'<div class="hash-row" style="white-space:nowrap"><span style="display:inline-block;'
            f'width:220px;font:12px monospace">{html.escape(label)}</span>{cells}</div>'
        )
    return (
        '<div class="hash-chains"><b>block hashes</b> (block 0, 1, 2, ... of each prompt; equal name = equal '
        "hash)" + "".join(rows) + "</div>"
    )


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


def cache_snapshot(
    manager: BlockManager,
    num_tokens: dict[int, int] | None = None,
    labels: dict[int, str] | None = None,
    caption: str = "",
) -> CacheSnapshot:
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
            new = manager.allocate(seq_id, len(token_ids), hits)[len(hits) :]
            manager.cache_full_blocks(seq_id, token_ids, len(token_ids))
            num_tokens[seq_id] = len(token_ids)
            evicted = [block_id for block_id in new if block_id in was_cached]
            caption = (
                f"seq {seq_id} ({len(token_ids)} tokens): {len(hits) * manager.block_size} from the cache "
                f"{[block.block_id for block in hits]}, new blocks {new}" + (f", evicting {evicted}" if evicted else "")
            )
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
            cell = block_cell(block_id, seq_colour(owner), filled, pool.block_size, ref_count, f'data-seq="{owner}"')
        elif block_id in snap.cached:
            cell = block_cell(block_id, IDLE_CACHED_COLOUR, pool.block_size, pool.block_size, 0, 'data-free="1"')
        else:
            cell = block_cell(block_id, FREE_COLOUR, 0, pool.block_size, 0, 'data-free="1"')
        if block_id in snap.cached:
            cell = (
                f'<span class="cached" data-block="{block_id}" style="display:inline-block;vertical-align:top;'
                f'border-radius:6px;outline:2px solid {CACHED_OUTLINE};outline-offset:-1px">{cell}</span>'
            )
        cells.append(cell)
    queue = " &rarr; ".join(f"{b}*" if b in snap.cached else str(b) for b in pool.free_queue) or "empty"
    evicted = snap.next_evicted
    held = sum(1 for b in snap.cached if pool.ref_counts[b] > 0)
    legend = (
        f'<span style="outline:2px solid {CACHED_OUTLINE}">&nbsp;outlined&nbsp;</span> in the prefix cache, '
        f'<span style="background:{IDLE_CACHED_COLOUR}">&nbsp;pale blue&nbsp;</span> cached and idle (ref count '
        f'0, tokens kept), <span style="background:{FREE_COLOUR}">&nbsp;grey&nbsp;</span> empty'
    )
    return (
        f'<div class="pool">{BLOCK_CSS}<b>physical pool</b> ({pool.num_blocks - len(pool.free_queue)} of {pool.num_blocks} '
        f"blocks held; {len(snap.cached)} cached: {held} held, {len(snap.cached) - held} idle)"
        f'<div style="font:11px sans-serif;margin:2px 0">{legend}</div>'
        f'<div style="max-width:680px">{"".join(cells)}</div>'
        f'<div class="free-queue" style="font:12px monospace">free queue (head first, * cached): {queue}</div>'
        f'<div class="next-evicted" style="font:12px monospace">next eviction: '
        f"{'none' if evicted is None else f'block {evicted}'}</div></div>"
    )


def cache_snapshot_html(snap: CacheSnapshot) -> str:
    """The caption, every block table (shared blocks carry their ref count), then the pool with the cache marked."""
    caption = f'<div class="caption" style="font:13px sans-serif;margin:4px 0">{html.escape(snap.pool.caption)}</div>'
    return f'<div class="cache-snapshot">{caption}{block_tables_html(snap.pool)}{cache_pool_html(snap)}</div>'


def cache_player(frames: list[CacheSnapshot], interval_ms: int = 900) -> widgets.VBox:
    """pool_player for CacheSnapshots."""
    return player([cache_snapshot_html(frame) for frame in frames], interval_ms)


def scheduled_prefills(engine) -> list[dict]:
    """The prompts the engine's last step worked on: per request its prompt length, the tokens whose K/V were in the
    pool before the step (for a prompt's first chunk: its prefix-cache hit) and the tokens the step computed.
    Read it right after engine.step()."""
    rows = []
    for seq, num_new in engine.last_schedule.scheduled:
        start = seq.num_computed_tokens - num_new
        if start < seq.num_prompt_tokens:  # a decode starts at or past the prompt's end
            rows.append(
                {
                    "request": seq.request.request_id,
                    "prompt_tokens": seq.num_prompt_tokens,
                    "cached_tokens": start,
                    "computed_tokens": num_new,
                }
            )
    return rows


def plot_ttft(ttfts: dict[str, list[float]], title: str = ""):
    """Time to first token per case: a bar at the median, a dot per measurement, on a linear axis from zero.

    Linear from zero, so that the bars' heights compare as the times do (a log axis would shrink the gap and start
    the bars at an arbitrary floor).
    """
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for x, (label, values) in enumerate(ttfts.items()):
        ax.bar(x, np.median(values), color=PALETTE[x % len(PALETTE)], alpha=0.7)
        ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        ax.annotate(f"{np.median(values):.2f} s", (x, np.median(values)), ha="center", va="bottom")
    ax.set_xticks(range(len(ttfts)), list(ttfts))
    ax.set(ylabel="time to first token (s), linear from 0", title=title or "TTFT")
    ax.set_ylim(bottom=0, top=1.15 * max(max(values) for values in ttfts.values()))  # room for the labels
    fig.tight_layout()
    return fig
