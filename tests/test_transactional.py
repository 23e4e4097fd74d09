"""A step happens whole or not at all (LLMEngine.transaction), on a tiny random Llama.

An exception raised anywhere inside a step (scheduling, copies, the forward pass, sampling, accepting drafts,
finishing, detokenizing) leaves the engine as it was before the step: requests and sequences, queues, block
tables, ref counts, the free queue, the prefix cache, both tiers, the draft pool, the generators, every count.
Where the step had already written K/V, blocks (and tier slots) it took for fresh use lose their cached names,
and a sequence it preempted whose blocks it gave to another is recomputed; nothing else may differ. Afterwards
nothing leaks, no request is lost or finished twice, and greedy outputs equal a roomy engine's.
"""

import dataclasses
import os
import sys

import pytest
import torch
from helpers import assert_pool_empty, assert_ref_counts_exact, make_adapter, make_tiny_llm, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged
from paged import LoRARequest, SamplingParams
from paged.core.sequence import SequenceStatus

PAGED_DIR = os.path.dirname(paged.__file__) + os.sep
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


class Injected(Exception):
    """The error a test raises inside a step (KeyboardInterrupt is raised too)."""


class RaiseAtCall:
    """A sys.settrace hook that counts calls of functions defined in paged/ and raises `error` at the at-th one
    (None: it only counts). Counting stops at the step's commit point (StepJournal.commit): an exception after it
    is one after the step returned. Python unsets a trace function that raises, so the rollback runs untraced."""

    def __init__(self, at: int | None = None, error=Injected):
        self.at, self.error, self.calls, self.where, self.committed = at, error, 0, None, False

    def __call__(self, frame, event, arg):
        if event != "call" or self.committed or not frame.f_code.co_filename.startswith(PAGED_DIR):
            return None
        if frame.f_code.co_qualname == "StepJournal.commit":
            self.committed = True
            return None
        self.calls += 1
        if self.calls == self.at:
            self.where = frame.f_code.co_qualname
            raise self.error(f"injected at {self.where}")
        return None

    def run(self, function):
        previous = sys.gettrace()
        sys.settrace(self)
        try:
            return function()
        finally:
            sys.settrace(previous)


def raise_on(monkeypatch, owner, name: str, error=KeyboardInterrupt, after: bool = False, at: int = 1):
    """Make owner.name raise error on its at-th call (before doing anything, or after doing its work)."""
    original, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at and not after:
            raise error(f"injected in {name}")
        result = original(*args, **kwargs)
        if len(calls) == at:
            raise error(f"injected after {name}")
        return result

    monkeypatch.setattr(owner, name, failing)
    return calls


# ---- the engine's state, in plain values ----------------------------------------------------------------------


def plain(value):
    """A comparable copy: generators by their state, tensors by their values, containers element by element."""
    if isinstance(value, torch.Generator):
        return bytes(value.get_state().numpy())
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.tolist()
    if isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def sequence_state(seq) -> dict:
    return {key: plain(value) for key, value in vars(seq).items() if key != "request"}


