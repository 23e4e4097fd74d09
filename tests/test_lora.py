"""Multi-LoRA serving (guide §16) against PEFT on transformers, on the tiny random Llama.

Adapters are made with PEFT itself (get_peft_model, B drawn at random since PEFT starts it at zero, then
save_pretrained), so the files are exactly what PEFT writes; PEFT's model, unmerged and merged, is the oracle.
"""

import json
import os
import random

import numpy as np
import pytest
import torch
from helpers import assert_pool_empty, make_adapter, make_tiny_llm, needs_triton, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import get_peft_model

from paged import LoRARequest, SamplingParams
from paged import lora as lora_module
from paged.config import MAX_LORA_RANK, MAX_LORAS
from paged.lora import TARGET_MODULES, LoRAAdapter, LoRASlots, lora_ops
from paged.model.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 7, 9, 11, 13], [200, 3, 3, 40], [17] * 19, list(range(30, 70))]


def hf_greedy(model, prompt, max_tokens=GREEDY.max_tokens) -> list[int]:
    """transformers' greedy tokens, EOS ignored as GREEDY does (a plain loop: generate would stop or mask EOS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters of different shapes: (LoRARequest, PEFT model) each."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [
        dict(r=4, targets=("q_proj", "v_proj")),
        dict(r=16, targets=TARGET_MODULES, use_rslora=True),
        dict(
            r=8,
            targets=("k_proj", "o_proj", "up_proj", "down_proj"),
            lora_alpha=4,
            rank_pattern={"down_proj": 2},
            alpha_pattern={"k_proj": 32},
        ),
    ]
    made = []
    for i, spec in enumerate(specs, start=1):
        path, peft_model = make_adapter(root / f"adapter{i}", seed=i, **spec)
        made.append((LoRARequest(f"adapter{i}", i, path), peft_model))
    return made


def lora_llm(**kwargs):
    kwargs.setdefault("max_loras", 3)
    return make_tiny_llm(tiny_llama(), enable_lora=True, max_lora_rank=16, **kwargs)


def test_greedy_tokens_equal_peft_unmerged_and_merged(adapters):
    llm = lora_llm()
    base = tiny_llama()
    for request, peft_model in adapters:
        ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))
        assert ours == [hf_greedy(peft_model, p) for p in PROMPTS]
        assert ours != [hf_greedy(base, p) for p in PROMPTS]  # the adapter does change the answers
    for request, peft_model in adapters:  # merged: W + s B A in the weights
        merged = get_peft_model(tiny_llama(), peft_model.peft_config["default"])
        merged.load_state_dict(peft_model.state_dict())
        merged = merged.merge_and_unload().eval()
        ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))
        assert ours == [hf_greedy(merged, p) for p in PROMPTS]
    assert_pool_empty(llm)


def test_a_mixed_batch_equals_each_request_alone(adapters):
    """Adapters and base requests in one batch, with chunked prefill so that decodes and prefills of different
    adapters share steps: every request's tokens are the ones it gets alone."""
    choices = [None] + [request for request, _ in adapters]
    rng = random.Random(0)
    prompts = [rng.choices(range(1, 250), k=rng.randint(1, 40)) for _ in range(14)]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    rng.shuffle(loras)
    llm = lora_llm(enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8)
    mixed = tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, lora_request=lr, use_tqdm=False))[0] for p, lr in zip(prompts, loras)]
    assert mixed == alone
    assert len({tuple(t) for t in mixed}) > 1
    assert_pool_empty(llm)


@pytest.mark.parametrize("setting", ["preemption", "swap", "speculative"])
def test_adapters_through_preemption_and_speculation(adapters, setting):
    """Recomputed or swapped after preemption, or verifying ngram drafts: each request keeps its adapter's greedy
    tokens, and a swapped sequence comes back only when a slot holds its adapter."""
    requests = [request for request, _ in adapters] + [None]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    loras = [requests[i % 4] for i in range(8)]
    alone = [
        tokens(lora_llm().generate([p], GREEDY, lora_request=lr, use_tqdm=False))[0] for p, lr in zip(prompts, loras)
    ]
    if setting == "preemption":
        llm = lora_llm(num_blocks=14)
    elif setting == "swap":
        llm = lora_llm(num_blocks=10, preemption_mode="swap", swap_space=0.01, max_loras=2)
    else:
        llm = lora_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == alone
    if setting == "preemption":
        assert llm.kv_stats()["num_preemptions"] > 0
    elif setting == "swap":
        assert llm.kv_stats()["swap_in_blocks"] > 0
    else:
        assert llm.spec_stats()["num_draft_tokens"] > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("seed", range(6))
