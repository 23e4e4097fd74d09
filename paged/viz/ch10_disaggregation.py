"""Chapter 10's disaggregation pictures (guide §15): the prefill-to-decode handoff drawn block by block, and the
gaps between a running request's tokens, colocated against disaggregated.

A handoff is replayed on two BlockManagers, one per worker, as paged/disagg.py drives them: the prefill worker's
table holds the prompt's blocks; the decode worker allocates as many blocks of its own (other ids: its pool is
another pool) and its KV connector fills them with the blocks received, and the prefill worker's blocks go back to
its free queue. (The decode worker receives the blocks into a staging buffer first, and fills its own when its
scheduler admits the request; the frames draw both as one move per block.)
"""

import html
from dataclasses import dataclass

import matplotlib.pyplot as plt

from paged.core.block_manager import BlockManager
from paged.geometry import cdiv
from paged.viz.common import PALETTE, player

OTHER_COLOUR = "#bbbbbb"  # blocks other sequences hold
FREE_COLOUR = "#f4f4f4"
_CELL = (
    "display:inline-block;width:40px;height:34px;margin:2px;border-radius:4px;text-align:center;"
    "font:11px/16px monospace;color:#111;border:1px solid #888;vertical-align:top"
)


@dataclass(frozen=True)
class HandoffFrame:
    prefill_pool: tuple[str | None, ...]  # per physical block: "req:i" (logical block i), "other", or None (free)
    decode_pool: tuple[str | None, ...]
    in_flight: int | None  # the logical block on the wire in this frame
    caption: str


def handoff_replay(
    prompt_len: int,
    block_size: int,
    num_blocks: int,
    block_bytes: int,
    prefill_others: list[int] = (),
    decode_others: list[int] = (),
) -> list[HandoffFrame]:
    """Frames of one request's handoff: prefilled, then one block received per frame, then the prefill worker
    lets its copy go and the decode worker appends the first token. prefill_others / decode_others: token counts
    of the other sequences each worker holds (so the two pools' block ids differ, as they do)."""
    prefill, decode = BlockManager(num_blocks, block_size), BlockManager(num_blocks, block_size)
    for seq_id, tokens in enumerate(prefill_others, start=1):
        prefill.allocate(seq_id, tokens)
    for seq_id, tokens in enumerate(decode_others, start=1):
        decode.allocate(seq_id, tokens)
    source = prefill.allocate(0, prompt_len)
    num_moved = cdiv(prompt_len, block_size)

    def pool(manager: BlockManager, received: int) -> tuple:
        """The pool's blocks: the request's logical blocks received so far, its reserved ones, the others'."""
        cells = [None] * num_blocks
        for seq_id, table in manager.block_tables.items():
            for logical, block_id in enumerate(table):
                cells[block_id] = "other" if seq_id else (f"req:{logical}" if logical < received else "reserved")
        return tuple(cells)

    frames = [
        HandoffFrame(
            pool(prefill, num_moved),
            pool(decode, 0),
            None,
            f"prefill worker: the {prompt_len}-token prompt fills blocks {list(source)}; the first "
            f"token is sampled. The decode worker has not heard of it yet.",
        )
    ]
    target = decode.allocate(0, prompt_len)
    for logical in range(num_moved):
        frames.append(
            HandoffFrame(
                pool(prefill, num_moved),
                pool(decode, logical + 1),
                logical,
                f"block {logical} of {num_moved}: prefill block {source[logical]} -> decode block {target[logical]} "
                f"({block_bytes:,} B: every layer's K and V for {block_size} slots)",
            )
        )
    prefill.free(0)
    decode.allocate(0, prompt_len + 1)  # the first token's slot, for the first decode step
    frames.append(
        HandoffFrame(
            pool(prefill, 0),
            pool(decode, len(decode.block_tables[0])),
            None,
            f"done: {num_moved} blocks, {num_moved * block_bytes:,} B moved. The prefill worker's blocks are free for "
            f"the next prompt; the decode worker's table {decode.block_tables[0]} runs from the first token.",
        )
    )
    return frames


def _cell(block_id: int, state: str | None, in_flight: bool) -> str:
    if state is None:
        colour, label = FREE_COLOUR, ""
    elif state == "other":
        colour, label = OTHER_COLOUR, "other"
    elif state == "reserved":
        colour, label = "#ffffff", "..."
    else:
        logical = int(state.split(":")[1])
        colour, label = PALETTE[logical % len(PALETTE)], f"L{logical}"
    outline = "outline:3px solid #d62728;" if in_flight else ""
    return (
        f'<div class="block" data-block="{block_id}" data-state="{state or "free"}" style="{_CELL};'
        f'background:{colour};{outline}">{block_id}<br>{label}</div>'
    )


def handoff_frame_html(frame: HandoffFrame) -> str:
    rows = []
    for name, cells in (("prefill worker", frame.prefill_pool), ("decode worker", frame.decode_pool)):
        flying = {i for i, s in enumerate(cells) if frame.in_flight is not None and s == f"req:{frame.in_flight}"}
        blocks = "".join(_cell(i, s, i in flying) for i, s in enumerate(cells))
        rows.append(
            f'<div class="pool" data-worker="{name}" style="white-space:nowrap"><span style="display:'
            f'inline-block;width:120px;font:12px monospace">{name}</span>{blocks}</div>'
        )
    return (
        f'<div class="handoff">{"".join(rows)}<div class="caption" style="font:12px sans-serif;margin-top:4px">'
        f"{html.escape(frame.caption)}</div></div>"
    )


def handoff_player(frames: list[HandoffFrame], interval_ms: int = 900):
    return player([handoff_frame_html(f) for f in frames], interval_ms=interval_ms, label="step")


def plot_decode_gaps(gaps_by_name: dict[str, list[float]], ax=None):
    """Each running request's gaps between tokens, in order, one line per configuration (milliseconds)."""
    ax = ax or plt.subplots(figsize=(8, 3))[1]
    for name, gaps in gaps_by_name.items():
        ax.plot([g * 1e3 for g in gaps], marker=".", linewidth=1, label=name)
    ax.set_xlabel("gap index (a short request's consecutive tokens)")
    ax.set_ylabel("gap (ms)")
    ax.set_yscale("log")
    ax.legend()
    return ax
