"""The scheduler without a model (guide §11, §12, §17): schedule() plans a step, update_from_output(plan, sampled)
applies what a forward pass and a sampler produced. The tokens here are made up; what is checked is the sequences'
state (computed tokens, tokens, status), the block tables and the pool's free blocks.
"""

import pickle

import pytest

from paged.config import EngineConfig
from paged.core.block_manager import BlockManager
from paged.core.scheduler import Scheduler
from paged.core.sequence import Request, RequestMetrics, SequenceStatus
from paged.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, **settings
) -> Scheduler:
    """A scheduler for a model of max_model_len positions whose end-of-sequence token is EOS."""
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        vocab_size=100,
        eos_token_ids=[EOS],
        **settings,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def add(scheduler: Scheduler, prompt: list[int], request_id: str = "0", **params) -> Request:
    params = {"temperature": 0.0, "max_tokens": 8, **params}
    request = Request(request_id, None, list(prompt), SamplingParams(**params), RequestMetrics(arrival_time=0.0))
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, tokens: dict[int, list[int]] | None = None, default: int = 7):
    """One step: schedule, then hand the scheduler the tokens of every sequence whose chunk reached its end
    (tokens[seq_id], or [default]); returns the plan and the sequences that finished."""
    plan = scheduler.schedule()
    due = [
        seq
        for seq, num_new in plan.batch
        if seq.num_computed_tokens + num_new == seq.num_tokens + len(seq.spec_token_ids)
    ]
    due += [child for _, child in plan.forks]
    tokens = tokens or {}
    finished = scheduler.update_from_output(plan, [(seq, tokens.get(seq.seq_id, [default])) for seq in due], now=1.0)
    return plan, finished


def test_a_prompt_is_computed_then_decoded_until_max_tokens():
    scheduler = make_scheduler()
    request = add(scheduler, [10, 11, 12, 13, 14], max_tokens=3)
    seq = request.seqs[0]
    plan, finished = step(scheduler)
    assert plan.scheduled == [(seq, 5)] and finished == []
    assert seq.num_computed_tokens == 5 and seq.token_ids == [10, 11, 12, 13, 14, 7]
    assert seq.status is SequenceStatus.RUNNING
    plan, _ = step(scheduler, default=8)
    assert plan.scheduled == [(seq, 1)] and seq.num_computed_tokens == 6
    _, finished = step(scheduler, default=9)
    assert finished == [seq] and seq.finish_reason == "length" and seq.output_token_ids == [7, 8, 9]
    assert not scheduler.has_unfinished() and scheduler.block_manager.num_free_blocks == 16
    assert request.metrics.first_token_time == 1.0 and request.metrics.token_times == [1.0] * 3


def test_eos_and_stop_tokens_end_a_sequence_unless_eos_is_ignored():
    scheduler = make_scheduler()
    eos = add(scheduler, [10, 11], "eos").seqs[0]
    stop = add(scheduler, [10, 12], "stop", stop_token_ids=[5]).seqs[0]
    ignored = add(scheduler, [10, 13], "ignored", ignore_eos=True).seqs[0]
    _, finished = step(scheduler, {eos.seq_id: [EOS], stop.seq_id: [5], ignored.seq_id: [EOS]})
    assert finished == [eos, stop] and eos.finish_reason == stop.finish_reason == "stop"
    assert scheduler.running == [ignored] and ignored.token_ids == [10, 13, EOS]


def test_a_sequence_stops_at_the_model_length():
    scheduler = make_scheduler(max_model_len=6)
    seq = add(scheduler, [1, 3, 4, 5], max_tokens=10).seqs[0]
    step(scheduler)
    _, finished = step(scheduler)
    assert finished == [seq] and seq.num_tokens == 6 and seq.finish_reason == "length"


def test_accepted_drafts_are_kept_and_rejected_ones_rolled_back():
    """A verify of k drafts computes 1 + k tokens; the sampler accepts some and adds one: the sequence keeps the
    K/V of its real tokens only, and a block that held only rejected drafts goes back to the pool."""
    scheduler = make_scheduler(block_size=4)
    seq = add(scheduler, [10, 11, 12], max_tokens=20).seqs[0]
    step(scheduler, default=13)  # 4 tokens, 3 computed, one block
    seq.spec_token_ids = [20, 21, 22, 23]  # drafts, as a proposer sets them
    plan, _ = step(scheduler, {seq.seq_id: [20, 30]})  # accept draft 20, reject 21.., the target says 30
    assert plan.scheduled == [(seq, 5)]  # the last real token and four drafts
    assert seq.token_ids == [10, 11, 12, 13, 20, 30] and seq.spec_token_ids == []
    assert seq.num_computed_tokens == 5  # 10..13 and 20 have K/V; 30 is next
    assert len(scheduler.block_manager.block_tables[seq.seq_id]) == 2  # the third block held only drafts
    assert scheduler.block_manager.num_free_blocks == 14
    seq.spec_token_ids = [31, 32]
    step(scheduler, {seq.seq_id: [31, 32, 33]})  # all accepted, and a bonus token
    assert seq.output_token_ids == [13, 20, 30, 31, 32, 33] and seq.num_computed_tokens == 8


def test_a_stop_inside_accepted_drafts_ends_the_sequence_there():
    scheduler = make_scheduler()
    seq = add(scheduler, [10, 11, 12], max_tokens=20).seqs[0]
    step(scheduler, default=13)
    seq.spec_token_ids = [20, EOS, 22]
    _, finished = step(scheduler, {seq.seq_id: [20, EOS, 22, 40]})
    assert finished == [seq] and seq.output_token_ids == [13, 20, EOS] and seq.finish_reason == "stop"
    assert scheduler.block_manager.num_free_blocks == 16