def test_random_adapters_match_peft(tmp_path, seed):
    """Rank 1-16 on a random non-empty set of target modules, random alpha, sometimes rsLoRA."""
    rng = random.Random(seed)
    targets = rng.sample(TARGET_MODULES, rng.randint(1, len(TARGET_MODULES)))
    r = rng.randint(1, 16)
    path, peft_model = make_adapter(
        tmp_path / "a",
        seed=100 + seed,
        r=r,
        targets=targets,
        lora_alpha=rng.choice([1, r, 2 * r, 32]),
        use_rslora=rng.random() < 0.3,
    )
    llm = lora_llm(max_loras=1)
    request = LoRARequest("random", 7, path)
    ours = tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=request, use_tqdm=False))
    assert ours == [hf_greedy(peft_model, p) for p in PROMPTS[:2]]


def test_regex_targets_and_some_layers_match_peft(tmp_path):
    """target_modules as PEFT's regex string, and layers_to_transform: the weights in the file say where."""
    regex, regex_model = make_adapter(tmp_path / "regex", seed=5, r=6, targets=r".*layers\.1\..*(gate_proj|v_proj)")
    layer0, layer0_model = make_adapter(
        tmp_path / "layer0", seed=6, r=3, targets=("o_proj", "up_proj"), layers_to_transform=[0]
    )
    llm = lora_llm()
    cases = [
        (LoRARequest("regex", 3, regex), regex_model, {(1, "gate_proj"), (1, "v_proj")}),
        (LoRARequest("layer0", 4, layer0), layer0_model, {(0, "o_proj"), (0, "up_proj")}),
    ]
    for request, peft_model, modules in cases:
        ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))
        assert ours == [hf_greedy(peft_model, p) for p in PROMPTS]
        assert llm.engine.lora.registry[request.lora_int_id].weights.keys() == modules


def test_layers_without_weights_are_skipped(tmp_path):
    """An adapter of one layer gives PEFT's tokens, and the shrink runs only where some adapter of the step has
    weights: alone, layer 1's projections; batched with an o_proj adapter of layer 0, that one too."""
    late, late_model = make_adapter(tmp_path / "late", seed=8, r=4, targets=TARGET_MODULES, layers_to_transform=[1])
    early, early_model = make_adapter(tmp_path / "early", seed=9, r=2, targets=("o_proj",), layers_to_transform=[0])
    llm = lora_llm()
    manager = llm.engine.lora
    where = {
        id(a): (layer, fused) for layer, per_layer in enumerate(manager.slots.lora_a) for fused, a in per_layer.items()
    }
    calls, shrink = [], manager.shrink

    def counting_shrink(x, lora_a, segments):
        calls.append(where[id(lora_a)])
        return shrink(x, lora_a, segments)

    manager.shrink = counting_shrink

    late_request, early_request = LoRARequest("late", 1, late), LoRARequest("early", 2, early)
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=late_request, use_tqdm=False))
    assert ours == [hf_greedy(late_model, p) for p in PROMPTS]
    assert set(calls) == {(1, "qkv"), (1, "o"), (1, "gate_up"), (1, "down")}
    assert len(calls) == 4 * manager.num_steps  # one shrink per projection of layer 1, each step

    calls.clear()
    requests = [late_request, early_request, None, early_request]
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests, use_tqdm=False))
    models = [late_model, early_model, tiny_llama(), early_model]
    assert ours == [hf_greedy(model, p) for model, p in zip(models, PROMPTS)]
    assert set(calls) == {(0, "o"), (1, "qkv"), (1, "o"), (1, "gate_up"), (1, "down")}


