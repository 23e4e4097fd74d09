"""The guide's KV-cache arithmetic (guide §2, §6-§8), computed by paged.geometry."""

import pytest
import torch
from transformers import LlamaConfig

from paged.geometry import (
    GiB,
    KiB,
    KVGeometry,
    MiB,
    block_table_bytes,
    blocks_for_tokens,
    format_bytes,
    read_time_s,
    worked_example,
)

LLAMA_70B = KVGeometry.llama3_70b()


def smollm2_config(**overrides) -> LlamaConfig:
    shape = dict(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
    )
    return LlamaConfig(**(shape | overrides))


def test_llama3_70b_per_token_and_per_request():
    assert LLAMA_70B.bytes_per_token == 327_680 == 320 * KiB
    assert LLAMA_70B.bytes_per_token_per_layer == 4 * KiB
    assert LLAMA_70B.request_bytes(2048) == 640 * MiB


def test_llama3_70b_blocks_and_pool():
    assert LLAMA_70B.block_bytes_per_layer(16) == 64 * KiB
    assert LLAMA_70B.block_bytes(16) == 5 * MiB
    assert LLAMA_70B.pool_blocks(40 * GiB, 16) == 8192
    assert LLAMA_70B.pool_tokens(40 * GiB, 16) == 131_072


def test_block_table_bytes():
    assert blocks_for_tokens(8192, 16) == 512
    assert block_table_bytes(200, 8192, 16) == 200 * 512 * 4 == 400 * KiB
    assert block_table_bytes(200, 8192, 16, torch.int64) == 800 * KiB


def test_worked_example():
    example = worked_example()
    assert example.naive_request_bytes == 640 * MiB
    assert example.naive_reserved_bytes == 125 * GiB
    assert round(example.naive_waste_fraction, 2) == 0.80
    assert example.naive_max_requests == 320  # 200 GiB / 640 MiB
    assert example.paged_request_bytes == 125 * MiB  # 400 tokens = 25 blocks of 5 MiB
    assert example.paged_max_requests == 1638  # 200 GiB / 125 MiB = 1,638.4
    assert format_bytes(example.paged_reserved_bytes) == "24.4 GiB"  # 200 x 400 tokens x 320 KiB


def test_worked_example_in_the_40_gib_pool():
    example = worked_example(budget_bytes=40 * GiB)
    assert (example.naive_max_requests, example.paged_max_requests) == (64, 327)


def test_decode_read_of_a_4k_context():
    one_layer = LLAMA_70B.decode_read_bytes(4096, num_layers=1)
    assert one_layer == 16 * MiB
    assert f"{read_time_s(one_layer) * 1e6:.1f}" == "5.0"  # µs at 3.35 TB/s
    assert LLAMA_70B.decode_read_bytes(4096) == 1.25 * GiB  # all 80 layers
    assert round(read_time_s(LLAMA_70B.decode_read_bytes(4096)) * 1e6) == 401


def test_decode_attention_is_memory_bound():
    assert LLAMA_70B.attention_flops_per_byte == 8.0  # far below an H100's ~295 FLOP/B


@pytest.mark.parametrize(
    "dtype, per_token", [(torch.float32, 46_080), (torch.bfloat16, 23_040), (torch.float16, 23_040)]
)
def test_smollm2_from_config(dtype, per_token):
    geometry = KVGeometry.from_config(smollm2_config(), dtype)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (30, 3, 64)
    assert geometry.bytes_per_token == per_token
    assert geometry.tensor_shape(7) == (1, 3, 7, 64)


def test_from_config_without_gqa_or_head_dim():
    class Bare:  # an old-style config: no num_key_value_heads, no head_dim
        num_hidden_layers, num_attention_heads, hidden_size = 2, 4, 256

    geometry = KVGeometry.from_config(Bare(), torch.float16)
    assert (geometry.num_kv_heads, geometry.head_dim, geometry.bytes_per_token) == (4, 64, 2 * 2 * 4 * 64 * 2)


def test_format_bytes():
    assert [format_bytes(n) for n in (327_680, 640 * MiB, 125 * GiB, 900, 1.25 * GiB)] == [
        "320 KiB",
        "640 MiB",
        "125 GiB",
        "900 B",
        "1.25 GiB",
    ]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: LLAMA_70B.block_bytes(12), "block_size must be a power of two"),
        (lambda: LLAMA_70B.block_bytes(0), "block_size must be a positive integer"),
        (lambda: LLAMA_70B.request_bytes(-1), "num_tokens must be an integer >= 0"),
        (lambda: KVGeometry.from_config(smollm2_config(), "fp16"), "dtype must be a torch.dtype"),
        (lambda: KVGeometry(80, 3, 128, 2, 64), "must be a multiple of num_kv_heads"),
        (lambda: worked_example(mean_tokens=4096), "mean_tokens"),
        (lambda: read_time_s(1, bandwidth=0), "bandwidth must be > 0"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
