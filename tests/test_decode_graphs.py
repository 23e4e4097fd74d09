"""The step's input buffers and the decode batches padded for CUDA graphs (engine/input_buffers.py,
engine/cuda_graphs.py), on a CPU: enforce_eager=False there runs the padded batches eagerly over the same buffers, as a
graph replay would. Greedy tokens with padding equal those without; padding rows write no K/V; the pool stays exact."""

import pytest
import torch
from helpers import assert_pool_empty, assert_ref_counts_exact, make_tiny_llm, random_prompts, require_cpu_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import SamplingParams
from paged.config import EngineConfig
from paged.engine.cuda_graphs import DecodeGraphs
from paged.engine.model_inputs import prepare_inputs

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SIZES = (2, 5)  # batches of 1 pad to 2, of 3 to 5; of 6 or more run unpadded


@pytest.fixture
def padded_sizes(monkeypatch):
    """The padded sizes every DecodeGraphs.run is called with, in order."""
    sizes = []
    run = DecodeGraphs.run

    def spy(self, size, *args):
        sizes.append(size)
        return run(self, size, *args)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return sizes


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(
    "settings_",
    [
        dict(num_blocks=256),
        dict(num_blocks=12),  # preempts
        dict(num_blocks=256, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16),
    ],
)
def test_padded_decodes_give_the_eager_tokens(tiny_model, padded_sizes, backend, settings_):
    if backend == "cpu":
        require_cpu_kernel()
    prompts = random_prompts(7, seed=5)
    prompts[3] = prompts[0][:20] + prompts[3]  # a shared prefix for the prefix cache
    common = dict(attention_backend=backend, max_num_seqs=8, **settings_)
    eager = make_tiny_llm(tiny_model, **common)
    padded = make_tiny_llm(tiny_model, enforce_eager=False, cudagraph_capture_sizes=list(SIZES), **common)
    assert eager.engine.model_runner.decode_graphs is None  # a CPU's default: no padding
    params = [SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(7)]  # 7 to 1
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)] == expected
    assert set(padded_sizes) == set(SIZES)  # both sizes were used
    assert_pool_empty(padded)
    if settings_["num_blocks"] == 12:
        assert padded.kv_stats()["num_preemptions"] > 0


def test_padding_rows_write_no_kv(tiny_model, padded_sizes):
    llm = make_tiny_llm(tiny_model, num_blocks=64, enforce_eager=False, cudagraph_capture_sizes=[4])
    engine = llm.engine
    for prompt in random_prompts(3, seed=1):
        engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    while len(padded_sizes) < 2:  # the prompts, then decodes of 3 sequences padded to 4
        engine.step()
    before = engine.kv_cache.storage.clone()
    engine.step()
    assert padded_sizes[-1] == 4
    changed = (engine.kv_cache.storage != before).flatten(4).any(-1).any(0).any(0)  # [num_blocks, block_size]
    written = set()
    for seq in engine.scheduler.running:  # each wrote its newest computed token, nothing else was written
        position = seq.num_computed_tokens - 1
        written.update(engine.block_manager.slot_mapping(seq.seq_id, position, position + 1))
    block_size = engine.config.block_size
    assert {block * block_size + slot for block, slot in changed.nonzero().tolist()} == written
    assert len(written) == 3


NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens")


def test_every_step_reads_the_same_buffers(tiny_model, monkeypatch):
    llm = make_tiny_llm(
        tiny_model, num_blocks=128, enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8
    )
    buffers = llm.engine.model_runner.buffers
    addresses = set()
    forward = llm.engine.model.forward

    def spy(input_ids, positions, meta, *args, **kwargs):
        tensors = [input_ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens]
        # an empty view (a step without decodes) has no address
        addresses.update((name, tensor.data_ptr()) for name, tensor in zip(NAMES, tensors) if tensor.numel())
        return forward(input_ids, positions, meta, *args, **kwargs)

    monkeypatch.setattr(llm.engine.model, "forward", spy)
    llm.generate(random_prompts(6, seed=2), GREEDY, use_tqdm=False)
    assert addresses == {(name, getattr(buffers, name).data_ptr()) for name in NAMES}


def test_a_larger_token_budget_grows_the_buffers(tiny_model):
    prompts = [list(range(1, 100)), list(range(3, 70))]
    expected = [
        o.outputs[0].token_ids
        for o in make_tiny_llm(tiny_model, num_blocks=128).generate(prompts, GREEDY, use_tqdm=False)
    ]
    llm = make_tiny_llm(tiny_model, num_blocks=128, max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=False)
    llm.engine.set_max_num_batched_tokens(256)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    runner = llm.engine.model_runner
    assert runner.buffers.input_ids.shape[0] == 256 and runner.decode_graphs.buffers is runner.buffers


def test_capture_sizes_default_to_vllms_list_up_to_max_num_seqs():
    assert EngineConfig(max_num_seqs=64).cudagraph_capture_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert EngineConfig(max_num_seqs=12).cudagraph_capture_sizes == (1, 2, 4, 8, 12)
    assert EngineConfig(max_num_seqs=3).cudagraph_capture_sizes == (1, 2, 3)
    assert EngineConfig(max_num_seqs=300).cudagraph_capture_sizes[-5:] == (248, 256, 272, 288, 300)
    assert EngineConfig(max_num_seqs=8, cudagraph_capture_sizes=[4, 1, 4]).cudagraph_capture_sizes == (1, 4)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(cudagraph_capture_sizes=[0]), "cudagraph_capture_sizes (max_num_seqs 8) must be >= 1"),
        (dict(cudagraph_capture_sizes=[9]), "cudagraph_capture_sizes (max_num_seqs 8) must be <= 8"),
        (dict(cudagraph_capture_sizes="8"), "cudagraph_capture_sizes must be a list"),
        (dict(cudagraph_capture_sizes=[]), "at least one batch size"),
        (dict(enforce_eager="yes"), "enforce_eager must be True or False"),
    ],
)
def test_bad_graph_settings_are_named(tiny_model, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_tiny_llm(tiny_model, max_num_seqs=8, **kwargs)


def test_padding_refuses_a_step_that_is_not_all_decodes(tiny_model):
    llm = make_tiny_llm(tiny_model)
    manager = llm.engine.block_manager
    manager.allocate(1, 3)
    with pytest.raises(ValueError, match="pad_decodes_to"):
        prepare_inputs(manager, [(1, [5, 6, 7], 0, 3, 1)], torch.device("cpu"), pad_decodes_to=4)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.booleans()), min_size=1, max_size=9),
    st.integers(0, 3),
)
def test_pool_stays_exact_with_padding(tiny_model, requests, abort_after):
    """Random prompts, lengths and aborts on a small pool with padded decodes: exact ref counts after every step,
    every block back at the end."""
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=24,
        max_num_seqs=6,
        enforce_eager=False,
        cudagraph_capture_sizes=[1, 3, 6],
        enable_prefix_caching=True,
    )
    engine = llm.engine
    ids = []
    for i, (prompt_len, max_tokens, abort) in enumerate(requests):
        prompt = [(7 * i + j) % 250 + 1 for j in range(prompt_len)]
        ids.append((engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=max_tokens))), abort))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert_ref_counts_exact(engine.block_manager)
        if steps == abort_after:
            for request_id, abort in ids:
                if abort:
                    engine.abort_request(request_id)
    assert_pool_empty(llm)