def test_prefix_cache_is_keyed_by_adapter(adapters):
    """One prompt under one adapter twice shares its full blocks; under two adapters, or adapter and base, never."""
    (first, _), (second, _) = adapters[0], adapters[1]
    prompt = list(range(40, 75))  # 35 tokens: 4 full blocks of 8
    llm = lora_llm(enable_prefix_caching=True)
    plain = lora_llm()

    def hits(lora_request):
        before = llm.kv_stats()["prefix_hit_tokens"]
        out = tokens(llm.generate([prompt], GREEDY, lora_request=lora_request, use_tqdm=False))[0]
        assert out == tokens(plain.generate([prompt], GREEDY, lora_request=lora_request, use_tqdm=False))[0]
        return llm.kv_stats()["prefix_hit_tokens"] - before

    assert hits(first) == 0
    assert hits(first) == 32  # the same adapter: every full block of the prompt is shared
    assert hits(second) == 0  # another adapter: nothing, though the tokens are the same
    assert hits(None) == 0  # nor the base model
    assert hits(second) == 32 and hits(None) == 32
    assert_pool_empty(llm)


def test_the_prefix_cache_key_is_the_adapters_name_and_path_not_its_id(adapters):
    """As in vLLM (`_gen_lora_extra_hash_keys`): two engines that number one adapter differently name its blocks
    alike, and one name pointed at another folder names them otherwise."""
    (first, _), (second, _) = adapters[0], adapters[1]
    prompt = list(range(40, 75))  # 35 tokens: 4 full blocks of 8

    def cached_hashes(*requests):
        llm = lora_llm(enable_prefix_caching=True)
        for request in requests:  # registered in this order: the ids each engine has seen
            llm.generate([prompt], GREEDY, lora_request=request, use_tqdm=False)
        return set(llm.engine.block_manager.cached)

    alone = cached_hashes(first)
    renumbered = LoRARequest(first.lora_name, 7, first.lora_path)
    assert len(alone) >= 4 and alone < cached_hashes(second, renumbered)
    repointed = LoRARequest(first.lora_name, first.lora_int_id, second.lora_path)
    assert not alone & cached_hashes(repointed)


def test_slot_eviction_and_reload_keep_outputs(adapters):
    """Three adapters through one slot: the scheduler runs one adapter at a time (plus base requests), slots are
    evicted and reloaded, and every request still gets its own tokens."""
    requests = [request for request, _ in adapters]
    alone = {
        r.lora_int_id: tokens(lora_llm().generate(PROMPTS, GREEDY, lora_request=r, use_tqdm=False)) for r in requests
    }
    llm = lora_llm(max_loras=1)
    distinct = []
    llm.engine.forward_observers.append(
        lambda plan: distinct.append({seq.request.lora_int_id for seq, _ in plan.scheduled} - {0})
    )
    order = [requests[i % 3] for i in range(9)] + [None]
    outs = tokens(llm.generate([PROMPTS[i % 4] for i in range(10)], GREEDY, lora_request=order, use_tqdm=False))
    for i, (out, request) in enumerate(zip(outs, order)):
        if request is not None:
            assert out == alone[request.lora_int_id][i % 4]
    assert max(len(d) for d in distinct) == 1  # never more adapters in a step than slots
    stats = llm.lora_stats()
    assert stats["num_evictions"] >= 2 and stats["num_loads"] == stats["num_evictions"] + 1
    # and once more through the same engine, reloading what was evicted
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests[0], use_tqdm=False)) == alone[1]
    assert_pool_empty(llm)


def test_the_scheduler_admits_at_most_max_loras_adapters(adapters):
    llm = lora_llm(max_loras=2)
    running = []
    llm.engine.forward_observers.append(
        lambda plan: running.append({seq.request.lora_int_id for seq in llm.engine.scheduler.running} - {0})
    )
    requests = [request for request, _ in adapters]
    llm.generate(PROMPTS * 3, GREEDY, lora_request=[requests[i % 3] for i in range(12)], use_tqdm=False)
    assert max(len(r) for r in running) == 2
    assert llm.lora_stats()["num_evictions"] >= 1


@needs_triton
def test_the_triton_kernel_serves_the_same_tokens(adapters):
    """The engine with the Triton shrink/expand (Triton's interpreter on a CPU) gives the reference's tokens."""
    request, peft_model = adapters[1]
    llm = lora_llm()
    llm.engine.lora.shrink, llm.engine.lora.expand = lora_ops("triton")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ours = tokens(llm.generate(PROMPTS[:2], params, lora_request=request, use_tqdm=False))
    assert ours == [hf_greedy(peft_model, p, max_tokens=4) for p in PROMPTS[:2]]


# ---- bad input: a ValueError naming it; the engine stays usable and nothing is half-loaded -------------------


