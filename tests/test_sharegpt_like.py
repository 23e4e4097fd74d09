"""benchmarks/sharegpt_like.py writes a ShareGPT-format file (not ShareGPT) whose prompts and replies are, counted by
SmolLM2's tokenizer as vLLM's sharegpt loader counts them, the ShareGPT-like lengths serve_bench.py draws."""

import importlib
import json
from pathlib import Path

import pytest

from paged.analysis.load_client import make_requests


@pytest.fixture
def sharegpt_like(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("sharegpt_like")


def test_every_text_is_as_many_tokens_of_whole_words_as_drawn(sharegpt_like, smollm2):
    _, tokenizer = smollm2
    lengths = sharegpt_like.drawn_lengths(40, 3, 512, 128)
    assert lengths == [(len(r.prompt), r.max_tokens) for r in make_requests(40, "sharegpt", 3, 512, 128)]
    data = sharegpt_like.conversations(tokenizer, lengths, 3)
    sharegpt_like.check_lengths(tokenizer, data, lengths)  # raises on a text of another length
    counted = [tuple(len(tokenizer(turn["value"]).input_ids) for turn in entry["conversations"]) for entry in data]
    assert counted == lengths
    assert [turn["from"] for turn in data[0]["conversations"]] == ["human", "gpt"]
    words = set(sharegpt_like.whole_words(tokenizer))
    assert len(words) > 1000 and "adequ" not in words and {"likely", "ability", "wheat"} <= words
    assert set(data[0]["conversations"][0]["value"].split()) <= words


def test_the_file_is_what_vllms_loader_reads(sharegpt_like, smollm2, tmp_path):
    out = tmp_path / "sharegpt_like.json"
    sharegpt_like.main(["--tokenizer", smollm2[1].name_or_path, "--out", str(out), "--num-conversations", "5"])
    data = json.loads(out.read_text())
    assert len(data) == 5 and all(len(entry["conversations"]) >= 2 and entry["id"] for entry in data)
