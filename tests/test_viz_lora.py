"""The chapter-11 drawings (paged/viz/ch11_multi_lora.py): segments of a mixed batch, its token-index HTML, the slot
replay and its player, the memory rows, the LoRA update plot and the answers table; checked without a browser."""

from html.parser import HTMLParser

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm, player_frames, tiny_llama
from peft import LoraConfig, get_peft_model

from paged import LoRARequest, SamplingParams
from paged.viz import (
    BASE_COLOUR,
    SlotSnapshot,
    adapter_colour,
    batch_outputs_html,
    memory_rows,
    plot_lora_update,
    record_lora_step,
    segments,
    slot_player,
    slot_replay,
    slot_snapshot_html,
    token_indices_html,
)


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
    requests = [
        {"request": "a", "adapter": "pirate", "tokens": ["What", " is"]},
        {"request": "b", "adapter": None, "tokens": ["<x>"]},
        {"request": "c", "adapter": "shout", "tokens": ["Hi"]},
        {"request": "d", "adapter": "shout", "tokens": [" there"]},
    ]
    slots = ["shout", None, "pirate"]
    tags = Tags(token_indices_html(requests, slots))
    tokens = tags.by_class["tok"]
    assert [t["data-index"] for t in tokens] == ["2", "2", "-1", "0", "0"]
    assert [t["data-request"] for t in tokens] == ["a", "a", "b", "c", "d"]
    assert BASE_COLOUR in tokens[2]["style"] and tokens[0]["style"] != tokens[3]["style"]
    assert [(s["data-start"], s["data-end"], s["data-index"]) for s in tags.by_class["seg"]] == [
        ("0", "2", "2"),
        ("2", "3", "-1"),
        ("3", "5", "0"),
    ]  # c and d share a segment: same adapter, side by side
    assert "<x>" in tags.text and "␣is" in tags.text and "5 tokens in this step" in tags.text


@pytest.fixture(scope="module")
def lora_requests(tmp_path_factory):
    """Three PEFT adapters on the tiny Llama (random A and B), as LoRARequests named a, b, c."""
    root, requests = tmp_path_factory.mktemp("adapters"), []
    for lora_id, name in enumerate("abc", start=1):
        peft_model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0, 0.2, generator=torch.Generator().manual_seed(lora_id))
        peft_model.save_pretrained(str(root / name))
        requests.append(LoRARequest(name, lora_id, str(root / name)))
    return dict(zip("abc", requests))


def test_slot_replay_follows_the_engine_least_recently_used_out(lora_requests):
    a, b, c = lora_requests["a"], lora_requests["b"], lora_requests["c"]
    llm = make_tiny_llm(tiny_llama(), enable_lora=True, max_loras=2, max_lora_rank=8)
    frames = slot_replay(llm, [1, 2, 3, 4, 5], [[a], [b], [a], [c], [b, c]])
    assert [f.slots for f in frames] == [(None, None), ("a", None), ("a", "b"), ("a", "b"), ("a", "c"), ("b", "c")]
    assert frames[3].loaded == () and "already in a slot" in frames[3].caption
    assert frames[4].evicted == ("b",) and frames[4].loaded == ("c",)  # b was last used by batch 2, a by batch 3
    assert frames[5].evicted == ("a",) and frames[5].wanted == ("b", "c")
    assert frames[-1].registry == ("a", "b", "c")
    assert llm.lora_stats()["num_loads"] == sum(len(f.loaded) for f in frames) == 4
    assert_pool_empty(llm)


def test_slot_html_marks_resident_wanted_and_loaded_adapters():
    frame = SlotSnapshot(slots=("c", "b"), registry=("a", "b", "c"), wanted=("c",), loaded=("c",), evicted=("a",))
    tags = Tags(slot_snapshot_html(frame))
    assert [s["data-adapter"] for s in tags.by_class["slot"]] == ["c", "b"]
    assert {e["data-adapter"]: e["data-resident"] for e in tags.by_class["registry-entry"]} == {
        "a": "0",
        "b": "1",
        "c": "1",
    }
    assert "c (loaded)" in tags.text and "a evicted" in tags.text
    assert "3px solid" in tags.by_class["slot"][0]["style"] and "3px solid" not in tags.by_class["slot"][1]["style"]


def test_slot_player_holds_every_frame_and_starts_on_the_first():
    frames = [SlotSnapshot((None,), ("a",), (), (), ()), SlotSnapshot(("a",), ("a",), ("a",), ("a",), ())]
    assert player_frames(slot_player(frames)) == [slot_snapshot_html(f) for f in frames]


def test_record_lora_step_lays_each_adapter_side_by_side(lora_requests):
    a, b = lora_requests["a"], lora_requests["b"]
    llm = make_tiny_llm(tiny_llama(), enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for prompt, request in [([5, 6, 7], b), ([8, 9], None), ([10, 11, 12, 13], a), ([14, 15], b)]:
        engine.add_request(engine.make_request(prompt, params, lora_request=request))
    laid_out, slots = record_lora_step(engine)
    assert [row["adapter"] for row in laid_out] == [None, "a", "b", "b"]  # base first, then by adapter id
    assert [row["token_ids"] for row in laid_out] == [[8, 9], [10, 11, 12, 13], [5, 6, 7], [14, 15]]
    assert sorted(s for s in slots if s) == ["a", "b"]
    assert "prepare_step" not in vars(engine.lora)  # the recorder is gone again


def test_memory_rows_set_one_base_plus_adapters_against_merged_copies():
    rows = memory_rows(base_bytes=100 * 2**20, adapter_bytes=2**20, counts=[1, 10])
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
    rows = [
        {"adapter": "json", "prompt": "Name <a> fruit", "text": '{"answer": "A & B"}'},
        {"adapter": None, "prompt": "p", "text": "t"},
    ]
    text = batch_outputs_html(rows, ["json"])
    assert "Name &lt;a&gt; fruit" in text and "{&quot;answer&quot;: &quot;A &amp; B&quot;}" in text
    assert adapter_colour("json", ["json"]) in text and BASE_COLOUR in text
    assert [r["data-adapter"] for r in Tags(text).by_class["answer"]] == ["json", ""]
