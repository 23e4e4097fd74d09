"""The guide's figures (paged/analysis/guide_numbers.py): each row recomputed, the verdicts, the small models behind the
corrections (speculative tokens per step, page replacement, prompt chunks, the roofline's ridge), and that the chapter
each row names really discusses it."""

import json
import re
from pathlib import Path

import pytest

from paged.analysis.guide_numbers import (
    BELADY_REFERENCES,
    H100_MEMORY,
    GuideNumber,
    chunk_sizes,
    compute_bound_batch,
    corrections,
    e2e_formula_holds,
    guide_numbers,
    page_faults,
    shows_belady_anomaly,
    table_rows,
    unaligned_fraction,
)
from paged.analysis.speculative_cost import expected_tokens
from paged.geometry import LLAMA3_70B_PARAMS, KVGeometry

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"


@pytest.fixture(scope="module")
def rows():
    return {row.figure: row for row in guide_numbers()}


def test_the_figures_the_guide_gets_right(rows):
    agreeing = {figure: row.computed for figure, row in rows.items() if row.agrees}
    assert agreeing == {
        "KV cache per token, Llama-3-70B fp16": 320,
        "KV cache of one 2,048-token request": 640,
        "four-request example: slots holding tokens": 2880,
        "four-request example: slots reserved": 8192,
        "four-request example: reserved slots wasted (guide: '~65%')": pytest.approx(100 * 5312 / 8192),
        "one block of one layer, block size 16": 64,
        "one block over 80 layers, block size 16": 5,
        "blocks in a 40 GiB pool": 8192,
        "tokens in a 40 GiB pool": 131072,
        "block table [200, 512] int32": 400,
        "K and V one layer reads for a 4,096-token decode": 16,
        "naive: 200 requests reserving 2,048 tokens each": 125,
        "naive: reserved memory holding nothing at a mean of 400 tokens": pytest.approx(100 * (1 - 400 / 2048)),
        "naive: requests a 200 GiB KV budget admits": 320,
        "paged: requests a 200 GiB KV budget admits at a mean of 400": 1638,
        "paged: 200 requests x 125 MiB": pytest.approx(25000 / 1024),
        "§8: memory left per card, the same weights over four 80 GB H100s": pytest.approx(
            (81559 * 2**20 - 35.3e9) / 2**30
        ),
    }


def test_every_correction_with_its_right_figure(rows):
    fixed = {row.figure: row.computed for row in corrections()}
    assert fixed == {
        "§1: reserved KV per KV in use, the paper's measurement (guide: '5-10x')": pytest.approx(1 / 0.382),
        "naive: 'Used' = 200 requests x 400 tokens x 320 KiB": pytest.approx(25000 / 1024),
        "§8: the naive batch the 200 GiB budget admits (guide: 'from 64')": 320,
        "time to read those 16 MiB at 3.35 TB/s": pytest.approx(16 * 2**20 / 3.35e12 * 1e6),
        "a fork's write into a shared partial block is rare (§10: 'very rare')": False,
        "§13: end-to-end latency = TTFT + output_length x TPOT": False,
        "tokens per step: 75 % acceptance, 5 drafted tokens": pytest.approx(3.2881, abs=1e-4),
        "worst tail waste of one request, block size 16": pytest.approx(4.6875),
        "§1: memory left per card, 70B fp16 weights on two 80 GB H100s": pytest.approx(
            (2 * 85.52e9 - 141.2e9) / 2e9, abs=0.01
        ),
        "§9: FLOPs that 1.5 B cached prefill tokens save, Llama-3-70B": pytest.approx(2.118e20),
        "§9: LRU replacement shows Belady's anomaly": False,
        "§12: steps to prefill an 8,000-token prompt, budget 2,048, beside the running decodes": 5,
        "§16: a LoRA adapter's share of its model's weights (rank 16 on q and v, Llama-2-7B)": pytest.approx(
            0.1245, abs=1e-4
        ),
        "§18: vLLM V1 turns prefix caching on by default": True,
        "§18: batch at which Llama-3-70B decode on an H100 turns compute-bound, 1,024-token context": 932,
    }
    assert all(row.note for row in corrections())  # every correction says why


def test_an_h100_is_counted_as_nvml_reports_it():
    assert H100_MEMORY == 81559 * 2**20
    assert 79.6 < H100_MEMORY / 2**30 < 79.7 and 85.5 < H100_MEMORY / 1e9 < 85.6


