"""paged/engine/metrics.py: TTFT / TPOT / goodput arithmetic on hand-made timelines, the step-cost model, and the online
driver on the tiny random Llama with the simulated clock (deterministic, so exact assertions are safe)."""

import time

import pytest
import torch
from helpers import assert_pool_empty, make_tiny_llm

from paged.analysis.replay import poisson_arrivals, replay
from paged.analysis.step_cost import StepCost
from paged.analysis.traces import LengthProfile, TraceRequest, make_trace
from paged.core.sequence import CompletionOutput, RequestMetrics, RequestOutput
from paged.engine.metrics import SLO, RequestRecord, StepRecord, goodput, percentiles, summarize
from paged.sampling_params import SamplingParams

# prompts long against outputs, so that prefill competes with decode; lengths fit the tiny model's 512 positions
LONG_PROMPTS = LengthProfile("long prompts", mean_input=200, mean_output=24, sigma_input=0.8, sigma_output=0.8)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matrices are too small to split between threads; on a busy 2-core machine a second
    thread mostly waits (a replay runs 10x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def record(ttft, tpot, num_output_tokens=11, arrival=0.0, request_id="0"):
    first = arrival + ttft
    return RequestRecord(
        request_id, 8, num_output_tokens, arrival, arrival, first, first + tpot * (num_output_tokens - 1)
    )


def long_trace(num_requests, seed=0):
    return make_trace(LONG_PROMPTS, num_requests, seed=seed, max_model_len=512, max_input_len=448)


# ---- arithmetic --------------------------------------------------------------------------------------------


def test_ttft_tpot_latency_from_a_request_output():
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.7)
    output = RequestOutput("7", None, [1, 2, 3], [CompletionOutput(0, "", list(range(10)), "length")], True, metrics)
    rec = RequestRecord.from_output(output, token_times=[11.0, 11.2, 11.5, 13.7])
    assert (rec.num_prompt_tokens, rec.num_output_tokens) == (3, 10)
    assert rec.ttft == pytest.approx(1.0)
    assert rec.queue_time == pytest.approx(0.5)
    assert rec.tpot == pytest.approx(2.7 / 9)  # 9 gaps after the first token
    assert rec.e2e_latency == pytest.approx(3.7)
    assert rec.e2e_latency == pytest.approx(rec.ttft + rec.tpot * (rec.num_output_tokens - 1))
    assert rec.itl == pytest.approx([0.2, 0.3, 2.2])
    assert record(ttft=0.3, tpot=0.0, num_output_tokens=1).tpot is None  # one token: no gap to average


def test_percentiles_slo_goodput_and_summary():
    assert percentiles(range(101)) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([1.0, 2.0], (50,)) == {"p50": 1.5}
    records = [record(0.2, 0.05), record(0.2, 0.2), record(3.0, 0.05), record(3.0, 0.0, num_output_tokens=1)]
    slo = SLO(ttft=1.0, tpot=0.1)
    assert [slo.met_by(r) for r in records] == [True, False, False, False]
    assert SLO(ttft=5.0, tpot=0.1).met_by(records[3])  # no TPOT to miss
    stalled = RequestRecord("s", 8, 4, 0.0, 0.0, 0.5, 1.1, token_times=(0.5, 0.6, 1.0, 1.1))
    assert SLO(ttft=1.0, tpot=0.25).met_by(stalled)  # TPOT 0.2 hides the 0.4 s gap ...
    assert not SLO(ttft=1.0, itl=0.3).met_by(stalled)  # ... a bound on every gap does not
    assert goodput(records, duration=4.0, slo=slo) == 0.25
    row = summarize(records, duration=4.0, slo=slo)
    assert row["requests"] == 4 and row["throughput_rps"] == 1.0
    assert row["output_tok_s"] == (11 * 3 + 1) / 4
    assert row["ttft_p50"] == pytest.approx(1.6) and row["ttft_mean"] == pytest.approx(1.6)
    assert row["tpot_mean"] == pytest.approx(0.1)  # mean of 0.05, 0.2, 0.05: the 1-token one is out
    assert row["slo_attainment"] == 0.25 and row["goodput_rps"] == 0.25


def test_poisson_arrivals_scale_with_rate():
    slow, fast = poisson_arrivals(200, 2.0, seed=3), poisson_arrivals(200, 8.0, seed=3)
    assert (slow == 4 * fast).all() and (slow[1:] > slow[:-1]).all()
    assert 150 / 2.0 < slow[-1] < 250 / 2.0  # 200 arrivals at 2/s take about 100 s
    assert (poisson_arrivals(5, float("inf")) == 0).all()
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(5, 0.0)


