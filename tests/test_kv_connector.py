"""The KV connector (paged/kv_connector.py): a producer engine hands requests over to a consumer engine in one process,
and the consumer's tokens are the colocated engine's; its prefix cache and LoRA work for a handed-over request; the
blocks the producer keeps are freed once saved; and random admit / finish / save sequences on the scheduler half,
without a model, leak no block and keep exact reference counts.
"""

import dataclasses

import pytest
import torch
from helpers import Interrupt, assert_pool_empty, assert_ref_counts_exact, make_adapter, make_tiny_llm, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import LoRARequest, SamplingParams
from paged.config import EngineConfig
from paged.core.block_manager import BlockManager
from paged.core.scheduler import Scheduler
from paged.core.sequence import Request, RequestMetrics
from paged.engine.kv_cache import KVCache
from paged.geometry import cdiv
from paged.kv_connector import KVConsumer, KVProducer

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2


def hand_over(producer, consumer, prompts, params, lora_request=None) -> list:
    """Each prompt prefilled by the producer LLM (its first token only), its K/V handed over to the consumer LLM,
    which decodes it to the end; outputs in prompt order (a request its first token ends comes from the producer)."""
    producer, consumer = producer.engine, consumer.engine
    original = {}
    for prompt, p in zip(prompts, params):
        request = producer.make_request(prompt, dataclasses.replace(p, max_tokens=1), lora_request=lora_request)
        request.kv_transfer_params = {"do_remote_decode": p.max_tokens > 1}
        original[producer.add_request(request)] = p
    done = {}
    while producer.has_unfinished_requests():
        outputs = step(producer)
        assert_pool_holds_only_its_requests(producer)  # the kept blocks were freed within the step
        sent = set()
        for saved in producer.kv_connector.take_saved():
            request = saved.request
            consumer.kv_connector.receive(request.request_id, saved.kv)
            consumer.add_request(
                consumer.make_request(
                    request.prompt_token_ids,
                    original[request.request_id],
                    request.request_id,
                    lora_request=request.lora_request,
                )
            )
            sent.add(request.request_id)
        done |= {out.request_id: out for out in outputs if out.request_id not in sent}
    while consumer.has_unfinished_requests():
        done |= {out.request_id: out for out in step(consumer)}
    return [done[request_id] for request_id in original]


def step(engine) -> list:
    """engine.step(), and again if a connector interrupted it (the step was undone)."""
    try:
        return engine.step()
    except Interrupt:
        return engine.step()


def assert_pool_holds_only_its_requests(engine) -> None:
    assert engine.scheduler.sending == {}
    held = {seq.seq_id for seq in engine.scheduler.running}
    assert set(engine.block_manager.block_tables) == held
    assert_ref_counts_exact(engine.block_manager)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


class CountingConsumer(KVConsumer):
    """A KVConsumer that counts the blocks it loads."""

    def __init__(self):
        super().__init__()
        self.loaded_blocks = []

    def start_load_kv(self, kv_cache, metadata):
        self.loaded_blocks += [len(block_ids) for _, block_ids, _ in metadata.loads]
        super().start_load_kv(kv_cache, metadata)


def test_handed_over_requests_give_the_colocated_engines_tokens(tiny_model):
    prompts = random_prompts(6, seed=11) + [[5], list(range(1, 9)), list(range(1, 10)), list(range(3, 20))]
    params = (
        [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 6
        + [SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(3)]
        + [SamplingParams(max_tokens=1, temperature=0.0)]
    )
    expected = make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False)
    producer = make_tiny_llm(tiny_model, kv_connector=KVProducer())
    consumer = make_tiny_llm(tiny_model, kv_connector=(counting := CountingConsumer()))
    outs = hand_over(producer, consumer, prompts, params)
    assert token_ids(outs) == token_ids(expected)
    assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in expected]
    # every prompt token but the last was loaded, in whole blocks; the max_tokens=1 request never left the producer
    assert sorted(counting.loaded_blocks) == sorted(cdiv(len(p) - 1, 8) for p in prompts[:-1] if len(p) > 1)
    for out in outs:  # one time per output token; the consumer samples the first one
        assert len(out.metrics.token_times) == len(out.outputs[0].token_ids)
    assert_pool_empty(producer)
    assert_pool_empty(consumer)
    assert counting.received == {}