def test_shown_values_read_as_the_book_prints_them():
    shown = {r["figure"]: (r["computed"], r["guide"], r["verdict"]) for r in table_rows()}
    assert shown["time to read those 16 MiB at 3.35 TB/s"] == ("5.0 µs", "4.8 µs", "corrected")
    assert shown["naive: 'Used' = 200 requests x 400 tokens x 320 KiB"] == ("24.4 GiB", "25.0 GiB", "corrected")
    assert shown["paged: 200 requests x 125 MiB"] == ("24.4 GiB", "24.4 GiB", "agrees")
    assert shown["worst tail waste of one request, block size 16"] == ("4.69 MiB", "4.8 MiB", "corrected")
    assert shown["§8: memory left per card, the same weights over four 80 GB H100s"] == ("46.8 GiB", "50 GiB", "agrees")
    assert shown["§1: memory left per card, 70B fp16 weights on two 80 GB H100s"] == ("14.9 GB", "20 GB", "corrected")
    assert shown["tokens per step: 75 % acceptance, 5 drafted tokens"] == ("3.29 tokens", "4 tokens", "corrected")
    assert shown["KV cache per token, Llama-3-70B fp16"] == ("320 KiB", "320 KiB", "agrees")
    assert shown["§9: LRU replacement shows Belady's anomaly"] == ("no", "yes", "corrected")


def test_the_verdict_is_computed_at_the_stated_precision():
    assert GuideNumber("01", "x", 24.41, "GiB", 24.4, 1).agrees
    assert not GuideNumber("01", "x", 24.41, "GiB", 25).agrees
    assert GuideNumber("01", "x", 79.5, "%", 80).agrees
    assert not GuideNumber("01", "x", 4.69, "MiB", 4.8, 1).agrees
    assert GuideNumber("01", "x", False, "", False).agrees and not GuideNumber("01", "x", True, "", False).agrees
    assert GuideNumber("01", "x", 46.8, "GiB", 50, -1).agrees  # "~50": a round figure, compared at tens
    assert not GuideNumber("01", "x", 14.9, "GB", 20, -1).agrees


def test_the_roofline_ridge_and_the_e2e_formula():
    g = KVGeometry.llama3_70b()
    assert 256 <= compute_bound_batch(g, LLAMA3_70B_PARAMS, 512) <= 512  # the guide's range, at 512 tokens
    assert compute_bound_batch(g, LLAMA3_70B_PARAMS, 1024) > 512
    assert compute_bound_batch(g, LLAMA3_70B_PARAMS, 2048) is None
    assert not e2e_formula_holds() and not e2e_formula_holds(0.5, 0.02, 100)


def chapter_prose(chapter: str) -> str:
    """The markdown cells of chapters/<chapter>_*.ipynb, dashes and spaces made plain."""
    (path,) = CHAPTERS.glob(f"{chapter}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    text = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    return re.sub(r"[\u2009\u202f\u00a0]", " ", text.replace("\u2212", "-").replace("\u2013", "-"))


@pytest.mark.parametrize("row", guide_numbers(), ids=lambda row: f"{row.chapter}: {row.figure}")
def test_the_chapter_a_row_names_discusses_it(row):
    assert row.key, "every row names what its chapter says"
    assert re.search(row.key, chapter_prose(row.chapter), re.S | re.I), (
        f"chapter {row.chapter}'s prose never matches {row.key!r}"
    )


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1  # every draft rejected: the target's own token
    assert expected_tokens(1.0, 5) == 6  # all accepted, plus the bonus token
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.75, 5) == pytest.approx(sum(0.75**i for i in range(6)))
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens(1.5, 5)


def test_belady_anomaly_is_fifo_s():
    assert [page_faults("fifo", BELADY_REFERENCES, n) for n in (3, 4)] == [9, 10]
    assert [page_faults("lru", BELADY_REFERENCES, n) for n in (3, 4)] == [10, 8]
    assert shows_belady_anomaly("fifo") and not shows_belady_anomaly("lru")
    with pytest.raises(ValueError, match="policy"):
        page_faults("clock", BELADY_REFERENCES, 3)


def test_chunk_sizes():
    assert chunk_sizes(8000, 2048, [64, 65]) == [1984, 1983, 1983, 1983, 67]
    assert chunk_sizes(100, 64, [4]) == [60, 40]
    assert sum(chunk_sizes(12345, 512, [7, 30, 2])) == 12345
    with pytest.raises(ValueError, match="no room"):
        chunk_sizes(10, 8, [8])


def test_unaligned_fraction():
    assert unaligned_fraction([16, 32, 17, 1], 16) == 0.5
    assert unaligned_fraction(list(range(1, 1601)), 16) == pytest.approx(15 / 16)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_weights_are_those_peft_adds_to_a_llama_2_7b():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged.analysis.guide_numbers import LLAMA2_7B_PARAMS, lora_weights

    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=4096,
        intermediate_size=11_008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # shapes only
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == LLAMA2_7B_PARAMS
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    added = sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert added == lora_weights(32, [(4096, 4096)] * 2, 16)