def test_step_cost_model_and_fit():
    cost = StepCost(fixed=0.03, per_token=0.001, per_seq=0.002, per_pair=1e-6)
    assert cost(100, 4, 5000) == pytest.approx(0.03 + 0.1 + 0.008 + 0.005)
    shapes = [(1, 1, 40), (8, 8, 900), (64, 64, 16000), (128, 1, 8256), (512, 1, 131328), (300, 20, 30000)]
    steps = [
        StepRecord(i, 0.0, cost(t, s, p), (("0", t - s + 1),), ("1",) * (s - 1), (), (), p)
        for i, (t, s, p) in enumerate(shapes)
    ]
    assert [(s.num_batched_tokens, s.num_seqs) for s in steps] == [(t, s) for t, s, _ in shapes]
    fitted = StepCost.fit(steps)
    for name in ("fixed", "per_token", "per_seq", "per_pair"):
        assert getattr(fitted, name) == pytest.approx(getattr(cost, name), rel=1e-6, abs=1e-12)


# ---- the driver --------------------------------------------------------------------------------------------


def test_simulated_clock_charges_each_step_and_jumps_when_idle(tiny_model):
    llm = make_tiny_llm(tiny_model)
    one_second_steps = StepCost(fixed=1.0, per_token=0.0, per_seq=0.0, per_pair=0.0)
    trace = [TraceRequest(0, 10, 4, 0.5), TraceRequest(1, 5, 2, 20.0)]
    result = replay(llm.engine, trace, step_cost=one_second_steps)
    first, second = result.requests
    # request 0: idle until 0.5, prefill step [0.5, 1.5] gives token 1, three decode steps give tokens 2-4
    assert (first.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time) == (
        0.5,
        0.5,
        1.5,
        4.5,
    )
    assert first.token_times == (1.5, 2.5, 3.5, 4.5) and first.ttft == 1.0 and first.tpot == 1.0
    # the engine is idle from 4.5 to 20: the clock jumps; request 1 then takes two steps
    assert (second.arrival_time, second.first_token_time, second.finished_time) == (20.0, 21.0, 22.0)
    assert [s.start for s in result.steps] == [0.5, 1.5, 2.5, 3.5, 20.0, 21.0]
    assert result.duration == 22.0
    assert [o.request_id for o in result.outputs] == ["0", "1"]
    assert [o.metrics.first_token_time for o in result.outputs] == [1.5, 21.0]  # the engine's stamps, corrected


def test_replay_serves_every_request_exactly_once(tiny_model):
    # a small budget with chunking: prompts arrive in chunks, some of a single token beside running decodes
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=256,
        block_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=37,
        enable_chunked_prefill=True,
    )
    trace = long_trace(16, seed=1)
    result = replay(llm.engine, trace, rate=8.0)
    assert [r.request_id for r in result.requests] == [str(r.request_id) for r in trace]
    for req, rec, out in zip(trace, result.requests, result.outputs):
        assert out.finished and out.request_id == rec.request_id
        assert rec.num_prompt_tokens == req.input_len and rec.num_output_tokens == req.output_len
        assert len(rec.token_times) == req.output_len and list(rec.token_times) == sorted(rec.token_times)
        assert rec.arrival_time <= rec.first_scheduled_time < rec.first_token_time <= rec.finished_time
        assert rec.first_token_time == rec.token_times[0] and rec.finished_time == rec.token_times[-1]
        # what the steps computed for it: its prompt once, in chunks, then one decode per later token
        prefilled = sum(n for step in result.steps for rid, n in step.prefills if rid == rec.request_id)
        decoded = sum(step.decodes.count(rec.request_id) for step in result.steps)
        assert (prefilled, decoded) == (req.input_len, req.output_len - 1)
    assert sum(step.finished.count(r.request_id) for step in result.steps for r in result.requests) == len(trace)
    assert all(0 < step.num_batched_tokens <= 37 and step.num_seqs <= 6 for step in result.steps)
    assert any(n == 1 for step in result.steps for _, n in step.prefills)  # a one-token chunk is still a prefill
    assert not llm.engine.has_unfinished_requests()
    assert_pool_empty(llm)


def test_simulated_replays_are_identical(tiny_model):
    def run():
        llm = make_tiny_llm(tiny_model, num_blocks=128, block_size=16, max_num_batched_tokens=512)
        return replay(llm.engine, long_trace(12), rate=4.0)

    first, second = run(), run()
    assert first.requests == second.requests and first.steps == second.steps
    assert [o.outputs[0].token_ids for o in first.outputs] == [o.outputs[0].token_ids for o in second.outputs]