def engine_state(engine) -> dict:
    """Everything a step may change, read field by field (not through the engine's own checkpoints)."""
    manager, scheduler = engine.block_manager, engine.scheduler
    state = {
        "requests": {
            rid: {
                "seqs": {seq.seq_id: sequence_state(seq) for seq in request.seqs},
                "metrics": plain(dataclasses.asdict(request.metrics)),
            }
            for rid, request in engine.requests.items()
        },
        "queues": {
            name: [seq.seq_id for seq in getattr(scheduler, name)] for name in ("waiting", "running", "swapped")
        },
        "counts": {
            "prefix_hit_tokens": scheduler.prefix_hit_tokens,
            "prefix_query_tokens": scheduler.prefix_query_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "num_steps": engine.num_steps,
            "next_seq_id": engine.scheduler.next_seq_id,
            "spec": engine.spec_stats(),
        },
        "tables": plain(manager.block_tables),
        "block_hashes": plain(manager.block_hashes),
        "cached": {block_hash: block.block_id for block_hash, block in manager.cached.items()},
        "names": [(block.block_hash, block.hash_key) for block in manager.blocks],
        "free": [block.block_id for block in manager.free_queue],
        "pending": list(manager.pending_copies),
        "generator": plain(engine.generator),
        "last_schedule": id(engine.last_schedule),
    }
    if engine.swap_space is not None:
        swap = engine.swap_space
        state["swap"] = (plain(swap.slots), swap.swap_out_blocks, swap.swap_in_blocks, list(swap.tier.free_slots))
    if engine.prefix_tier is not None:
        tier = engine.prefix_tier
        state["tier"] = (dict(tier.entries), tier.stored_blocks, tier.hit_tokens, sorted(tier.tier.free_slots))
    if engine.speculator is not None and engine.speculator.drafter is not None:
        drafter = engine.speculator.drafter
        state["drafts"] = (
            plain(drafter.block_manager.block_tables),
            dict(drafter.num_computed),
            [block.block_id for block in drafter.block_manager.free_queue],
        )
    if engine.lora is not None:
        slots = engine.lora.slots
        state["lora"] = (
            engine.lora.num_steps,
            list(slots.slot_ids),
            list(slots.last_used),
            slots.num_loads,
            slots.num_evictions,
        )
    return state


def assert_as_before(before: dict, after: dict, written: bool) -> None:
    """after (a rolled-back step) equals before; if the step had written K/V, cached names and tier entries may
    be gone, and sequences may have been sent back to be recomputed: nothing else differs."""
    if not written:
        assert after == before
        return
    lost = set()
    for rid, request in before["requests"].items():
        assert after["requests"][rid]["metrics"] == request["metrics"]
        assert after["requests"][rid]["seqs"].keys() == request["seqs"].keys()
        for seq_id, seq in request["seqs"].items():
            now = after["requests"][rid]["seqs"][seq_id]
            if now != seq:  # recomputed: its blocks went to another sequence in the undone step
                assert seq["status"] in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED)
                assert now["status"] is SequenceStatus.WAITING and now["num_computed_tokens"] == 0
                assert {**now, "status": None, "num_computed_tokens": None, "num_preemptions": None} == {
                    **seq,
                    "status": None,
                    "num_computed_tokens": None,
                    "num_preemptions": None,
                }
                lost.add(seq_id)
    assert after["requests"].keys() == before["requests"].keys()
    queues = {name: [s for s in seqs if s not in lost] for name, seqs in before["queues"].items()}
    assert after["queues"]["waiting"][len(lost) :] == queues["waiting"]
    assert set(after["queues"]["waiting"][: len(lost)]) == lost
    assert (after["queues"]["running"], after["queues"]["swapped"]) == (queues["running"], queues["swapped"])
    assert after["tables"] == {s: table for s, table in before["tables"].items() if s not in lost}
    assert after["cached"].items() <= before["cached"].items()
    assert all(now in (was, (None, None)) for now, was in zip(after["names"], before["names"]))
    if "tier" in before:
        assert after["tier"][0].items() <= before["tier"][0].items() and after["tier"][1:3] == before["tier"][1:3]
    if "swap" in before:
        assert after["swap"][0] == {s: slots for s, slots in before["swap"][0].items() if s not in lost}
    counts = dict(after["counts"], num_preemptions=before["counts"]["num_preemptions"])
    assert counts == before["counts"]
    for key in ("pending", "generator", "last_schedule", "drafts", "lora"):
        assert after.get(key) == before.get(key)


def assert_consistent(engine) -> None:
    assert_ref_counts_exact(engine.block_manager)
    if engine.speculator is not None and engine.speculator.drafter is not None:
        assert_ref_counts_exact(engine.speculator.drafter.block_manager)
    if engine.prefix_tier is not None:
        tier = engine.prefix_tier
        slots = [slot for _, slot in tier.entries.values()]
        assert sorted(slots + list(tier.tier.free_slots)) == list(range(tier.tier.num_slots))
    if engine.swap_space is not None:
        swap = engine.swap_space
        slots = [slot for slots in swap.slots.values() for slot in slots]
        assert sorted(slots + list(swap.tier.free_slots)) == list(range(swap.tier.num_slots))
        assert set(swap.slots) == {seq.seq_id for seq in engine.scheduler.swapped}