def broken_copy(tmp_path, source, name, change_config=None, config_text=None):
    """A copy of the adapter folder source with its config changed."""
    folder = tmp_path / name
    folder.mkdir()
    with open(os.path.join(source, "adapter_config.json")) as f:
        config = json.load(f)
    if change_config:
        change_config(config)
    (folder / "adapter_config.json").write_text(config_text if config_text is not None else json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(
        open(os.path.join(source, "adapter_model.safetensors"), "rb").read()
    )
    return str(folder)


def test_fan_in_fan_out_is_read_as_peft_reads_it(adapters, tmp_path):
    """fan_in_fan_out concerns Conv1D layers; on a Llama's nn.Linear projections PEFT turns it off and reads A and B
    as they are, and so does the engine."""
    from peft import PeftModel

    request, _ = adapters[0]
    folder = broken_copy(tmp_path, request.lora_path, "fifo", lambda config: config.update(fan_in_fan_out=True))
    peft_model = PeftModel.from_pretrained(tiny_llama(), folder).eval()
    llm = lora_llm()
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("fifo", 8, folder), use_tqdm=False))
    assert ours == [hf_greedy(peft_model, p) for p in PROMPTS]
    assert ours == tokens(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))


def test_bad_adapters_raise_and_leave_the_engine_usable(adapters, tmp_path):
    (good, _), (big, _) = adapters[0], adapters[1]
    llm = make_tiny_llm(tiny_llama(), enable_lora=True, max_loras=2, max_lora_rank=8)
    expected = tokens(llm.generate(PROMPTS, GREEDY, lora_request=good, use_tqdm=False))
    before = llm.lora_stats()
    slots_before = [t.clone() for t in llm.engine.lora.slots.lora_b[0].values()]

    def drop(key):
        return lambda config: config.pop(key)

    def set_targets(config):
        config["target_modules"] = ["q_proj", "c_attn"]

    bad = [
        (LoRARequest("missing", 5, str(tmp_path / "nowhere")), "lora_path"),
        (
            LoRARequest("json", 5, broken_copy(tmp_path, good.lora_path, "json", config_text="{not json")),
            "adapter_config.json .* malformed",
        ),
        (LoRARequest("no_r", 5, broken_copy(tmp_path, good.lora_path, "no_r", drop("r"))), "r must be"),
        (LoRARequest("big", 5, big.lora_path), "max_lora_rank"),
        (LoRARequest("zero", 0, good.lora_path), "lora_int_id"),
        (LoRARequest("other_name", good.lora_int_id, good.lora_path), "lora_int_id 1 already names"),
        (LoRARequest("targets", 5, broken_copy(tmp_path, good.lora_path, "targets", set_targets)), "c_attn"),
        ("adapter1", "lora_request must be a LoRARequest"),
    ]
    for lora_request, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS, GREEDY, lora_request=lora_request, use_tqdm=False)
    # a batch with one good new adapter and one bad one is refused whole: the good one is not registered either
    new_good = LoRARequest("fresh", 9, adapters[2][0].lora_path)
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[new_good, LoRARequest("big", 5, big.lora_path)], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[good], use_tqdm=False)
    assert llm.lora_stats() == before
    assert all(torch.equal(a, b) for a, b in zip(slots_before, llm.engine.lora.slots.lora_b[0].values()))
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=good, use_tqdm=False)) == expected
    assert_pool_empty(llm)


def test_a_lora_request_needs_enable_lora(adapters):
    llm = make_tiny_llm(tiny_llama())
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS, GREEDY, lora_request=adapters[0][0], use_tqdm=False)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.lora_stats()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [hf_greedy(tiny_llama(), p) for p in PROMPTS]


@pytest.mark.parametrize(
    "kwargs,message",
    [(dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"), (dict(max_loras=1.5), "max_loras")],
)
def test_bad_lora_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_llm(tiny_llama(), enable_lora=True, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_loras=MAX_LORAS + 1), f"max_loras must be <= {MAX_LORAS}"),
        (dict(max_loras=10**6), f"max_loras must be <= {MAX_LORAS}"),
        (dict(max_lora_rank=MAX_LORA_RANK + 1), f"max_lora_rank must be <= {MAX_LORA_RANK}"),
    ],
)
def test_lora_slots_are_bounded_before_anything_is_allocated(kwargs, message, adapters):
    with pytest.raises(ValueError, match=message):
        make_tiny_llm(tiny_llama(), enable_lora=True, **kwargs)
    request, peft_model = adapters[0]
    llm = lora_llm()  # a good one still works
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=request, use_tqdm=False)) == [
        hf_greedy(peft_model, p) for p in PROMPTS[:2]
    ]