def test_static_batching_admits_a_batch_only_when_the_engine_is_idle(tiny_model):
    trace = long_trace(12)
    static = replay(
        make_tiny_llm(tiny_model, num_blocks=256, block_size=16, max_num_batched_tokens=512).engine,
        trace,
        rate=float("inf"),
        static_batch_size=4,
    )
    continuous = replay(
        make_tiny_llm(tiny_model, num_blocks=256, block_size=16, max_num_batched_tokens=512).engine,
        trace,
        rate=float("inf"),
    )
    batch_of = {rec.request_id: k // 4 for k, rec in enumerate(static.requests)}  # all arrive at 0, in order
    for step in static.steps:
        batches = {batch_of[rid] for rid in step.decodes + tuple(rid for rid, _ in step.prefills)}
        assert len(batches) == 1  # no step mixes two batches
    assert len(static.steps) > len(continuous.steps) and static.duration > continuous.duration
    # greedy outputs do not depend on the schedule
    assert [o.outputs[0].token_ids for o in static.outputs] == [o.outputs[0].token_ids for o in continuous.outputs]


def test_preemption_in_a_tiny_pool_loses_nothing_and_changes_no_output(tiny_model):
    trace = [TraceRequest(i, 20 + 3 * i, 30, 0.0) for i in range(6)]
    roomy = replay(make_tiny_llm(tiny_model, num_blocks=64).engine, trace)
    tight_llm = make_tiny_llm(tiny_model, num_blocks=14)  # 112 slots for 6 requests of 50-95 tokens
    tight = replay(tight_llm.engine, trace)
    assert sum(r.num_preemptions for r in tight.requests) > 0 and any(step.preempted for step in tight.steps)
    assert sum(r.num_preemptions for r in roomy.requests) == 0
    assert [o.outputs[0].token_ids for o in tight.outputs] == [o.outputs[0].token_ids for o in roomy.outputs]
    assert all(len(r.token_times) == 30 for r in tight.requests)
    assert max(gap for r in tight.requests for gap in r.itl) > max(gap for r in roomy.requests for gap in r.itl)
    assert_pool_empty(tight_llm)


def test_goodput_falls_when_the_rate_passes_capacity(tiny_model):
    slo = SLO(ttft=2.0, tpot=0.15)
    trace = long_trace(24, seed=2)
    rates = [0.5, 1.0, 2.0, 4.0, 16.0]
    rows = []
    for rate in rates:
        llm = make_tiny_llm(tiny_model, num_blocks=512, block_size=16, max_num_batched_tokens=512)
        rows.append(replay(llm.engine, trace, rate=rate).summary(slo))
    goodputs = [row["goodput_rps"] for row in rows]
    peak = goodputs.index(max(goodputs))
    assert 0 < peak < len(rates) - 1  # it rises with the load, then falls
    assert goodputs[-1] < 0.5 * goodputs[peak]
    assert rows[-1]["throughput_rps"] > rows[peak]["throughput_rps"]  # while throughput keeps growing
    assert rows[0]["slo_attainment"] == 1.0 and rows[-1]["slo_attainment"] < 0.5


def test_chunked_prefill_bounds_the_stall_of_running_decodes(tiny_model):
    # four short requests decode; a 400-token prompt arrives while they run
    trace = [TraceRequest(i, 16, 40, 0.0) for i in range(4)] + [TraceRequest(4, 400, 4, 0.3)]
    results = {}
    for chunked, budget in ((False, 512), (True, 64)):
        llm = make_tiny_llm(
            tiny_model, num_blocks=128, block_size=16, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        )
        results[chunked] = replay(llm.engine, trace)
    gaps = {chunked: [gap for r in result.requests[:4] for gap in r.itl] for chunked, result in results.items()}
    # the worst time per output token a running request sees: one long step without chunking, short ones with it
    assert max(gaps[True]) < 0.5 * max(gaps[False])
    assert percentiles(gaps[True], (99,))["p99"] < 0.5 * percentiles(gaps[False], (99,))["p99"]
    assert results[True].requests[4].ttft > results[False].requests[4].ttft  # the price: the long prompt waits
    # each chunked step stays within its budget: 4 decodes + 60 prompt tokens
    assert max(step.num_batched_tokens for step in results[True].steps) == 64


def test_real_clock_replay(tiny_model):
    llm = make_tiny_llm(tiny_model)
    clock_before = llm.engine.clock
    started = time.perf_counter()
    result = replay(llm.engine, [TraceRequest(0, 8, 3, 0.0), TraceRequest(1, 8, 3, 0.05)], clock="real")
    elapsed = time.perf_counter() - started
    assert llm.engine.clock is clock_before  # the driver puts the engine's clock back
    second = result.requests[1]
    assert second.arrival_time == 0.05 and second.first_scheduled_time >= 0.05  # it waited for its arrival
    assert all(0 < r.ttft and r.finished_time <= elapsed for r in result.requests)
    assert all(step.duration > 0 for step in result.steps)


def test_replay_rejects_bad_arguments(tiny_model):
    llm = make_tiny_llm(tiny_model)
    trace = [TraceRequest(0, 8, 3, 0.0)]
    with pytest.raises(ValueError, match="clock"):
        replay(llm.engine, trace, clock="sundial")
    with pytest.raises(ValueError, match="static_batch_size"):
        replay(llm.engine, trace, static_batch_size=0)
    with pytest.raises(ValueError, match="prompts"):
        replay(llm.engine, trace, prompts=[[1], [2]])
    llm.engine.add_request(llm.engine.make_request([1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="idle engine"):
        replay(llm.engine, trace)
