"""The guide's figures (paged/guide_numbers.py): each row recomputed, the verdicts, and the small models behind the
corrections (speculative tokens per step, page replacement, prompt chunks)."""

import pytest

from paged.guide_numbers import (BELADY_REFERENCES, GuideNumber, chunk_sizes, corrections, guide_numbers,
                                 page_faults, shows_belady_anomaly, table_rows, unaligned_fraction)
from paged.speculative import expected_tokens


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
        "four-request example: reserved slots wasted": pytest.approx(100 * 5312 / 8192),
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
    }


def test_every_correction_with_its_right_figure(rows):
    fixed = {row.figure: row.computed for row in corrections()}
    assert fixed == {
        "worst tail waste of one request, block size 16": pytest.approx(4.6875),
        "time to read those 16 MiB at 3.35 TB/s": pytest.approx(16 * 2 ** 20 / 3.35e12 * 1e6),
        "paged: 200 requests x 400 tokens x 320 KiB": pytest.approx(25000 / 1024),
        "memory left per card: 70B fp16 weights on two 80 GB cards": pytest.approx(9.4),
        "memory left per card: the same weights over four 80 GB cards": pytest.approx((80e9 - 35.3e9) / 2 ** 30),
        "prefill FLOPs that 1.5 B cached prompt tokens save, Llama-3-70B": pytest.approx(2.118e20),
        "LRU replacement shows Belady's anomaly": False,
        "vLLM V1 turns prefix caching on by default": True,
        "share of ShareGPT-like prompts whose last block is partial (copy-on-write at a fork)":
            rows["share of ShareGPT-like prompts whose last block is partial (copy-on-write at a fork)"].computed,
        "§12: steps to prefill an 8,000-token prompt, budget 2,048, beside the running decodes": 5,
        "tokens per step: 75 % acceptance, 5 drafted tokens": pytest.approx(3.2881, abs=1e-4),
    }
    cow = rows["share of ShareGPT-like prompts whose last block is partial (copy-on-write at a fork)"].computed
    assert 85 < cow < 100                      # about 15 in 16, far from rare
    assert all(row.note for row in corrections())          # every correction says why


def test_shown_values_read_as_the_book_prints_them():
    shown = {r["figure"]: (r["computed"], r["guide"], r["verdict"]) for r in table_rows()}
    assert shown["time to read those 16 MiB at 3.35 TB/s"] == ("5.0 µs", "4.8 µs", "corrected")
    assert shown["paged: 200 requests x 400 tokens x 320 KiB"] == ("24.4 GiB", "25 GiB", "corrected")
    assert shown["worst tail waste of one request, block size 16"] == ("4.69 MiB", "4.8 MiB", "corrected")
    assert shown["memory left per card: the same weights over four 80 GB cards"] == ("41.6 GiB", "50 GiB",
                                                                                      "corrected")
    assert shown["tokens per step: 75 % acceptance, 5 drafted tokens"] == ("3.29 tokens", "4 tokens", "corrected")
    assert shown["KV cache per token, Llama-3-70B fp16"] == ("320 KiB", "320 KiB", "agrees")
    assert shown["LRU replacement shows Belady's anomaly"] == ("no", "yes", "corrected")


def test_the_verdict_is_computed_at_the_stated_precision():
    assert GuideNumber("01", "x", 24.41, "GiB", 24.4, 1).agrees
    assert not GuideNumber("01", "x", 24.41, "GiB", 25).agrees
    assert GuideNumber("01", "x", 79.5, "%", 80).agrees
    assert not GuideNumber("01", "x", 4.69, "MiB", 4.8, 1).agrees
    assert GuideNumber("01", "x", False, "", False).agrees and not GuideNumber("01", "x", True, "", False).agrees


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1                  # every draft rejected: the target's own token
    assert expected_tokens(1.0, 5) == 6                  # all accepted, plus the bonus token
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.75, 5) == pytest.approx(sum(0.75 ** i for i in range(6)))
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
