"""The forward pass never waits for the device between layers (guide §7, §17): AttentionMetadata carries the
longest lengths as Python ints, every backend takes them, and the kernels' input checks run once per step, only
under the debug switch (paged.model.llama.CHECK_KERNELS, PAGED_CHECK_KERNELS=1)."""

import contextlib

import pytest
import torch
from helpers import make_tiny_llm, needs_triton, random_prompts, tiny_llama

import paged.kernels.checks
from paged import SamplingParams
from paged.model import attention as reference
from paged.model import llama as model_module

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
READ_BACKS = ("item", "tolist", "__int__", "__bool__", "__index__", "__float__")  # a CPU tensor's way to a number


@contextlib.contextmanager
def no_read_backs(calls: list):
    """Every call of a tensor method that turns it into a Python number is recorded (on a GPU, each would wait)."""
    saved = {name: getattr(torch.Tensor, name) for name in READ_BACKS}

    def recorder(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)

        return method

    for name in READ_BACKS:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def record_forward_read_backs(llm) -> list:
    """Wrap the engine's forward pass so that every read-back inside it is recorded; returns the record."""
    calls, forward = [], llm.engine.model.forward

    def recorded_forward(*args, **kwargs):
        with no_read_backs(calls):
            return forward(*args, **kwargs)

    llm.engine.model.forward = recorded_forward
    return calls


@pytest.fixture(scope="module")
def four_layers():
    return tiny_llama(num_hidden_layers=4)


@pytest.mark.parametrize("enforce_eager", [None, False])  # False: decodes padded as for a CUDA graph
@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=needs_triton)])
def test_the_forward_pass_reads_nothing_back_from_the_device(four_layers, backend, enforce_eager):
    """Prefills, mixed steps and decodes over four layers: not one tensor becomes a Python number."""
    llm = make_tiny_llm(
        four_layers,
        attention_backend=backend,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enforce_eager=enforce_eager,
    )
    calls = record_forward_read_backs(llm)
    outputs = llm.generate(random_prompts(3, seed=1, high=20), GREEDY, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 4 for out in outputs)
    assert calls == []


def test_the_recorder_sees_the_reference_read_back_its_lengths(four_layers):
    """Without the ints from the metadata the torch reference reads its longest context back, once per layer:
    the recorder above is not blind to it."""
    llm = make_tiny_llm(four_layers, attention_backend="torch")
    decode_steps = []
    # the reference without max_context_len, which it then reads back
    llm.engine.model.backend.decode = lambda *args: reference.decode_attention(*args[:-1])
    calls = record_forward_read_backs(llm)
    forward = llm.engine.model.forward
    llm.engine.model.forward = lambda *args, **kwargs: (
        decode_steps.append(args[2].num_decode_tokens > 0) or forward(*args, **kwargs)
    )
    llm.generate(random_prompts(2, seed=2, high=10), GREEDY, use_tqdm=False)
    assert calls.count("__int__") == 4 * sum(decode_steps) > 0


def test_the_debug_switch_checks_each_step_once(four_layers, monkeypatch):
    """Under CHECK_KERNELS the kernels' checks run on the first layer of every step, not on every layer."""
    counts = {"check_decode": 0, "check_prefill": 0}
    for name in counts:
        original = getattr(paged.kernels.checks, name)

        def counted(*args, _name=name, _original=original):
            counts[_name] += 1
            return _original(*args)

        monkeypatch.setattr(paged.kernels.checks, name, counted)
    steps = []
    llm = make_tiny_llm(four_layers, attention_backend="cpu")
    forward = llm.engine.model.forward
    llm.engine.model.forward = lambda *args, **kwargs: steps.append(args[2]) or forward(*args, **kwargs)

    llm.generate(random_prompts(2, seed=3, high=10), GREEDY, use_tqdm=False)
    assert counts == {"check_decode": 0, "check_prefill": 0}  # off by default
    steps.clear()
    monkeypatch.setattr(model_module, "CHECK_KERNELS", True)
    llm.generate(random_prompts(2, seed=3, high=10), GREEDY, use_tqdm=False)
    assert counts["check_decode"] == sum(1 for meta in steps if meta.num_decode_tokens) >= 3
    assert counts["check_prefill"] == sum(1 for meta in steps if meta.prefill_context_lens.numel()) >= 1
    assert all(meta.checked for meta in steps)


def test_the_debug_switch_catches_metadata_that_disagrees_with_its_tensors(four_layers, monkeypatch):
    monkeypatch.setattr(model_module, "CHECK_KERNELS", True)
    llm = make_tiny_llm(four_layers, attention_backend="cpu")
    forward = llm.engine.model.forward

    def forward_with_a_wrong_length(input_ids, positions, meta, *args, **kwargs):
        meta.prefill_max_query_len += 1
        return forward(input_ids, positions, meta, *args, **kwargs)

    llm.engine.model.forward = forward_with_a_wrong_length
    with pytest.raises(ValueError, match="prefill_max_query_len is"):
        llm.generate(random_prompts(1, seed=4, high=10), GREEDY, use_tqdm=False)
    llm.engine.model.forward = forward
    assert len(llm.generate(random_prompts(1, seed=4, high=10), GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
