"""The swap-or-recompute model of paged/analysis/offload_cost.py against the FLOPs transformers' own forward pass performs
(torch's FlopCounterMode), and its crossover formula against a search over lengths."""

import pytest
import torch
from helpers import tiny_llama
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from paged.analysis.offload_cost import (
    LLAMA3_70B_LAYER_WEIGHTS,
    crossover_tokens,
    gpu_crossover_tokens,
    gpu_recompute_seconds,
    gpu_swap_seconds,
    layer_weights,
    prefill_flops,
)
from paged.geometry import LLAMA3_70B_PARAMS, KVGeometry


def counted_flops(model, token_ids: list[int], num_cached: int) -> dict[str, float]:
    """FLOPs of the matmuls (the weights) and of attention that the model performs to compute tokens num_cached..
    after num_cached cached ones, with eager attention (which computes the whole masked rectangle of scores)."""
    cache = DynamicCache()
    with torch.no_grad():
        if num_cached:
            model.model(torch.tensor([token_ids[:num_cached]]), past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model.model(torch.tensor([token_ids[num_cached:]]), past_key_values=cache, use_cache=True)
    ops = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    return {
        "weights": sum(f for op, f in ops.items() if op.startswith(("aten.mm", "aten.addmm"))),
        "attention": sum(f for op, f in ops.items() if op.startswith("aten.bmm")),
    }


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # newer releases call it cache
@pytest.mark.parametrize("num_tokens, num_cached", [(96, 0), (96, 40), (200, 199)])
def test_prefill_flops_are_the_models_own(num_tokens, num_cached):
    model = tiny_llama(max_position_embeddings=256, attn_implementation="eager")
    geometry = KVGeometry.from_config(model.config, torch.float32)
    counted = counted_flops(model, list(range(1, num_tokens + 1)), num_cached)
    new = num_tokens - num_cached
    # the layers' weights less their norms' (no matmul): every new token goes through each weight once
    matmul_weights = sum(p.numel() for name, p in model.model.layers.named_parameters() if "norm" not in name)
    assert layer_weights(model) - matmul_weights == 2 * model.config.hidden_size * model.config.num_hidden_layers
    assert counted["weights"] == 2 * matmul_weights * new
    # eager attention scores every (query, key) of the rectangle; causal attention needs the pairs up to the diagonal
    causal_pairs = (num_tokens * (num_tokens + 1) - num_cached * (num_cached + 1)) // 2
    causal_attention = counted["attention"] * causal_pairs / (new * num_tokens)
    model_flops = prefill_flops(geometry, layer_weights(model), num_tokens, num_cached)
    assert model_flops == pytest.approx(counted["weights"] + causal_attention, rel=0.02)


def test_the_crossover_is_where_the_two_costs_meet():
    geometry = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, element_bytes=2, num_attention_heads=9)
    lengths = range(1, 40_000)
    for mfu in (0.25, 0.5, 1.0):
        at = gpu_crossover_tokens(geometry, 106e6, mfu=mfu)
        first = crossover_tokens(
            lambda n: gpu_swap_seconds(geometry, n),
            lambda n: gpu_recompute_seconds(geometry, 106e6, n, mfu=mfu),
            lengths,
        )
        assert first == (int(at) + 1 if at else 1)
    # a recompute that finds half its tokens cached costs less than a full one, more than none
    full, half = (gpu_recompute_seconds(geometry, 106e6, 4096, cached_share=s) for s in (0.0, 0.5))
    assert 0 < half < full


def test_a_cached_share_out_of_range_is_refused():
    geometry = KVGeometry.llama3_70b()
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="cached_share"):
            gpu_recompute_seconds(geometry, 68.5e9, 1024, cached_share=share)


def test_llama3_70b_layer_weights_are_those_of_its_config():
    config = LlamaConfig(
        vocab_size=128_256,
        hidden_size=8192,
        intermediate_size=28_672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # shapes only: no 280 GB of weights
        model = LlamaForCausalLM(config)
    assert layer_weights(model) == LLAMA3_70B_LAYER_WEIGHTS
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(LLAMA3_70B_PARAMS, rel=1e-3)