class ProducerFailingOnce(KVProducer):
    """Raises once, right after its first save: the step is undone, the copy with it."""

    failed = False

    def wait_for_save(self, kv_cache):
        super().wait_for_save(kv_cache)
        if self.saved and not self.failed:
            self.failed = True
            raise Interrupt("interrupted")


class ConsumerFailingOnce(KVConsumer):
    """Raises once, right after its first load: the step is undone, and the received blocks wait again."""

    failed = False

    def start_load_kv(self, kv_cache, metadata):
        super().start_load_kv(kv_cache, metadata)
        if metadata.loads and not self.failed:
            self.failed = True
            raise Interrupt("interrupted")


def test_a_step_undone_after_a_save_or_a_load_is_done_again(tiny_model):
    prompts = random_prompts(4, seed=13, low=3, high=40)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4
    producer = make_tiny_llm(tiny_model, kv_connector=(failing_producer := ProducerFailingOnce()))
    consumer = make_tiny_llm(tiny_model, kv_connector=(failing_consumer := ConsumerFailingOnce()))
    outs = hand_over(producer, consumer, prompts, params)
    assert failing_producer.failed and failing_consumer.failed
    assert token_ids(outs) == token_ids(make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False))
    assert_pool_empty(producer)
    assert_pool_empty(consumer)


def test_the_consumers_prefix_cache_serves_a_shared_prefix(tiny_model):
    """The loaded blocks enter the consumer's prefix cache: a second prompt with the same 24-token prefix hits there,
    and only the block past the prefix is loaded."""
    prefix = list(range(100, 124))
    prompts = [prefix + [7, 8, 9, 10, 11], prefix + [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    producer = make_tiny_llm(tiny_model, kv_connector=KVProducer(), enable_prefix_caching=True)
    consumer = make_tiny_llm(tiny_model, kv_connector=(counting := CountingConsumer()), enable_prefix_caching=True)
    outs = [hand_over(producer, consumer, [prompt], [params])[0] for prompt in prompts]  # one after the other
    assert token_ids(outs) == token_ids(make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False))
    assert consumer.kv_stats()["prefix_hit_tokens"] == 24
    assert counting.loaded_blocks == [4, 1]  # tokens 0..27, then 24..28
    assert_ref_counts_exact(consumer.engine.block_manager)
    assert consumer.kv_stats()["num_free_blocks"] == consumer.kv_stats()["num_blocks"]


def test_a_request_under_an_adapter_is_handed_over(tiny_model, tmp_path):
    path, _ = make_adapter(tmp_path / "adapter", seed=3, r=4, targets=("q_proj", "v_proj", "down_proj"))
    adapter = LoRARequest("handed", 1, path)
    prompts = random_prompts(4, seed=12, low=5, high=30)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=4)
    expected = make_tiny_llm(tiny_model, **lora).generate(prompts, params, lora_request=adapter, use_tqdm=False)
    base = make_tiny_llm(tiny_model).generate(prompts, params, use_tqdm=False)
    assert token_ids(expected) != token_ids(base)  # the adapter changes the answers
    producer = make_tiny_llm(tiny_model, kv_connector=KVProducer(), **lora)
    consumer = make_tiny_llm(tiny_model, kv_connector=KVConsumer(), **lora)
    outs = hand_over(producer, consumer, prompts, params, lora_request=adapter)
    assert token_ids(outs) == token_ids(expected)
    assert consumer.lora_stats()["registered"] == [1]
    assert_pool_empty(producer)
    assert_pool_empty(consumer)


# ---- the scheduler half, without a model ---------------------------------------------------------------------------