def test_a_finished_prompt_forks_its_other_completions_which_share_its_blocks():
    scheduler = make_scheduler(block_size=4)
    request = add(scheduler, [10, 11, 12, 13, 14, 15], n=3, temperature=1.0, seed=4)
    plan, _ = step(scheduler, {0: [7], 1: [8], 2: [9]})
    parent = request.seqs[0]
    assert [(p, c.index) for p, c in plan.forks] == [(parent, 1), (parent, 2)]
    assert [seq.output_token_ids for seq in request.seqs] == [[7], [8], [9]]
    assert all(seq.num_computed_tokens == 6 and seq.status is SequenceStatus.RUNNING for seq in request.seqs)
    tables = [scheduler.block_manager.block_tables[seq.seq_id] for seq in request.seqs]
    assert tables[0] == tables[1] == tables[2] and scheduler.block_manager.num_free_blocks == 14
    assert request.seqs[1].generator.initial_seed() == 5  # completion i draws from seed + i
    plan, _ = step(scheduler)  # each writes its own copy of the shared last block
    assert len(plan.scheduled) == 3 and len(plan.blocks_to_copy) == 2


def test_decodes_come_first_in_the_batch_and_chunks_wait_their_turn():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=True)
    first = add(scheduler, [1] * 3, "a").seqs[0]
    step(scheduler)
    second = add(scheduler, [3] * 12, "b").seqs[0]
    plan, _ = step(scheduler)
    assert plan.batch == [(first, 1), (second, 7)] and second.num_computed_tokens == 7
    assert second.num_tokens == 12  # nothing sampled for a chunk short of the end
    plan, _ = step(scheduler)
    assert plan.batch == [(first, 1), (second, 5)] and second.num_tokens == 13


def test_a_step_with_no_decode_runs_its_first_prompt_whole_up_to_max_idle_prefill_tokens():
    """No stream waits on a step without a decode, so the budget stretches to the first prompt in line, up to
    max_idle_prefill_tokens. A 20-token prompt on an idle scheduler runs whole; a 40-token one that arrives while it
    decodes gets what the budget leaves (7), then, alone, 24 (the stretch's limit) and the last 9 in one step.
    Left at None, every step keeps the budget."""
    scheduler = make_scheduler(max_num_batched_tokens=8, max_idle_prefill_tokens=24, enable_chunked_prefill=True)
    short = add(scheduler, [1] * 20, "short").seqs[0]
    plan, _ = step(scheduler)
    assert plan.batch == [(short, 20)]
    longer = add(scheduler, [3] * 40, "longer").seqs[0]
    plan, _ = step(scheduler)
    assert plan.batch == [(short, 1), (longer, 7)]
    scheduler.abort([short])
    assert [step(scheduler)[0].batch for _ in range(3)] == [[(longer, 24)], [(longer, 9)], [(longer, 1)]]
    off = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=True)
    seq = add(off, [1] * 20).seqs[0]
    assert [step(off)[0].batch for _ in range(3)] == [[(seq, 8)], [(seq, 8)], [(seq, 4)]]


def test_a_preempted_sequence_is_recomputed_and_ends_with_the_same_tokens():
    """Two sequences outgrow a small pool: the newer is preempted (its blocks dropped), recomputed later from its
    prompt and output, and finishes; every block comes back."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a = add(scheduler, [1] * 4, "a", max_tokens=6).seqs[0]
    b = add(scheduler, [3] * 4, "b", max_tokens=6).seqs[0]
    preempted, steps = [], 0
    while scheduler.has_unfinished() and steps < 30:
        plan, _ = step(scheduler)
        preempted += plan.preempted
        steps += 1
    assert preempted and not scheduler.has_unfinished()
    assert a.output_token_ids == b.output_token_ids == [7] * 6 and b.num_preemptions + a.num_preemptions > 0
    assert scheduler.block_manager.num_free_blocks == 4


def test_a_checkpoint_restores_queues_and_the_next_sequence_id():
    scheduler = make_scheduler()
    add(scheduler, [1, 2, 3], "a")
    state = scheduler.checkpoint()
    add(scheduler, [4, 5], "b")
    scheduler.restore(state, lost=set())
    assert len(scheduler.waiting) == 1 and scheduler.next_seq_id == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 2, "max_num_seqs": 4}, "max_num_batched_tokens"),
        ({"max_idle_prefill_tokens": 0}, "max_idle_prefill_tokens"),
        ({"block_size": 12}, "power of two"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"speculative_config": {"method": "magic"}}, "speculative_config"),
    ],
)
def test_bad_settings_are_refused_when_the_config_is_made(bad, match):
    with pytest.raises(ValueError, match=match):
        make_scheduler(**bad)


def test_a_config_pickles_and_checks_prompts_against_the_model_and_the_pool():
    config = pickle.loads(
        pickle.dumps(
            EngineConfig(
                block_size=4, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64, vocab_size=100
            )
        )
    )
    config.check_prompt([1] * 16, max_tokens=16, n=2)  # 32 tokens: the whole pool
    for token_ids, max_tokens, n, match in [
        ([], 1, 1, "empty"),
        ([100], 1, 1, "vocabulary"),
        ([1] * 64, 1, 1, "max_model_len"),
        ([1] * 16, 17, 1, "KV pool"),
        ([1] * 17, 1, 1, "max_num_batched_tokens"),
        ([1], 1, 3, "max_num_seqs"),
    ]:
        with pytest.raises(ValueError, match=match):
            config.check_prompt(token_ids, max_tokens, n)