def interrupted_step(engine, at: int, error=Injected) -> list:
    """Run one step that raises at the at-th call inside paged/; check it changed nothing. Returns its outputs
    if it ran to the end (at was past its last call)."""
    before = engine_state(engine)
    tracer = RaiseAtCall(at, error)
    try:
        return tracer.run(engine.step)
    except error:
        assert_as_before(before, engine_state(engine), written=engine.model_runner.kv_written)
        assert_consistent(engine)
        return []


# ---- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(f"adapter{i}", i, make_adapter(root / f"adapter{i}", seed=i, r=4)[0]) for i in (1, 2)]


@pytest.fixture(scope="module")
def roomy(tiny_model):
    """An engine that never preempts, caches no prefix and does not speculate: the outputs to reproduce."""
    return make_tiny_llm(tiny_model, num_blocks=256, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def reference(roomy):
    """Greedy tokens of the roomy engine, by (prompt, adapter), computed once each."""
    llm, known = roomy, {}

    def greedy(prompt, lora_request=None, params=GREEDY):
        key = (tuple(prompt), lora_request, params.max_tokens)
        if key not in known:
            known[key] = llm.generate(prompt, params, use_tqdm=False, lora_request=lora_request)[0].outputs[0].token_ids
        return known[key]

    return greedy


HEADER = random_prompts(1, seed=40, low=12, high=13)[0]  # a shared system prompt: prefix-cache hits


def request_of(value: int, adapters) -> tuple:
    """A prompt (a shared header or not, some repeating for prompt lookup), its params (greedy, some with logprobs,
    or sampled) and maybe an adapter."""
    body = random_prompts(1, seed=value, low=2, high=14)[0]
    prompt = (HEADER if value % 2 else []) + (body * 2 if value % 3 == 0 else body)
    params = (
        GREEDY_LOGPROBS
        if value % 4 == 1
        else GREEDY
        if value % 4
        else SamplingParams(n=2, temperature=1.0, seed=value, max_tokens=6, ignore_eos=True)
    )
    lora_request = adapters[value % 2] if adapters and value % 5 < 2 else None
    return prompt, params, lora_request


features = st.fixed_dictionaries(
    {
        "num_blocks": st.sampled_from([14, 20, 64]),
        "block_size": st.sampled_from([4, 8]),
        "max_num_seqs": st.sampled_from([3, 8]),
        "enable_chunked_prefill": st.booleans(),
        "max_num_batched_tokens": st.sampled_from([16, 40, 256]),
        "max_idle_prefill_tokens": st.sampled_from([None, 64]),
        "enable_prefix_caching": st.booleans(),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "offload_tier": st.booleans(),
        "speculation": st.sampled_from([None, "ngram", "draft"]),
        "lora": st.booleans(),
    }
)
script = st.lists(
    st.tuples(st.sampled_from(["step", "interrupt", "interrupt", "add"]), st.integers(0, 999), st.booleans()),
    min_size=3,
    max_size=14,
)


def build(tiny_model, config) -> "paged.LLM":
    kwargs = {
        key: config[key]
        for key in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "max_idle_prefill_tokens",
            "enable_prefix_caching",
            "preemption_mode",
        )
    }
    kwargs["swap_space"] = 0.00005  # a dozen slots: swaps, and falls back
    if config["offload_tier"] and config["enable_prefix_caching"]:
        kwargs["kv_offloading_size"] = 0.00003  # a few slots: the tier evicts
    if config["speculation"] == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    elif config["speculation"] == "draft":
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": tiny_model,
            "num_speculative_tokens": 2,
            "draft_layers": 1,
        }
    if config["lora"]:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=4)
    return make_tiny_llm(tiny_model, **kwargs)


