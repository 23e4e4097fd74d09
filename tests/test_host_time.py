"""A decode step's parts as the engine times them (LLMEngine.last_step_times), the bytes of its memory floor
(paged/analysis/host_time.py), and chapter 12's bars of them."""

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm

from paged import SamplingParams
from paged.analysis.host_time import PARTS, decode_step_times, step_bytes
from paged.viz import plot_step_parts, step_part_bars


def test_every_step_records_its_parts(tiny_model):
    llm = make_tiny_llm(tiny_model)
    engine = llm.engine
    assert engine.last_step_times is None
    engine.add_request(engine.make_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.step()
    times = engine.last_step_times
    assert all(getattr(times, part) >= 0 for part in PARTS) and times.forward > 0
    assert times.total == pytest.approx(sum(getattr(times, part) for part in PARTS))


def test_decode_step_times_times_the_whole_batch_and_leaves_the_pool_empty(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=64, max_num_seqs=4)
    row = decode_step_times(llm.engine, batch=3, prompt_len=10, steps=4)
    assert row["batch"] == 3 and row["step_s"] > 0 and {f"{p}_s" for p in PARTS} <= set(row)
    assert_pool_empty(llm)
    model = llm.engine.model
    weights = (
        sum(
            t.numel() * t.element_size()
            for layer in model.layers
            for t in vars(layer).values()
            if isinstance(t, torch.Tensor)
        )
        + model.lm_head.nbytes
        + model.final_norm.nbytes
    )
    per_token = 2 * len(model.layers) * model.num_kv_heads * model.head_dim * 4  # K and V, fp32
    assert step_bytes(llm.engine, 0) == weights
    assert row["bytes"] == weights + 3 * (10 + 3) * per_token  # the middle step attends to 10 prompt + 3 new tokens


def test_decode_step_times_refuses_a_busy_engine_or_a_batch_that_does_not_fit(tiny_model):
    llm = make_tiny_llm(tiny_model, num_blocks=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs >= 3"):
        decode_step_times(llm.engine, batch=3, prompt_len=5, steps=2)
    assert_pool_empty(llm)
    llm.engine.add_request(llm.engine.make_request([1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="idle engine"):
        decode_step_times(llm.engine, batch=1, prompt_len=5, steps=2)


def test_step_part_bars_stack_the_parts_and_place_the_floor():
    row = {"step_s": 0.01, "bytes": 4_000_000, **{f"{p}_s": 0.001 * (i + 1) for i, p in enumerate(PARTS)}}
    bars = step_part_bars({"batch 1": row}, bandwidth=1e9)
    assert [p["part"] for p in bars[0]["parts"]] == list(PARTS)
    assert [p["left"] for p in bars[0]["parts"]] == pytest.approx([0, 1, 3, 6, 10])
    assert bars[0]["floor_ms"] == pytest.approx(4.0)
    fig = plot_step_parts({"a": row, "b": row}, bandwidth=1e9)
    assert len(fig.axes[0].patches) == 2 * len(PARTS)