def test_lora_slots_must_fit_the_memory_available(monkeypatch):
    """The slots' size is known before they are allocated: within the bounds, they must fit the device's memory."""
    model, _ = load_model(tiny_llama(), backend="torch")
    assert LoRASlots.nbytes_for(model, 3, 8) == LoRASlots(model, 3, 8).nbytes
    monkeypatch.setattr(lora_module, "available_memory", lambda device=None: LoRASlots.nbytes_for(model, 4, 16) - 1)
    with pytest.raises(ValueError, match=r"max_loras \(4\) slots of max_lora_rank \(16\) take .* GiB on cpu"):
        make_tiny_llm(tiny_llama(), enable_lora=True, max_loras=4, max_lora_rank=16)
    make_tiny_llm(tiny_llama(), enable_lora=True, max_loras=3, max_lora_rank=16)  # 3 slots fit


@pytest.mark.parametrize(
    "make_id",
    [np.int64, np.int32, np.uint8, torch.tensor, lambda i: torch.tensor(i, dtype=torch.int32)],
    ids=["np.int64", "np.int32", "np.uint8", "torch.int64", "torch.int32"],
)
def test_an_adapter_id_of_numpy_or_torch_is_the_int_it_stands_for(adapters, make_id):
    llm = lora_llm()
    requests = [
        LoRARequest(request.lora_name, make_id(request.lora_int_id), request.lora_path) for request, _ in adapters
    ]
    assert [type(r.lora_int_id) for r in requests] == [int] * 3 and requests[0] == adapters[0][0]
    outs = llm.generate(PROMPTS[:3], GREEDY, lora_request=requests, use_tqdm=False)
    assert tokens(outs) == [hf_greedy(peft_model, p) for (_, peft_model), p in zip(adapters, PROMPTS)]
    assert llm.lora_stats()["registered"] == [1, 2, 3]


@pytest.mark.parametrize("lora_id", [1.0, True, torch.tensor([1, 2]), np.array([1]), "1", None])
def test_an_adapter_id_that_is_no_integer_is_refused_before_anything_is_queued(adapters, lora_id):
    llm = lora_llm()
    request, peft_model = adapters[0]
    bad = LoRARequest(request.lora_name, lora_id, request.lora_path)
    with pytest.raises(ValueError, match="lora_int_id must be an integer"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[request, bad], use_tqdm=False)
    assert llm.engine.requests == {} and llm.lora_stats()["registered"] == []
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=request, use_tqdm=False)) == [
        hf_greedy(peft_model, p) for p in PROMPTS[:2]
    ]


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=3), min_size=1, max_size=25),
    max_loras=st.integers(3, 4),
)
def test_slots_hold_what_each_step_needs(tiny_slots_model, steps, max_loras):
    """Whatever the order adapters are needed in: each step's adapters are resident in distinct slots holding their
    own weights, a slot is filled only when its adapter was not resident, and a needed adapter is never evicted."""
    slots = LoRASlots(tiny_slots_model, max_loras, 4)
    gen = torch.Generator().manual_seed(0)
    registry = {}
    for lora_id in range(1, 7):
        a = torch.randn(2, 64, generator=gen)
        registry[lora_id] = LoRAAdapter(f"a{lora_id}", lora_id, "", 2, {(0, "q_proj"): (a, torch.randn(64, 2))})
    for step, needed in enumerate(steps, start=1):
        resident_before = set(slots.slot_ids) - {None}
        loads_before = slots.num_loads
        slot_of = slots.activate(needed, registry, keep=set(), step=step)
        assert sorted(slot_of) == sorted(set(needed)) and len(set(slot_of.values())) == len(slot_of)
        for lora_id, slot in slot_of.items():
            assert slots.slot_ids[slot] == lora_id
            assert torch.equal(slots.lora_a[0]["qkv"][slot, :2], registry[lora_id].weights[(0, "q_proj")][0])
        assert slots.num_loads - loads_before == len(set(needed) - resident_before)
        assert len(set(slots.slot_ids) - {None}) <= max_loras


@pytest.fixture(scope="module")
def tiny_slots_model():
    return load_model(tiny_llama(), backend="torch")[0]