@settings(
    max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(config=features, ops=script)
def test_an_exception_anywhere_in_a_step_changes_nothing(tiny_model, adapters, roomy, reference, config, ops):
    """Random features, random requests, and steps that raise at a random call anywhere inside paged/: each such
    step leaves the engine as before; afterwards every request finishes once with the tokens of a roomy engine
    (greedy), or with all its completions (sampled), and nothing leaks. Then a beam search is interrupted the
    same way: it leaves nothing behind, and the next one finds the roomy engine's beams."""
    llm = build(tiny_model, config)
    engine = llm.engine
    added, finished = {}, {}
    calls_per_step = 400  # calls in a whole step, measured as the test goes: interrupts land anywhere within

    def add(value):
        prompt, params, lora_request = request_of(value, adapters if config["lora"] else None)
        try:
            request = engine.make_request(prompt, params, lora_request=lora_request)
        except ValueError:
            return  # can never fit this pool or budget: refused, nothing queued
        added[engine.add_request(request)] = (prompt, params, lora_request)

    def collect(outputs):
        for output in outputs:
            assert output.request_id not in finished, "a request finished twice"
            finished[output.request_id] = output

    for value in range(4):
        add(value)
    for op, value, keyboard in ops:
        error = KeyboardInterrupt if keyboard else Injected
        if op == "add":
            add(value)
        elif op == "step" and engine.has_unfinished_requests():
            tracer = RaiseAtCall()
            collect(tracer.run(engine.step))
            calls_per_step = max(tracer.calls, 1)
        elif op == "interrupt" and engine.has_unfinished_requests():
            collect(interrupted_step(engine, 1 + value * calls_per_step // 1000, error))
    for _ in range(300):  # a bound: a request that is never scheduled again fails here rather than hanging
        if not engine.has_unfinished_requests():
            break
        collect(engine.step())
    assert not engine.has_unfinished_requests()
    assert finished.keys() == added.keys() and engine.requests == {}
    for request_id, (prompt, params, lora_request) in added.items():
        completions = finished[request_id].outputs
        if params.greedy:
            assert completions[0].token_ids == reference(prompt, lora_request)
        if params.logprobs is not None:  # one entry per token, kept or undone with it
            assert [next(iter(entry)) for entry in completions[0].logprobs] == completions[0].token_ids
        else:
            assert [len(c.token_ids) for c in completions] == [params.max_tokens] * params.n
    assert_pool_empty(llm)
    assert_consistent(engine)
    if engine.swap_space is not None:
        assert engine.swap_space.slots == {}
    _, value, keyboard = ops[0]
    prompts = [request_of(value + i, None)[0] for i in range(2)]

    def search():
        return [[s.token_ids for s in out.sequences] for out in llm.beam_search(prompts, 2, max_tokens=3)]

    try:
        RaiseAtCall(1 + value * 20, KeyboardInterrupt if keyboard else Injected).run(search)
    except (KeyboardInterrupt, Injected, ValueError):  # a ValueError: the pool cannot hold the beams
        pass
    assert engine.requests == {}
    assert_pool_empty(llm)
    try:
        beams = search()
    except ValueError:
        return
    assert beams == [[s.token_ids for s in out.sequences] for out in roomy.beam_search(prompts, 2, max_tokens=3)]


# ---- one test per way a step used to come apart -----------------------------------------------------------------


def test_an_interrupt_while_scheduling_leaves_no_cache_entry_for_unwritten_blocks(tiny_model, reference, monkeypatch):
    """The scheduler names a prompt's full blocks in the prefix cache as it schedules them; interrupted before
    the forward pass, those names must go, or a later prompt would read K/V nobody wrote."""
    llm = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    engine = llm.engine
    prompts = [HEADER + random_prompts(1, seed=s, low=5, high=9)[0] for s in (1, 2)]
    engine.add_request(engine.make_request(prompts[0], GREEDY))
    before = engine_state(engine)
    calls = raise_on(monkeypatch, engine.block_manager, "take_pending_copies")  # the schedule's last act
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert calls and engine.block_manager.cached == {}
    assert_as_before(before, engine_state(engine), written=False)
    monkeypatch.undo()
    # through LLM.generate: the interrupt aborts the batch; the prompts then run again and hit nothing unwritten
    engine.abort_request(next(iter(engine.requests)))
    raise_on(monkeypatch, engine.block_manager, "take_pending_copies")
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_pool_empty(llm)
    assert engine.block_manager.cached == {}
    outputs = llm.generate(prompts + prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference(p) for p in prompts + prompts]


def test_an_interrupt_after_a_swap_out_was_planned_swaps_nothing(tiny_model, reference, monkeypatch):
    """The scheduler frees a victim's blocks and plans their copy to the swap tier; interrupted before the copy is
    made, the victim must not come back later from slots nobody wrote: it keeps its blocks, as before."""
    llm = make_tiny_llm(
        tiny_model, num_blocks=12, block_size=8, preemption_mode="swap", swap_space=0.001, max_num_seqs=4
    )
    engine = llm.engine
    prompts = random_prompts(4, seed=7, low=20, high=21)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    outputs, interrupted = {}, 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        before = engine_state(engine)
        raise_on(monkeypatch, engine.scheduler, "_swap_out", error=Injected, after=True)
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except Injected:
            interrupted += 1
            assert_as_before(before, engine_state(engine), written=False)
            assert_consistent(engine)
            monkeypatch.undo()
            outputs.update((o.request_id, o) for o in engine.step())  # the same step, whole this time
        monkeypatch.undo()
    assert interrupted > 0 and engine.kv_stats()["swap_out_blocks"] > 0
    assert [outputs[i].outputs[0].token_ids for i in ids] == [reference(p, params=params) for p in prompts]
    assert_pool_empty(llm)
    assert engine.swap_space.slots == {}


def test_an_interrupt_while_drafts_are_accepted_leaves_no_sequence_past_its_tokens(tiny_model, reference, monkeypatch):
    """Accepting drafts rolls a sequence back over the rejected ones and returns their blocks; interrupted half
    way, it must not be left counting K/V past its own tokens (it would never be scheduled again)."""
    config = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3, "draft_layers": 1}
    llm = make_tiny_llm(tiny_model, num_blocks=64, speculative_config=config)
    engine = llm.engine
    prompts = random_prompts(3, seed=9, low=6, high=20)
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts]
    outputs, interrupted = {}, 0
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        before = engine_state(engine)
        raise_on(monkeypatch, engine.block_manager, "truncate", error=Injected)  # inside _accept
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except Injected:
            interrupted += 1
            assert_as_before(before, engine_state(engine), written=True)
            assert engine_state(engine)["requests"] == before["requests"]  # no sequence was sent back
            assert all(seq.num_computed_tokens < seq.num_tokens for seq in engine.scheduler.running)
            monkeypatch.undo()
            outputs.update((o.request_id, o) for o in engine.step())  # the same step, whole this time
        monkeypatch.undo()
    assert interrupted > 0 and not engine.has_unfinished_requests()
    assert [outputs[i].outputs[0].token_ids for i in ids] == [reference(p) for p in prompts]
    assert_pool_empty(llm)


def test_an_interrupted_beam_search_step_leaves_no_cache_entry_for_unwritten_blocks(tiny_model, reference, monkeypatch):
    """Beam search runs its own steps, each a transaction as LLMEngine.step: interrupted in its first schedule,
    it leaves neither blocks nor cache entries behind, and its beams are then those of a fresh engine."""
    prompts = [HEADER + random_prompts(1, seed=s, low=5, high=9)[0] for s in (3, 4)]
    llm = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    raise_on(monkeypatch, llm.engine.block_manager, "take_pending_copies")
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search(prompts, beam_width=2, max_tokens=4)
    monkeypatch.undo()
    assert_pool_empty(llm)
    assert llm.engine.block_manager.cached == {} and llm.engine.requests == {}
    fresh = make_tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=True)
    beams = [[s.token_ids for s in out.sequences] for out in llm.beam_search(prompts, beam_width=2, max_tokens=4)]
    assert beams == [
        [s.token_ids for s in out.sequences] for out in fresh.beam_search(prompts, beam_width=2, max_tokens=4)
    ]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [
        reference(p) for p in prompts
    ]


