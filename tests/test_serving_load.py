"""Serving under load (paged/serving/token_budget.py, server_defaults, AsyncLLM.steps): the server's own scheduling defaults,
the token budget sized for the machine, the loop's trace of its steps, and greedy outputs over HTTP under load."""

import asyncio
import subprocess
import sys

import openai
import pytest
import torch
from helpers import make_tiny_llm, random_prompts, tiny_llama

from paged import LLM, SamplingParams
from paged.model.loader import chat_prompt
from paged.serving.api_server import UNCHUNKED_TOKEN_BUDGET, build_app, serve_in_thread, server_defaults, serving_llm
from paged.serving.token_budget import MAX_TOKEN_BUDGET, size_token_budget

DEADLINE_S = 60.0


def fake_timings(monkeypatch, fixed: float, per_token: float) -> list[int]:
    """Make token_budget's step timer answer a line instead of timing; returns the token counts it was asked."""
    asked = []

    def time_step(engine, num_tokens, seed, repeats=2):
        asked.append(num_tokens)
        return fixed + (num_tokens - 1) * per_token

    monkeypatch.setattr("paged.serving.token_budget.time_step", time_step)
    return asked


@pytest.mark.parametrize(
    "fixed, per_token, expected",
    [
        (0.025, 0.001, 224),  # (0.25 - 0.025) / 0.001 + 1 = 226 tokens fit: 14 blocks of 16
        (0.001, 1e-6, MAX_TOKEN_BUDGET),  # a fast machine: the upper bound
        (0.3, 0.001, 8),  # a step already longer than the target: max_num_seqs, the least it may be
        (0.01, 0.0, MAX_TOKEN_BUDGET),  # no measurable cost per token
    ],
)
def test_the_budget_is_the_most_whole_blocks_whose_step_fits_the_target(monkeypatch, fixed, per_token, expected):
    llm = make_tiny_llm(
        tiny_llama(),
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_TOKEN_BUDGET,
        enable_chunked_prefill=True,
    )
    asked = fake_timings(monkeypatch, fixed, per_token)
    sized = size_token_budget(llm.engine, target=0.25)
    assert sized.budget == expected
    assert (sized.fixed, sized.per_token) == pytest.approx((fixed, per_token))
    assert asked == [1, 1, 511]  # a warm-up, one token, then the longest prompt the 512-token model holds
    assert sized.step_time(1) == pytest.approx(fixed)


def test_sizing_really_times_the_engine_and_leaves_it_as_it_was():
    llm = make_tiny_llm(
        tiny_llama(),
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )
    sized = size_token_budget(llm.engine)
    assert sized.budget % 16 == 0 and 4 <= sized.budget <= MAX_TOKEN_BUDGET
    assert sized.fixed > 0 and sized.per_token >= 0
    assert not llm.engine.has_unfinished_requests() and llm.kv_stats()["num_used_blocks"] == 0


