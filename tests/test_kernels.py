"""The Triton kernels against the torch reference in paged.model.attention (guide §5-§7).

Without CUDA they run in Triton's interpreter, switched on by paged/kernels/interpreter.py before any kernel is
decorated. Inputs are small: the interpreter runs every program in numpy, one after another. Where Triton is not
installed (pip has it for Linux only), the module is skipped, saying so.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from paged import kernels

if kernels.triton_missing():
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from helpers import (  # noqa: E402
    KERNEL_DEVICE,
    assert_prefill_rejects_bad_input,
    bad_decode_inputs,
    decode_call,
    decode_inputs,
    paged_pool,
    random_query,
)

from paged.model import attention as ref  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def assert_close(out, expected, dtype):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- cache write -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype, slot_dtype", [(torch.float32, torch.int64), (torch.float16, torch.int32)])
def test_reshape_and_cache_matches_write_kv(cache_dtype, slot_dtype):
    key_cache, value_cache, _, _ = paged_pool([40], 16, 3, 64, cache_dtype, seed=0)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))[:12].to(slot_dtype)
    slots[[2, 7]] = -1  # skipped tokens
    key = random_query(12, 3, 64, torch.float32, seed=2)  # fp32 into an fp16 pool is cast
    value = random_query(12, 3, 64, torch.float32, seed=3)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, expected_k, expected_v, slots.to(KERNEL_DEVICE))
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots.to(KERNEL_DEVICE))
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# --- decode ------------------------------------------------------------------------------------------------
# (block_size, num_heads, num_kv_heads, head_dim, dtype): block sizes 8/16/32, GQA 1/3/8, head_dim 64/128.
DECODE_CASES = [
    (8, 2, 2, 64, torch.float32),
    (16, 9, 3, 64, torch.float32),  # SmolLM2's heads
    (32, 8, 1, 128, torch.float32),
    (8, 6, 2, 128, torch.float16),
    (16, 16, 2, 64, torch.float16),
    (32, 4, 4, 128, torch.float16),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_v1(case):
    args = decode_inputs(*case)
    assert_close(kernels.paged_decode_attention(*args, version=1), ref.decode_attention(*args), case[-1])


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_v2(case, num_splits):
    args = decode_inputs(*case)
    out = kernels.paged_decode_attention(*args, version=2, num_splits=num_splits)
    assert_close(out, ref.decode_attention(*args), case[-1])


@pytest.mark.parametrize("num_splits", [2, 4, 5, 6, 7])
def test_decode_v2_every_split_count(num_splits):
    """Split counts that do and do not divide the number of tiles, and more splits than a short sequence has;
    the longest sequence fills its block table to the last column."""
    args = decode_inputs(8, 9, 3, 64, torch.float32, seed=num_splits, spare_columns=0)
    out = kernels.paged_decode_attention(*args, version=2, num_splits=num_splits)
    assert_close(out, ref.decode_attention(*args), torch.float32)


def test_decode_default_version_and_strided_query():
    """version=None picks a kernel; a query sliced out of a fused qkv tensor (non-contiguous) works."""
    query, key_cache, value_cache, block_tables, lens, scale = decode_inputs(16, 9, 3, 64, torch.float32)
    qkv = torch.cat([query, torch.zeros_like(query)], dim=-1)  # [num_seqs, num_heads, 2 * head_dim]
    strided = qkv[..., :64]
    assert not strided.is_contiguous()
    expected = ref.decode_attention(query, key_cache, value_cache, block_tables, lens, scale)
    assert_close(
        kernels.paged_decode_attention(strided, key_cache, value_cache, block_tables, lens, scale),
        expected,
        torch.float32,
    )


def test_head_dim_not_a_power_of_two():
    """head_dim 80 (Phi-2's) is padded to 128 lanes inside the kernels and masked."""
    args = decode_inputs(16, 4, 2, 80, torch.float32)
    expected = ref.decode_attention(*args)
    assert_close(kernels.paged_decode_attention(*args, version=1), expected, torch.float32)
    assert_close(kernels.paged_decode_attention(*args, version=2, num_splits=2), expected, torch.float32)


# --- prefill -----------------------------------------------------------------------------------------------
# (cached prefix, new tokens) per sequence: a whole prompt, a prompt longer than one query tile, one token after
# a prefix, a block-aligned prefix-cache hit, a chunk that starts mid-block, and an empty chunk.
CHUNKS = [(0, 5), (0, 37), (20, 1), (16, 16), (3, 21), (9, 0)]
PREFILL_CASES = [
    (8, 6, 2, 64, torch.float32),
    (16, 9, 3, 64, torch.float16),
    (32, 8, 1, 128, torch.float32),
    (16, 4, 4, 128, torch.float16),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill(case):
    block_size, num_heads, num_kv_heads, head_dim, dtype = case
    key_cache, value_cache, block_tables, lens = paged_pool(
        [p + n for p, n in CHUNKS], block_size, num_kv_heads, head_dim, dtype, seed=4
    )
    query_lens = torch.tensor([n for _, n in CHUNKS])
    query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32).to(KERNEL_DEVICE)
    query = random_query(int(query_lens.sum()), num_heads, head_dim, dtype, seed=4)
    args = query, key_cache, value_cache, block_tables, query_start_loc, lens, head_dim**-0.5
    assert_close(kernels.paged_prefill_attention(*args), ref.prefill_attention(*args), dtype)


def test_prefill_of_one_token_is_decode():
    """A chunk of one token per sequence is a decode step: the two kernels agree."""
    query, key_cache, value_cache, block_tables, lens, scale = decode_inputs(16, 9, 3, 64, torch.float32)
    query_start_loc = torch.arange(len(lens) + 1, dtype=torch.int32, device=KERNEL_DEVICE)
    prefill = kernels.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, lens, scale)
    decode = kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale)
    assert_close(prefill, decode, torch.float32)


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", bad_decode_inputs(), ids=lambda x: str(x)[:40])
def test_decode_rejects_bad_input(change, message):
    with pytest.raises(ValueError, match=message):
        decode_call(**change)()