class FlakyTokenizer:
    """Detokenizes, except on the calls listed in fail_at (1-based), where it is interrupted."""

    def __init__(self, fail_at=(1,)):
        self.fail_at, self.calls = set(fail_at), 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls in self.fail_at:
            raise KeyboardInterrupt("interrupted while detokenizing")
        return " ".join(map(str, token_ids))


def test_an_interrupt_while_detokenizing_loses_no_finished_request(tiny_model, reference):
    """The step that finishes requests detokenizes them last; interrupted there, the requests must still be in
    flight, unfinished, and the next step must finish them with the same tokens."""
    llm = make_tiny_llm(tiny_model, num_blocks=64)
    engine = llm.engine
    engine.tokenizer = FlakyTokenizer(fail_at=(1, 3))
    prompts = random_prompts(3, seed=12, low=4, high=12)
    ids = [engine.add_request(engine.make_request(p, GREEDY)) for p in prompts]
    outputs, interrupted = {}, 0
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        before = engine_state(engine)
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except KeyboardInterrupt:
            interrupted += 1
            assert_as_before(before, engine_state(engine), written=True)
            assert engine_state(engine)["requests"] == before["requests"] and set(engine.requests) >= set(ids) - set(
                outputs
            )
    assert interrupted == 2 and sorted(outputs) == sorted(ids)
    for request_id, prompt in zip(ids, prompts):
        tokens = outputs[request_id].outputs[0].token_ids
        assert tokens == reference(prompt) and outputs[request_id].outputs[0].text == " ".join(map(str, tokens))
    assert_pool_empty(llm)


