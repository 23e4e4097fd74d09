"""The chapter-11 drawings (paged/viz/ch11_multi_lora.py): segments of a mixed batch, its token-index HTML, the slot
replay and its player, the memory rows, the LoRA update plot and the answers table; checked without a browser."""

from html.parser import HTMLParser

import matplotlib.pyplot as plt
import numpy as np
import pytest

from helpers import player_frames
from paged.viz import (BASE_COLOUR, adapter_colour, batch_outputs_html, memory_rows, plot_lora_update, segments,
                       slot_player, slot_replay, slot_snapshot_html, token_indices_html)


class Tags(HTMLParser):
    """The attributes of every tag with a class, grouped by class, and the text of the whole page."""

    def __init__(self, text: str):
        super().__init__()
        self.by_class: dict[str, list[dict]] = {}
        self.text = ""
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "class" in attrs:
            self.by_class.setdefault(attrs["class"], []).append(attrs)

    def handle_data(self, data):
        self.text += data


def test_segments_are_the_runs_of_equal_index():
    assert segments([]) == []
    assert segments([0, 0, -1, 1, 1, 1, 0]) == [(0, 2, 0), (2, 3, -1), (3, 6, 1), (6, 7, 0)]


def test_token_indices_html_gives_every_token_its_slot_index():
    requests = [{"request": "a", "adapter": "pirate", "tokens": ["What", " is"]},
                {"request": "b", "adapter": None, "tokens": ["<x>"]},
                {"request": "c", "adapter": "shout", "tokens": ["Hi"]},
                {"request": "d", "adapter": "shout", "tokens": [" there"]}]
    slots = ["shout", None, "pirate"]
    tags = Tags(token_indices_html(requests, slots))
    tokens = tags.by_class["tok"]
    assert [t["data-index"] for t in tokens] == ["2", "2", "-1", "0", "0"]
    assert [t["data-request"] for t in tokens] == ["a", "a", "b", "c", "d"]
    assert BASE_COLOUR in tokens[2]["style"] and tokens[0]["style"] != tokens[3]["style"]
    assert [(s["data-start"], s["data-end"], s["data-index"]) for s in tags.by_class["seg"]] == [
        ("0", "2", "2"), ("2", "3", "-1"), ("3", "5", "0")]   # c and d share a segment: same adapter, side by side
    assert "<x>" in tags.text and "␣is" in tags.text and "5 tokens in this step" in tags.text


def test_slot_replay_loads_into_empty_slots_then_evicts_the_least_recently_used():
    frames = slot_replay(2, ["a", "b", "c"], [["a"], ["b"], ["a"], ["c"], ["b"]])
    assert [f.slots for f in frames] == [(None, None), ("a", None), ("a", "b"), ("a", "b"), ("a", "c"),
                                        ("b", "c")]
    assert frames[3].loaded == () and "already in a slot" in frames[3].caption
    assert frames[4].evicted == ("b",) and frames[4].loaded == ("c",)   # b was last used at step 2, a at step 3
    assert frames[5].evicted == ("a",)                                   # now a (step 3) is older than c (step 4)


def test_slot_replay_keeps_the_adapters_a_step_needs():
    frames = slot_replay(2, ["a", "b", "c"], [["a"], ["b"], ["a", "c"]])
    # b is the most recently used, but a is wanted again: c must take b's slot, never a's
    assert frames[-1].slots == ("a", "c") and frames[-1].evicted == ("b",)
    for before, after in zip(frames, frames[1:]):
        assert set(after.wanted) <= set(after.slots)
        assert len({s for s in after.slots if s}) == len([s for s in after.slots if s])   # never twice resident


def test_slot_replay_refuses_more_adapters_than_slots_or_unknown_ones():
    with pytest.raises(ValueError, match="max_loras is 1"):
        slot_replay(1, ["a", "b"], [["a", "b"]])
    with pytest.raises(ValueError, match="registry does not hold"):
        slot_replay(2, ["a"], [["z"]])


def test_slot_html_marks_resident_wanted_and_loaded_adapters():
    frame = slot_replay(2, ["a", "b", "c"], [["a"], ["b"], ["c"]])[-1]
    tags = Tags(slot_snapshot_html(frame))
    assert [s["data-adapter"] for s in tags.by_class["slot"]] == ["c", "b"]
    assert {e["data-adapter"]: e["data-resident"] for e in tags.by_class["registry-entry"]} == {
        "a": "0", "b": "1", "c": "1"}
    assert "c (loaded)" in tags.text and "a evicted" in tags.text
    assert "3px solid" in tags.by_class["slot"][0]["style"] and "3px solid" not in tags.by_class["slot"][1]["style"]


def test_slot_player_holds_every_frame_and_starts_on_the_first():
    frames = slot_replay(1, ["a", "b"], [["a"], ["b"]])
    assert player_frames(slot_player(frames)) == [slot_snapshot_html(f) for f in frames]


def test_memory_rows_set_one_base_plus_adapters_against_merged_copies():
    rows = memory_rows(base_bytes=100 * 2 ** 20, adapter_bytes=2 ** 20, counts=[1, 10])
    assert rows[0]["one base + N adapters (MiB)"] == 101 and rows[0]["N merged models (MiB)"] == 100
    assert rows[1]["one base + N adapters (MiB)"] == 110 and rows[1]["N merged models (MiB)"] == 1000
    assert rows[1]["ratio"] == pytest.approx(1000 / 110)


def test_plot_lora_update_draws_the_product_of_b_and_a():
    rng = np.random.default_rng(0)
    weight, a, b = rng.normal(size=(12, 10)), rng.normal(size=(3, 10)), rng.normal(size=(12, 3))
    fig = plot_lora_update(weight, a, b, scaling=2.0, crop=8)
    images = [ax.get_images()[0].get_array() for ax in fig.axes]
    np.testing.assert_allclose(images[3], (2.0 * b @ a)[:8, :8])
    assert [ax.get_title().splitlines()[1] for ax in fig.axes] == ["12 × 10", "12 × 3", "3 × 10", "12 × 10"]
    plt.close(fig)


def test_batch_outputs_html_escapes_and_colours_by_adapter():
    rows = [{"adapter": "json", "prompt": "Name <a> fruit", "text": '{"answer": "A & B"}'},
            {"adapter": None, "prompt": "p", "text": "t"}]
    text = batch_outputs_html(rows, ["json"])
    assert "Name &lt;a&gt; fruit" in text and "{&quot;answer&quot;: &quot;A &amp; B&quot;}" in text
    assert adapter_colour("json", ["json"]) in text and BASE_COLOUR in text
    assert [r["data-adapter"] for r in Tags(text).by_class["answer"]] == ["json", ""]
