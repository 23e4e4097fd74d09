"""The chapter-05 drawings (paged/viz/ch05_prefix_caching.py): hash names, replays of a prefix-caching pool and their
HTML, the prefill counts read from an engine step; checked without a browser."""

from html.parser import HTMLParser

import matplotlib.pyplot as plt
import pytest
from helpers import make_tiny_llm, player_frames

from paged import SamplingParams
from paged.core.block_manager import BlockManager
from paged.viz import (
    IDLE_CACHED_COLOUR,
    cache_player,
    cache_pool_html,
    cache_snapshot,
    cache_snapshot_html,
    engine_cache_snapshot,
    hash_chain_html,
    hash_names,
    plot_ttft,
    prefix_replay,
    scheduled_prefills,
    seq_colour,
)


class Cells(HTMLParser):
    """The attributes of every tag with a class, grouped by class."""

    def __init__(self, text: str):
        super().__init__()
        self.by_class: dict[str, list[dict]] = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "class" in attrs:
            self.by_class.setdefault(attrs["class"], []).append(attrs)


def test_hash_names_are_equal_exactly_where_hashes_are():
    names = hash_names({"a": [10, 11, 12], "b": [10, 11, 99], "c": [7]})
    assert names == {"a": ["#1", "#2", "#3"], "b": ["#1", "#2", "#4"], "c": ["#5"]}


def test_hash_chain_html_draws_one_named_cell_per_block_with_its_text():
    text = hash_chain_html({"first": [5, 6], "second": [5, 8]}, {"first": ["<a>", "b"], "second": ["<a>", "c"]})
    cells = Cells(text).by_class["hash"]
    assert [c["data-hash"] for c in cells] == ["#1", "#2", "#1", "#3"]
    assert cells[0]["title"] == "<a>"  # escaped in the source, parsed back
    assert cells[0]["style"] == cells[2]["style"] != cells[1]["style"]  # equal hash, equal colour


def eviction_script(block_size: int = 4) -> list[tuple]:
    a, b, c = list(range(1, 13)), list(range(101, 113)), list(range(201, 209))
    return [
        ("prefill", 0, a),
        ("prefill", 1, b),
        ("prefill", 2, c),
        ("free", 0),
        ("free", 1),
        ("free", 2),
        ("prefill", 3, a[:8] + [55, 56, 57, 58]),  # shares a's first two blocks
        ("prefill", 4, list(range(301, 317))),
    ]  # needs four fresh blocks


def test_replay_evicts_from_the_head_of_the_free_queue_and_never_a_held_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    frames = prefix_replay(manager, eviction_script())
    assert len(frames) == 9
    assert frames[6].pool.free_queue == [2, 1, 0, 5, 4, 3, 7, 6]  # each sequence's last block first
    assert frames[6].cached == frozenset(range(8)) and frames[6].next_evicted == 2
    assert frames[7].pool.tables[3] == [0, 1, 2]  # two hits, then the evicted head of the queue
    assert "8 from the cache [0, 1], new blocks [2], evicting [2]" in frames[7].pool.caption
    assert frames[8].pool.tables[4] == [5, 4, 3, 7]
    for before, after in zip(frames, frames[1:]):
        held = {b for table in before.pool.tables.values() for b in table}
        lost = before.cached - after.cached
        assert not lost & held  # a block some table holds keeps its place in the cache
    assert manager.can_allocate(20).name == "LATER"  # only 1 block is free: the held ones are not for taking


def test_replay_rejects_unknown_events():
    with pytest.raises(ValueError, match="unknown event kind"):
        prefix_replay(BlockManager(4, 4, enable_prefix_caching=True), [("fork", 0, 1)])


def test_pool_html_marks_cached_blocks_and_the_next_eviction():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    frames = prefix_replay(manager, [("prefill", 0, list(range(10))), ("free", 0), ("prefill", 1, list(range(5)))])
    snap = frames[-1]  # seq 1 holds block 0 (a hit) and a fresh block; block 1 is cached and idle
    assert snap.pool.tables == {1: [0, 3]} and snap.cached == {0, 1}
    parsed = Cells(cache_pool_html(snap)).by_class
    assert sorted(int(c["data-block"]) for c in parsed["cached"]) == [0, 1]
    blocks = {int(c["data-block"]): c for c in parsed["blk"]}
    assert IDLE_CACHED_COLOUR in blocks[1]["style"] and seq_colour(1) in blocks[0]["style"]
    text = cache_pool_html(snap)
    assert "free queue (head first, * cached): 4 &rarr; 5 &rarr; 2 &rarr; 1*" in text
    assert "next eviction: block 1" in text and "2 cached: 1 held, 1 idle" in text
    assert "next eviction: none" in cache_pool_html(cache_snapshot(BlockManager(2, 4, enable_prefix_caching=True)))


def test_snapshot_html_shows_ref_counts_of_shared_prefix_blocks():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    frames = prefix_replay(manager, [("prefill", 0, prompt), ("prefill", 1, prompt), ("prefill", 2, prompt[:6])])
    assert frames[-1].pool.ref_counts[:2] == [3, 2]
    text = cache_snapshot_html(frames[-1])
    assert frames[-1].pool.caption in text
    rows = [c for c in Cells(text).by_class["blk"] if "data-logical" in c]
    assert [c["data-ref"] for c in rows if c["data-logical"] == "0"] == ["3", "3", "3"]


def test_scheduled_prefills_and_engine_snapshot_follow_a_real_engine(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=32, enable_prefix_caching=True)
    engine, prompt = llm.engine, list(range(1, 30))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.make_request(prompt, params))
    engine.step()
    assert scheduled_prefills(engine) == [
        {"request": "0", "prompt_tokens": 29, "cached_tokens": 0, "computed_tokens": 29}
    ]
    engine.add_request(engine.make_request(prompt[:20] + [7, 7, 7], params))
    engine.step()  # a decode for request 0 and the second prompt after two cached blocks of 8
    assert scheduled_prefills(engine) == [
        {"request": "1", "prompt_tokens": 23, "cached_tokens": 16, "computed_tokens": 7}
    ]
    snap = engine_cache_snapshot(engine)
    assert snap.cached == {block.block_id for block in engine.block_manager.cached.values()}
    first, second = snap.pool.tables.values()
    assert first[:2] == second[:2] and [snap.pool.ref_counts[b] for b in first[:2]] == [2, 2]


def test_player_holds_every_frame():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    frames = prefix_replay(manager, [("prefill", 0, list(range(6))), ("free", 0)])
    assert player_frames(cache_player(frames)) == [cache_snapshot_html(frame) for frame in frames]


def test_plot_ttft_draws_one_bar_per_case():
    fig = plot_ttft({"cold": [4.0], "hit": [0.2, 0.3]})
    ax = fig.axes[0]
    assert len(ax.patches) == 2 and ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    plt.close(fig)
