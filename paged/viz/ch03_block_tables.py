"""Chapter 03's pictures (guide §5-§6): a block manager's tables, ref counts and free queue as a plain snapshot, replays
of block-manager calls, and their drawing as block tables over the physical pool. Chapters 05 and 06 draw on them."""

import html
from dataclasses import dataclass

import ipywidgets as widgets

from paged.core.block_manager import BlockManager
from paged.viz.common import PALETTE, player

FREE_COLOUR = "#d9d9d9"


def seq_colour(seq_id: int) -> str:
    """One colour per sequence, the same in its block table and in the pool."""
    return PALETTE[seq_id % len(PALETTE)]


@dataclass(frozen=True)
class PoolSnapshot:
    """What a BlockManager holds at one moment, as plain data: enough to draw it, and to test the drawing."""

    block_size: int
    tables: dict[int, list[int]]  # seq_id -> physical block ids, in logical order
    ref_counts: list[int]  # block_id -> number of tables that hold it
    free_queue: list[int]  # free block ids, in the order they will be handed out
    num_tokens: dict[int, int]  # seq_id -> tokens it holds (they fill its blocks' slots in order)
    labels: dict[int, str]  # seq_id -> the name drawn for it
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


def snapshot(
    manager: BlockManager,
    num_tokens: dict[int, int] | None = None,
    labels: dict[int, str] | None = None,
    caption: str = "",
) -> PoolSnapshot:
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
        caption=caption,
    )


def engine_snapshot(engine, caption: str = "") -> PoolSnapshot:
    """The live block tables of an LLMEngine, each labelled with its request and filled to its computed tokens."""
    running = {seq.seq_id: seq for seq in engine.scheduler.running}
    return snapshot(
        engine.block_manager,
        num_tokens={i: seq.num_computed_tokens for i, seq in running.items()},
        labels={i: f"request {seq.request.request_id}" for i, seq in running.items()},
        caption=caption,
    )


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
            returned = (
                f"block {freed[0]} returns"
                if len(freed) == 1
                else f"blocks {', '.join(map(str, freed))} return"
                if freed
                else "no block returns"
            )
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
        events += [
            ("allocate", seq_id, prompt_len + step - arrival)
            for seq_id, (arrival, prompt_len, new) in enumerate(requests)
            if arrival <= step < arrival + new
        ]
    return events


# What every drawn block shares, written once per drawing; a block's own style holds only its colour and border.
BLOCK_CSS = (
    "<style>.blk{display:inline-block;width:38px;height:34px;margin:2px;border-radius:4px;text-align:center;"
    "font:12px/16px monospace;color:#111;vertical-align:top;box-sizing:border-box;padding-top:1px}</style>"
)


def block_cell(block_id: int, colour: str, filled: int, block_size: int, ref_count: int, attrs: str) -> str:
    """One block: its id, its slots filled left to right (a lighter tint for empty ones), its ref count if shared."""
    share = round(100 * filled / block_size)
    background = f"linear-gradient(to right, {colour} {share}%, {colour}55 {share}%)"
    border = "2px dashed #111" if ref_count > 1 else "1px solid #888"
    badge = f"<br><b>&times;{ref_count}</b>" if ref_count > 1 else "<br>&nbsp;"
    title = f"block {block_id}: {filled}/{block_size} slots, ref count {ref_count}"
    return (
        f'<div class="blk" {attrs} data-block="{block_id}" data-ref="{ref_count}" title="{title}" '
        f'style="background:{background};border:{border}">{block_id}{badge}</div>'
    )


def block_tables_html(snap: PoolSnapshot) -> str:
    """One row per sequence: its name, token count, and the physical block behind each logical block."""
    if not snap.tables:
        return '<div class="tables"><i>no block tables: nothing is running</i></div>'
    rows = []
    for seq_id, table in snap.tables.items():
        cells = "".join(
            block_cell(
                block,
                seq_colour(snap.owner(block)),
                snap.tokens_in(seq_id, logical),
                snap.block_size,
                snap.ref_counts[block],
                f'data-seq="{seq_id}" data-logical="{logical}"',
            )
            for logical, block in enumerate(table)
        )
        name = html.escape(snap.labels[seq_id])
        rows.append(
            f'<div class="table-row" data-seq="{seq_id}" style="white-space:nowrap">'
            f'<span style="display:inline-block;width:170px;font:12px monospace;color:{seq_colour(seq_id)}">'
            f"<b>{name}</b> ({snap.num_tokens[seq_id]} tok)</span>{cells}</div>"
        )
    return (
        f'<div class="tables">{BLOCK_CSS}<b>block tables</b> (logical block 0, 1, 2, ... &rarr; physical block)'
        + "".join(rows)
        + "</div>"
    )


def physical_pool_html(snap: PoolSnapshot) -> str:
    """Every physical block in id order: coloured by the sequence that holds it, grey when free, with the
    free queue's order (the next blocks handed out) written below."""
    cells = []
    for block_id, ref_count in enumerate(snap.ref_counts):
        owner = snap.owner(block_id)
        if owner is None:
            cells.append(block_cell(block_id, FREE_COLOUR, 0, snap.block_size, 0, 'data-free="1"'))
        else:
            logical = snap.tables[owner].index(block_id)
            cells.append(
                block_cell(
                    block_id,
                    seq_colour(owner),
                    snap.tokens_in(owner, logical),
                    snap.block_size,
                    ref_count,
                    f'data-seq="{owner}"',
                )
            )
    queue = " &rarr; ".join(map(str, snap.free_queue)) or "empty"
    used = snap.num_blocks - len(snap.free_queue)
    return (
        f'<div class="pool">{BLOCK_CSS}<b>physical pool</b> ({used} of {snap.num_blocks} blocks used)'
        f'<div style="max-width:640px">{"".join(cells)}</div>'
        f'<div class="free-queue" style="font:12px monospace">free queue: {queue}</div></div>'
    )


def snapshot_html(snap: PoolSnapshot) -> str:
    """The caption, every block table, then the physical pool."""
    caption = f'<div class="caption" style="font:13px sans-serif;margin:4px 0">{html.escape(snap.caption)}</div>'
    return f'<div class="pool-snapshot">{caption}{block_tables_html(snap)}{physical_pool_html(snap)}</div>'


def pool_player(frames: list[PoolSnapshot], interval_ms: int = 700) -> widgets.VBox:
    """Step through snapshots: the tables and the pool of each."""
    return player([snapshot_html(frame) for frame in frames], interval_ms)