def make_side(connector, num_blocks=16, block_size=4, enable_prefix_caching=True):
    """A scheduler with its connector and a pool of one layer, one head, head_dim 1 (values only, no model)."""
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        vocab_size=100,
        eos_token_ids=[EOS],
        enable_prefix_caching=enable_prefix_caching,
    )
    scheduler = Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching), kv_connector=connector)
    return scheduler, KVCache(1, 1, 1, num_blocks, block_size)


def run_step(scheduler, kv_cache, token: int = 7) -> list:
    """schedule, the connector's loads, then `token` for every sequence whose chunk reaches its end."""
    plan = scheduler.schedule()
    scheduler.kv_connector.start_load_kv(kv_cache, plan.kv_connector_metadata)
    due = [seq for seq, num_new in plan.batch if seq.num_computed_tokens + num_new == seq.num_tokens]
    return scheduler.update_from_output(plan, [(seq, [token]) for seq in due])


def new_request(request_id, prompt, max_tokens, remote=False) -> Request:
    request = Request(
        request_id,
        None,
        list(prompt),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        RequestMetrics(arrival_time=0.0),
    )
    request.kv_transfer_params = {"do_remote_decode": remote}
    return request


def test_the_producer_keeps_a_finished_prefills_blocks_until_they_are_saved():
    producer = KVProducer()
    scheduler, kv_cache = make_side(producer)
    kv_cache.storage.copy_(torch.arange(kv_cache.storage.numel(), dtype=torch.float32).view_as(kv_cache.storage))
    remote, local, stopped = (
        new_request("r", range(10, 19), 1, True),
        new_request("l", range(20, 25), 1),
        new_request("s", range(30, 36), 1, True),
    )
    for request in (remote, local, stopped):
        scheduler.add_request(request)
    plan = scheduler.schedule()
    tables = {seq.request.request_id: list(scheduler.block_manager.block_tables[seq.seq_id]) for seq, _ in plan.batch}
    tokens = {"r": 7, "l": 7, "s": EOS}  # the first token ends "s": nothing to hand over
    scheduler.update_from_output(plan, [(seq, [tokens[seq.request.request_id]]) for seq, _ in plan.batch])
    assert not scheduler.has_unfinished() and list(scheduler.sending) == ["r"]
    assert scheduler.block_manager.num_free_blocks == 16 - 3 and set(scheduler.block_manager.block_tables) == {
        remote.seqs[0].seq_id
    }
    producer.wait_for_save(kv_cache)
    scheduler.update_from_kv_xfer_finished(producer.get_finished())
    (saved,) = producer.take_saved()
    assert saved.request is remote and torch.equal(saved.kv, kv_cache.storage[:, :, tables["r"]])
    assert scheduler.sending == {} and scheduler.block_manager.num_free_blocks == 16
    assert_ref_counts_exact(scheduler.block_manager)