def test_sizing_needs_a_budget_that_holds_its_prompt_and_an_idle_engine():
    llm = make_tiny_llm(tiny_llama(), max_num_batched_tokens=128, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(128\) must hold it"):
        size_token_budget(llm.engine)
    llm.engine.add_request(llm.engine.make_request([1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="idle engine"):
        size_token_budget(llm.engine)


def test_the_budget_can_change_between_steps_and_is_checked_as_any_setting():
    llm = make_tiny_llm(tiny_llama(), max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True)
    engine = llm.engine
    engine.set_max_num_batched_tokens(32)
    assert engine.scheduler.max_num_batched_tokens == engine.config.max_num_batched_tokens == 32
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        engine.set_max_num_batched_tokens(4)
    assert engine.scheduler.max_num_batched_tokens == 32
    engine.add_request(engine.make_request(list(range(1, 100)), SamplingParams(max_tokens=2)))
    engine.step()
    assert engine.last_schedule.num_batched_tokens == 32  # a 99-token prompt, chunked to the new budget


def test_the_servers_defaults_are_its_own_and_llms_are_unchanged():
    defaults = server_defaults()
    assert defaults["enable_chunked_prefill"] and defaults["enable_prefix_caching"]
    assert defaults["max_num_batched_tokens"] is None and defaults["max_num_seqs"] == 128
    llm, sized = serving_llm(
        tiny_llama(), device="cpu", dtype=torch.float32, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=96
    )
    assert sized is None and llm.engine.config.max_num_batched_tokens == 96
    assert llm.engine.config.max_idle_prefill_tokens is None  # a budget given caps every step
    assert llm.engine.config.enable_chunked_prefill and llm.engine.config.enable_prefix_caching
    machine, sized = serving_llm(tiny_llama(), device="cpu", dtype=torch.float32, num_blocks=64, max_num_seqs=8)
    assert machine.engine.config.max_num_batched_tokens == sized.budget
    assert machine.engine.config.max_idle_prefill_tokens == MAX_TOKEN_BUDGET  # a sized one stretches when idle
    whole, sized = serving_llm(tiny_llama(), device="cpu", num_blocks=64, enable_chunked_prefill=False)
    assert sized is None and whole.engine.config.max_num_batched_tokens == UNCHUNKED_TOKEN_BUDGET
    offline = make_tiny_llm(tiny_llama())
    assert not offline.engine.config.enable_chunked_prefill and offline.engine.config.max_num_batched_tokens == 2048


def test_the_command_line_says_how_the_server_schedules():
    help_text = subprocess.run(
        [sys.executable, "-m", "paged", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "sized for this machine" in help_text and "--no-enable-chunked-prefill" in help_text
    assert "no stream decodes runs its first prompt whole" in " ".join(help_text.split())
    assert "--no-enable-prefix-caching" in help_text and "not LLM's offline defaults" in " ".join(help_text.split())


def test_the_loop_traces_each_step_it_runs():
    llm = make_tiny_llm(
        tiny_llama(),
        num_blocks=64,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        enable_chunked_prefill=True,
    )
    prompts = random_prompts(6, seed=5, low=10, high=60)
    app = build_app(llm, "m")
    with serve_in_thread(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)

        async def one(prompt):
            done = await client.completions.create(
                model="m", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
            )
            return done.usage.completion_tokens

        async def all_of_them():
            return await asyncio.gather(*map(one, prompts))

        assert asyncio.run(all_of_them()) == [5] * 6
        steps = list(app.state.async_llm.steps)
    assert len(steps) == llm.engine.num_steps
    assert sum(sum(n for _, n in s.step.prefills) for s in steps) == sum(map(len, prompts))  # every prompt token
    assert sum(len(s.step.decodes) for s in steps) == 6 * 4  # the first token comes with the prompt's last chunk
    assert all(s.step.num_batched_tokens <= 24 for s in steps)
    assert all(0 < s.forward_time <= s.step.duration and s.loop_time >= 0 for s in steps)
    assert all(s.outside_forward == pytest.approx(s.step.duration - s.forward_time + s.loop_time) for s in steps)
    assert [s.step.start for s in steps] == sorted(s.step.start for s in steps)
    assert steps[-1].num_running == steps[-1].num_waiting == 0


def test_greedy_outputs_over_http_under_load_equal_generates():
    """Sixteen clients at once against a server with its own defaults (chunked prompts under a small budget,
    prefix caching, a pool small enough to preempt): each gets LLM.generate's tokens, run offline one batch."""
    offline = LLM(model="smollm2", num_blocks=256)
    questions = [
        f"In one sentence, what is {topic}?"
        for topic in (
            "a prime number",
            "gravity",
            "a noun",
            "photosynthesis",
            "a river",
            "a verb",
            "the moon",
            "an atom",
            "rain",
            "a poem",
            "the sun",
            "a map",
            "a bridge",
            "a clock",
            "a forest",
            "a volcano",
        )
    ]
    prompts = [chat_prompt(offline.tokenizer, q) for q in questions]
    lengths = [12 + 3 * (i % 5) for i in range(len(prompts))]
    expected = [
        o.outputs[0].token_ids
        for o in offline.generate(
            prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths], use_tqdm=False
        )
    ]
    del offline
    served, sized = serving_llm("smollm2", num_blocks=24, max_num_seqs=16, max_num_batched_tokens=64)
    assert sized is None
    with serve_in_thread(build_app(served, "smollm2")) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)

        async def one(prompt, n):
            stream = await client.completions.create(
                model="smollm2",
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return [t async for chunk in stream for t in chunk.choices[0].token_ids]

        async def all_of_them():
            return await asyncio.wait_for(asyncio.gather(*map(one, prompts, lengths)), DEADLINE_S)

        got = asyncio.run(all_of_them())
    assert got == expected
    stats = served.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0  # the pool was under pressure, shared
    assert stats["num_used_blocks"] == 0