def test_seeded_sampling_draws_the_same_after_an_interrupt(tiny_model, monkeypatch):
    """An interrupt after tokens were sampled puts every generator back: the run's completions equal an
    uninterrupted run's, token for token."""
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    plain = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)  # draws from the engine's generator
    prompts = random_prompts(2, seed=13, low=5, high=15)

    def run(interrupt: bool):
        engine = make_tiny_llm(tiny_model, num_blocks=64, seed=5).engine
        ids = [
            engine.add_request(engine.make_request(prompts[0], params)),
            engine.add_request(engine.make_request(prompts[1], plain)),
        ]
        outputs, step = {}, 0
        while engine.has_unfinished_requests():
            step += 1
            if interrupt and step % 3 == 0:
                raise_on(
                    monkeypatch, engine.scheduler, "check_stop", error=Injected, at=2
                )  # after every token was drawn
                with pytest.raises(Injected):
                    engine.step()
                monkeypatch.undo()
            outputs.update((o.request_id, o) for o in engine.step())
        return [[c.token_ids for c in outputs[i].outputs] for i in ids]

    assert run(interrupt=True) == run(interrupt=False)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_failure_after_a_preemption_recomputes_the_victim_whose_blocks_were_overwritten(
    tiny_model, reference, preemption_mode
):
    """A step preempts a sequence, gives its blocks to another, and fails in the forward pass, which has written
    into them: the victim cannot have its blocks back as they were. It is recomputed; the blocks the step took
    lose their cached names; every other sequence is as before, and the outputs do not change."""
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=12,
        block_size=8,
        max_num_seqs=4,
        enable_prefix_caching=True,
        preemption_mode=preemption_mode,
        swap_space=0.001,
    )
    engine = llm.engine
    prompts = random_prompts(4, seed=17, low=17, high=22)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    forward, outputs, lost = engine.model.forward, {}, []

    def forward_failing_after_a_preemption(*args, **kwargs):
        if engine.last_schedule.preempted and not failing.done:
            failing.done = True
            forward(*args, **kwargs)  # every layer writes its K/V, then the step fails
            raise Injected("after the forward pass")
        return forward(*args, **kwargs)

    failing = forward_failing_after_a_preemption
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        before, failing.done = engine_state(engine), False
        engine.model.forward = forward_failing_after_a_preemption
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except Injected:
            after = engine_state(engine)
            assert_as_before(before, after, written=True)
            assert_consistent(engine)
            lost.append(len(after["queues"]["waiting"]) - len(before["queues"]["waiting"]))
        engine.model.forward = forward
    assert lost and max(lost) > 0, "no failed step had overwritten a victim's blocks"
    assert [outputs[i].outputs[0].token_ids for i in ids] == [reference(p, params=params) for p in prompts]
    assert_pool_empty(llm)
    if engine.swap_space is not None:
        assert engine.swap_space.slots == {}