@pytest.mark.skipif(KERNEL_DEVICE == "cuda", reason="bfloat16 works on a GPU")
def test_bfloat16_is_refused_in_the_interpreter():
    q, kc, vc, bt, lens, scale = decode_inputs(8, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 on a CPU"):
        kernels.paged_decode_attention(q, kc, vc, bt, lens, scale)


def test_prefill_rejects_bad_input():
    assert_prefill_rejects_bad_input(kernels.paged_prefill_attention)


def test_reshape_and_cache_rejects_bad_input():
    kc, vc, _, _ = paged_pool([16], 8, 2, 64, torch.float32, seed=0)
    key = random_query(3, 2, 64, torch.float32, seed=0)
    slots = torch.tensor([0, 1, 2], device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 \(skip\) or in \[0, 56\)"):
        kernels.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 56, 2], device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        kernels.reshape_and_cache(key, key, kc, vc, slots.float())
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, num_kv_heads=2, head_dim=64\]"):
        kernels.reshape_and_cache(key[:, :1], key, kc, vc, slots)
    with pytest.raises(ValueError, match="value shape"):
        kernels.reshape_and_cache(key, key[:2], kc, vc, slots)


# --- the benchmark's CPU dry run ---------------------------------------------------------------------------


def test_benchmark_dry_run(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_bench.py"
    spec = importlib.util.spec_from_file_location("kernel_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--dry-run", "--out", str(tmp_path)])
    assert {row["method"] for row in rows} == {"v1", "v2", "sdpa"}
    assert (tmp_path / "kernel_bench.csv").read_text().startswith("method,")
    assert (tmp_path / "kernel_bench.png").stat().st_size > 0