def test_the_consumer_loads_past_the_prefix_hit_and_computes_the_last_prompt_token():
    consumer = KVConsumer()
    scheduler, kv_cache = make_side(consumer)
    prefix = list(range(10, 18))  # two blocks of 4
    first = new_request("a", prefix + [1, 2, 3], 2)
    scheduler.add_request(first)
    while scheduler.has_unfinished():
        run_step(scheduler, kv_cache)  # computed here: its blocks enter the prefix cache
    received = torch.full((2, 1, 3, 4, 1, 1), 5.0)  # 3 blocks of the producer's, for an 11-token prompt
    consumer.receive("b", received)
    second = new_request("b", prefix + [4, 5, 6], 3)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    seq = second.seqs[0]
    (load,) = plan.kv_connector_metadata.loads
    table = scheduler.block_manager.block_tables[seq.seq_id]
    assert load == ("b", table[2:3], 2)  # the prefix hit's 2 blocks stay; tokens 8..9 are loaded
    assert plan.scheduled == [(seq, 1)] and seq.num_computed_tokens == 10  # the last prompt token is computed
    assert scheduler.prefix_hit_tokens == 8
    consumer.start_load_kv(kv_cache, plan.kv_connector_metadata)
    assert torch.equal(kv_cache.storage[:, :, table[2]], received[:, :, 2]) and consumer.received == {}
    scheduler.update_from_output(plan, [(seq, [7])])
    assert seq.output_token_ids == [7]
    child = scheduler.fork(seq)  # as beam search does, between two steps
    assert child.token_ids == seq.token_ids and child.num_computed_tokens == 11
    scheduler.abort([seq, child])
    assert scheduler.block_manager.num_free_blocks == 16
    assert_ref_counts_exact(scheduler.block_manager)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_hand_overs_leak_no_block(data):
    """Requests added to a producer (some marked for remote decode), steps of both sides, saves held back for a
    while, aborts on either side: after every operation each block's count is the number of tables that hold it,
    loaded blocks hold what was saved, and once everything is saved and finished both pools are whole."""
    producer, consumer = KVProducer(), KVConsumer()
    (p_sched, p_cache), (c_sched, c_cache) = make_side(producer), make_side(consumer)
    p_cache.storage.uniform_()
    originals, loaded, counter = {}, {}, 0

    def send():
        producer.wait_for_save(p_cache)
        p_sched.update_from_kv_xfer_finished(producer.get_finished())
        for saved in producer.take_saved():
            request = saved.request
            consumer.receive(request.request_id, saved.kv)
            loaded[request.request_id] = saved.kv
            c_sched.add_request(
                new_request(request.request_id, request.prompt_token_ids, originals[request.request_id])
            )

    def consumer_step():
        plan = c_sched.schedule()
        c_sched.kv_connector.start_load_kv(c_cache, plan.kv_connector_metadata)
        for request_id, block_ids, first in plan.kv_connector_metadata.loads:
            assert torch.equal(
                c_cache.storage[:, :, block_ids], loaded[request_id][:, :, first : first + len(block_ids)]
            )
        due = [seq for seq, n in plan.batch if seq.num_computed_tokens + n == seq.num_tokens]
        c_sched.update_from_output(plan, [(seq, [data.draw(st.sampled_from([7, 8, EOS]))]) for seq in due])

    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["add", "add", "producer", "save", "consumer", "consumer", "abort"]))
        if op == "add":
            shared = data.draw(st.sampled_from([[], list(range(10, 18))]))  # a shared prefix feeds the caches
            prompt = shared + data.draw(st.lists(st.integers(3, 99), min_size=1, max_size=10))
            max_tokens = data.draw(st.integers(1, 6))
            request_id = str(counter := counter + 1)
            originals[request_id] = max_tokens
            p_sched.add_request(new_request(request_id, prompt, 1, remote=data.draw(st.booleans()) and max_tokens > 1))
        elif op == "producer":
            run_step(p_sched, p_cache, token=data.draw(st.sampled_from([7, EOS])))
        elif op == "save":
            send()
        elif op == "consumer":
            consumer_step()
        else:
            side = data.draw(st.sampled_from([p_sched, c_sched]))
            live = [seq for seq in list(side.waiting) + side.running]
            if live:
                side.abort([data.draw(st.sampled_from(live))])
        for scheduler in (p_sched, c_sched):
            assert_ref_counts_exact(scheduler.block_manager)
        assert {seq_id for seq_ids in p_sched.sending.values() for seq_id in seq_ids} <= set(
            p_sched.block_manager.block_tables
        )
    for _ in range(200):  # drain: save what is kept, run both sides to the end
        if not (p_sched.has_unfinished() or p_sched.sending or c_sched.has_unfinished()):
            break
        if p_sched.has_unfinished():
            run_step(p_sched, p_cache)
        send()
        if c_sched.has_unfinished():
            consumer_step()
    for scheduler in (p_sched, c_sched):
        manager = scheduler.block_manager
        assert not scheduler.has_unfinished() and manager.block_tables == {}
        assert manager.num_free_blocks == manager.num_blocks
        assert_ref_counts_exact(manager)
    assert p_sched.sending == {} and consumer.received == {}
