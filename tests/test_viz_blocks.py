"""The chapter-03 drawings (paged/viz/ch03_block_tables.py): snapshots, replays and their HTML,
checked through the data-* attributes every drawn block carries, without a browser."""

from html.parser import HTMLParser

import pytest
from helpers import player_frames

from paged.core.block_manager import BlockManager
from paged.viz import (
    FREE_COLOUR,
    block_tables_html,
    decode_script,
    physical_pool_html,
    pool_player,
    replay,
    seq_colour,
    snapshot,
    snapshot_html,
)


class Blocks(HTMLParser):
    """Collects the attributes of every drawn block, split into table rows and the pool."""

    def __init__(self, text: str):
        super().__init__()
        self.rows: dict[int, list[dict]] = {}  # seq_id -> its table's cells, in order
        self.pool: list[dict] = []
        self._in_pool = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("class") == "pool":
            self._in_pool = True
        elif attrs.get("class") == "blk":
            if self._in_pool:
                self.pool.append(attrs)
            else:
                self.rows.setdefault(int(attrs["data-seq"]), []).append(attrs)


def table_ids(parsed: Blocks) -> dict[int, list[int]]:
    return {seq_id: [int(cell["data-block"]) for cell in cells] for seq_id, cells in parsed.rows.items()}


def test_tables_show_each_sequences_blocks_in_logical_order():
    manager = BlockManager(num_blocks=10, block_size=4)
    manager.allocate(0, 5)  # blocks 0, 1
    manager.allocate(1, 4)  # block 2
    manager.allocate(0, 9)  # block 3: seq 0 is now scattered
    parsed = Blocks(snapshot_html(snapshot(manager, num_tokens={0: 9, 1: 4})))
    assert table_ids(parsed) == {0: [0, 1, 3], 1: [2]} == manager.block_tables
    assert [cell["data-logical"] for cell in parsed.rows[0]] == ["0", "1", "2"]
    assert "seq 0</b> (9 tok)" in block_tables_html(snapshot(manager, num_tokens={0: 9, 1: 4}))


def test_pool_marks_free_blocks_grey_and_used_blocks_in_their_sequences_colour():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate(0, 8)
    manager.allocate(1, 1)
    pool = Blocks(physical_pool_html(snapshot(manager))).pool
    assert [int(cell["data-block"]) for cell in pool] == list(range(6))
    assert [cell["data-block"] for cell in pool if "data-free" in cell] == ["3", "4", "5"]
    for cell in pool:
        colour = FREE_COLOUR if "data-free" in cell else seq_colour(int(cell["data-seq"]))
        assert colour in cell["style"]


def test_free_queue_order_is_shown_as_blocks_will_be_reused():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate(0, 8)
    manager.free(0)  # last block first, to the back of the queue
    assert snapshot(manager).free_queue == [2, 3, 1, 0]
    assert "free queue: 2 &rarr; 3 &rarr; 1 &rarr; 0" in physical_pool_html(snapshot(manager))


def test_ref_counts_appear_on_shared_blocks():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate(0, 8)
    manager.fork(0, 1)
    manager.allocate(1, 9)
    snap = snapshot(manager)
    assert snap.ref_counts == [2, 2, 1, 0, 0, 0]
    parsed = Blocks(snapshot_html(snap))
    assert [cell["data-ref"] for cell in parsed.rows[1]] == ["2", "2", "1"]
    assert snapshot_html(snap).count("&times;2") == 2 + 2 + 2  # two shared blocks, in both tables and the pool
    assert seq_colour(0) in parsed.rows[1][0]["style"]  # a shared block keeps its first owner's colour


def test_partly_filled_block_shows_its_fill():
    manager = BlockManager(num_blocks=4, block_size=8)
    manager.allocate(0, 10)
    snap = snapshot(manager, num_tokens={0: 10})
    assert [snap.tokens_in(0, logical) for logical in range(2)] == [8, 2]
    assert "2/8 slots" in Blocks(block_tables_html(snap)).rows[0][1]["title"]


def test_replay_matches_a_block_manager_run_by_hand():
    events = [("allocate", 0, 5), ("allocate", 1, 3), ("fork", 1, 2), ("allocate", 0, 9), ("free", 1)]
    frames = replay(8, 4, events)
    manager = BlockManager(8, 4)
    assert len(frames) == len(events) + 1 and frames[0].tables == {}
    for (kind, *args), frame in zip(events, frames[1:]):
        getattr(manager, kind)(*args)
        assert frame.tables == manager.block_tables
        assert frame.ref_counts == [manager.ref_count(b) for b in range(8)]
    assert frames[-1].num_tokens == {0: 9, 2: 3}
    assert frames[-1].caption == "seq 1 finishes: no block returns to the free queue"  # seq 2 still holds it
    assert frames[4].caption == "seq 0 holds 9 tokens: new block 3"
    with pytest.raises(ValueError, match="unknown event kind"):
        replay(8, 4, [("grow", 0, 1)])


def test_decode_script_grows_one_token_per_step_and_frees_every_block():
    requests = [(0, 5, 3), (1, 2, 4)]
    events = decode_script(requests)
    assert events == [
        ("allocate", 0, 5),
        ("allocate", 0, 6),
        ("allocate", 1, 2),
        ("allocate", 0, 7),
        ("allocate", 1, 3),
        ("free", 0),
        ("allocate", 1, 4),
        ("allocate", 1, 5),
        ("free", 1),
    ]
    last = replay(4, 4, events)[-1]
    assert last.tables == {} and sorted(last.free_queue) == [0, 1, 2, 3]


def test_player_holds_every_frame():
    frames = replay(4, 4, [("allocate", 0, 4), ("allocate", 1, 4)])
    player = pool_player(frames)
    assert player_frames(player) == [snapshot_html(frame) for frame in frames]
    assert player.children[1].selected_index == 0
