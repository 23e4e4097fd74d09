"""The OpenAI-compatible server (paged/serving/api_server.py, paged/engine/async_llm.py) through the official `openai` client.

Each test starts its own server on 127.0.0.1 and a free port, in a background thread, and stops it as it ends.
A tiny random Llama serves where the exact text does not matter (token ids come back through vLLM's
return_token_ids); SmolLM2 serves where the text must be real.
"""

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import make_tiny_llm, random_prompts, tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from paged import LLM, LoRARequest, SamplingParams
from paged.engine.async_llm import CompletionTracker, IncrementalDetokenizer, SequenceUpdate
from paged.model.loader import chat_prompt
from paged.serving.api_server import adapter_rank, build_app, serve_in_thread

PIRATE = str(Path(__file__).resolve().parent.parent / "adapters" / "pirate")
DEADLINE_S = 20.0  # the longest any wait in these tests may last


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2", num_blocks=256, enable_lora=True, max_loras=1, max_lora_rank=adapter_rank(PIRATE))


@pytest.fixture
def tiny():
    return make_tiny_llm(tiny_llama(), num_blocks=16)  # 128 tokens of pool for a 512-token model


@contextlib.contextmanager
def server(llm, name="m", **kwargs):
    with serve_in_thread(build_app(llm, name, **kwargs)) as url:
        yield (
            url,
            openai.OpenAI(
                base_url=f"{url}/v1", api_key=kwargs.get("api_key") or "none", timeout=DEADLINE_S, max_retries=0
            ),
        )
    assert not llm.engine.has_unfinished_requests()  # shutdown aborted anything left


def metric_samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.keys() - {"model_name"}
    }


# ---- real text ---------------------------------------------------------------------------------------------


def test_completions_and_chat_equal_generate(smollm2):
    questions = ["What is the capital of France?", "Name a colour."]
    prompts = [chat_prompt(smollm2.tokenizer, q) for q in questions]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    expected = [o.outputs[0].text for o in smollm2.generate(prompts, greedy, use_tqdm=False)]
    pirate = (
        smollm2.generate(prompts[0], greedy, use_tqdm=False, lora_request=LoRARequest("pirate", 1, PIRATE))[0]
        .outputs[0]
        .text
    )
    cut = expected[0][: expected[0].index(" ", 3)]  # a stop string ends the text before it
    stop = expected[0][len(cut) : len(cut) + 3]
    with server(smollm2, "smollm2", lora_modules={"pirate": PIRATE}) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=4 * DEADLINE_S, max_retries=0)
        args = {"model": "smollm2", "max_tokens": 10, "temperature": 0}

        async def completion(prompt, **kwargs):
            done = await client.completions.create(prompt=prompt, **{**args, **kwargs})
            return done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens

        async def streamed(prompt, **kwargs):
            chunks = [
                c
                async for c in await client.completions.create(
                    prompt=prompt, stream=True, stream_options={"include_usage": True}, **{**args, **kwargs}
                )
            ]
            assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices  # usage: the last chunk
            return "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage.completion_tokens

        async def chat(question, stream):
            answer = await client.chat.completions.create(
                messages=[{"role": "user", "content": question}], stream=stream, **args
            )
            if not stream:
                return answer.choices[0].message.content
            return "".join([c.choices[0].delta.content or "" async for c in answer])

        async def everything():  # at once: they share the engine's steps
            models = await client.models.list()
            return [m.id for m in models.data], await asyncio.wait_for(
                asyncio.gather(
                    *(completion(p) for p in prompts),
                    *(streamed(p) for p in prompts),
                    *(chat(q, False) for q in questions),
                    *(chat(q, True) for q in questions),
                    completion(prompts[0], model="pirate"),
                    completion(prompts[0], stop=[stop]),
                    streamed(prompts[0], stop=stop),
                ),
                4 * DEADLINE_S,
            )

        names, results = asyncio.run(everything())
    assert names == ["smollm2", "pirate"]
    done, flowing, chats, chat_streams = results[0:2], results[2:4], results[4:6], results[6:8]
    assert [text for text, _, _ in done] == expected == [text for text, _ in flowing] == chats == chat_streams
    assert [n for _, _, n in done] == [n for _, n in flowing]
    assert results[8][0] == pirate != expected[0]
    assert results[9][:2] == (cut, "stop") and results[10][0] == cut
    assert smollm2.kv_stats()["num_used_blocks"] == 0


def test_stop_strings_and_min_p_over_http_as_offline(smollm2):
    """A stop string that spans two tokens ends the text where LLM.generate's ends, before the string or after it
    (include_stop_str_in_output), streamed or not; min_p=1 samples the greedy text; a bad min_p is a 400 naming it."""
    tokenizer = smollm2.tokenizer
    prompt = chat_prompt(tokenizer, "Name a colour.")
    full = smollm2.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    ends = [len(tokenizer.decode(full.token_ids[:i])) for i in range(len(full.token_ids) + 1)]  # text per prefix
    i = next(
        i
        for i in range(2, len(ends) - 1)
        if ends[i] > ends[i - 1]
        and ends[i + 1] - ends[i] >= 2
        and full.text.index(full.text[ends[i] - 1 : ends[i] + 2]) == ends[i] - 1
    )
    stop = full.text[ends[i] - 1 : ends[i] + 2]  # the last character of token i's text, two of token i + 1's
    offline = {
        include: smollm2.generate(
            prompt,
            SamplingParams(max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=include),
            use_tqdm=False,
        )[0].outputs[0]
        for include in (False, True)
    }
    assert offline[False].text == full.text[: ends[i] - 1] and offline[True].text == full.text[: ends[i] + 2]
    assert all(out.finish_reason == "stop" and out.stop_reason == stop for out in offline.values())
    with server(smollm2, "smollm2") as (url, client):
        for include in (False, True):
            args = dict(
                model="smollm2",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stop=[stop],
                extra_body={"include_stop_str_in_output": include},
            )
            done = client.completions.create(**args).choices[0]
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
            assert (done.text, done.finish_reason) == (offline[include].text, "stop") and streamed == done.text
        sampled = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=12, temperature=1.5, seed=1, extra_body={"min_p": 1.0}
        )
        assert sampled.choices[0].text == full.text
        response = httpx.post(
            f"{url}/v1/completions", timeout=DEADLINE_S, json={"model": "smollm2", "prompt": prompt, "min_p": 1.5}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "min_p"
    assert smollm2.kv_stats()["num_used_blocks"] == 0


def test_logprobs_in_both_of_openais_shapes(smollm2):
    """/v1/completions (logprobs=N) and /v1/chat/completions (logprobs, top_logprobs), streamed and not: the
    engine's log-probabilities (LLM.generate's), each token's text, and the N most likely at each position."""
    question = "What is the capital of France?"
    prompt = chat_prompt(smollm2.tokenizer, question)
    expected = smollm2.generate(prompt, SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False)[
        0
    ].outputs[0]
    chosen = [entry[token] for entry, token in zip(expected.logprobs, expected.token_ids)]
    args = {"model": "smollm2", "max_tokens": 8, "temperature": 0}
    with server(smollm2, "smollm2") as (url, client):
        done = client.completions.create(prompt=prompt, logprobs=2, **args).choices[0]
        chunks = list(client.completions.create(prompt=prompt, logprobs=2, stream=True, **args))
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": question}], logprobs=True, top_logprobs=2, **args
        ).choices[0]
        chat_chunks = list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": question}], logprobs=True, top_logprobs=2, stream=True, **args
            )
        )
        refused = [
            httpx.post(
                f"{url}/v1/chat/completions",
                json={**args, "messages": [{"role": "user", "content": question}], **extra},
                timeout=DEADLINE_S,
            ).json()["error"]
            for extra in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21})
        ]
    assert done.text == expected.text
    assert done.logprobs.tokens == [lp.decoded_token for lp in chosen]
    assert done.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in chosen], abs=1e-4)
    assert done.logprobs.text_offset == [sum(len(lp.decoded_token) for lp in chosen[:i]) for i in range(8)]
    for top, entry in zip(done.logprobs.top_logprobs, expected.logprobs):  # the chosen token and the 2 most likely
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in entry.values()}, abs=1e-4)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((lp.tokens for lp in streamed), []) == done.logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == done.logprobs.text_offset
    assert [t.token for t in chat.logprobs.content] == [lp.decoded_token for lp in chosen]
    assert chat.message.content == expected.text  # the tokens' texts hold the end-of-turn token's too
    assert "".join(t.token for t in chat.logprobs.content) == expected.text + smollm2.tokenizer.eos_token
    for item, entry in zip(chat.logprobs.content, expected.logprobs):
        assert item.bytes == list(item.token.encode("utf-8"))
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:2]
        assert [t.token for t in item.top_logprobs] == [lp.decoded_token for lp in ranked]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([lp.logprob for lp in ranked], abs=1e-4)
    streamed_chat = [c.choices[0].logprobs for c in chat_chunks if c.choices and c.choices[0].logprobs]
    assert [t.token for lp in streamed_chat for t in lp.content] == [t.token for t in chat.logprobs.content]
    assert [(e["param"], "logprobs: true" in e["message"] or "20" in e["message"]) for e in refused] == [
        ("top_logprobs", True)
    ] * 2


def test_incremental_text_never_splits_a_character(smollm2):
    tokenizer = smollm2.tokenizer
    text = "Crème brûlée 🍮 in Zürich, 東京"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([i], final=k == len(ids) - 1) for k, i in enumerate(ids)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") >= 1  # the emoji's bytes span tokens: one waited for the next


# ---- many clients, and clients that leave ---------------------------------------------------------------


def test_concurrent_streams_each_get_their_own_tokens(tiny):
    tiny = make_tiny_llm(tiny_llama(), num_blocks=128)
    prompts = random_prompts(16, seed=3, low=2, high=30)
    lengths = [4 + i % 9 for i in range(16)]
    expected = [
        o.outputs[0].token_ids
        for o in tiny.generate(
            prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths], use_tqdm=False
        )
    ]
    steps_before = tiny.engine.num_steps
    with server(tiny) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)

        async def one(prompt, n):
            stream = await client.completions.create(
                model="m",
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
    # the clients shared steps: far fewer steps than tokens served
    assert tiny.engine.num_steps - steps_before < sum(lengths) // 2


def test_a_client_that_disconnects_frees_its_blocks(tiny):
    tiny.engine.forward_observers.append(lambda plan: time.sleep(0.01))  # 100 tokens take over a second
    with server(tiny) as (url, client):
        stream = client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=100, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for _, chunk in zip(range(3), stream):
            pass
        assert metric_samples(url)["vllm:kv_cache_usage_perc"] > 0
        stream.close()
        deadline = time.monotonic() + DEADLINE_S
        while (
            metric_samples(url)["vllm:kv_cache_usage_perc"] > 0 or tiny.engine.requests
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = metric_samples(url)
        assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_requests_running"] == 0
        assert samples["vllm:request_success_total"] == 0  # aborted, not run to its end
        assert tiny.kv_stats()["num_used_blocks"] == 0 and not tiny.engine.requests
        ok = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")


# ---- bad requests, keys, metrics ----------------------------------------------------------------------------


BAD_REQUESTS = [  # (body, the param the error must name, a word its message must hold)
    ("{not json", None, "JSON"),
    ({"model": "gpt-4", "prompt": [1]}, "model", "gpt-4"),
    ({"model": "m", "prompt": [1, 2], "max_tokens": 600}, "max_tokens", "510"),
    ({"model": "m", "prompt": [1] * 100, "max_tokens": 60}, "prompt", "pool"),
    ({"model": "m", "prompt": [1], "temperature": "hot"}, "temperature", "temperature"),
    ({"model": "m", "prompt": [1, 2.5]}, "prompt[1]", "prompt"),
    ({"model": "m", "prompt": [1], "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"model": "m", "prompt": [1], "top_p": 0}, "top_p", "top_p"),
    ({"model": "m", "prompt": [1], "n": 2, "temperature": 0}, "n", "greedy"),
    ({"model": "m", "prompt": [1], "logprobs": 21}, "logprobs", "20"),
    ({"model": "m", "prompt": [1], "logprobs": True}, "logprobs", "integer"),
    ({"model": "m", "prompt": [999]}, "prompt", "vocabulary"),
    ({"model": "m", "prompt": "text"}, "prompt", "tokenizer"),
    ({"prompt": [1]}, "model", "model"),
]


def test_each_bad_request_gets_a_400_naming_the_field(tiny):
    with server(tiny) as (url, client):
        for body, param, word in BAD_REQUESTS:
            content = body if isinstance(body, str) else json.dumps(body)
            response = httpx.post(
                f"{url}/v1/completions",
                content=content,
                timeout=DEADLINE_S,
                headers={"content-type": "application/json"},
            )
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == 400, body
            assert error["param"] == param and word in error["message"], (body, error)
            assert set(error) == {"message", "type", "param", "code"}
            ok = client.completions.create(model="m", prompt=[1, 2], max_tokens=3, temperature=0)
            assert len(ok.choices) == 1, body
        with pytest.raises(openai.BadRequestError, match="chat template"):  # no tokenizer, so no template
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="m", messages=[])
    assert tiny.kv_stats()["num_used_blocks"] == 0


def test_api_key(tiny):
    with server(tiny, api_key="sesame") as (url, client):
        assert client.completions.create(model="m", prompt=[1], max_tokens=1).choices
        assert httpx.get(f"{url}/v1/models", timeout=DEADLINE_S).status_code == 401
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=DEADLINE_S)
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 200  # health needs no key


def test_metrics_parse_and_count(tiny):
    with server(tiny) as (url, client):
        for n in (3, 5):
            client.completions.create(
                model="m", prompt=[1, 2, 3, 4], max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
            )
        samples = metric_samples(url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in samples
    assert samples["vllm:request_success_total"] == 2
    assert samples["vllm:generation_tokens_total"] == 8 and samples["vllm:prompt_tokens_total"] == 8
    assert samples["vllm:time_to_first_token_seconds_count"] == 2
    assert samples["vllm:e2e_request_latency_seconds_count"] == 2
    assert samples["vllm:request_time_per_output_token_seconds_count"] == 2
    assert samples["vllm:inter_token_latency_seconds_count"] == 2 + 4


def test_a_failing_step_reaches_the_waiting_client(tiny):
    def fail(plan):
        raise RuntimeError("boom")

    with server(tiny) as (url, client):
        tiny.engine.forward_observers.append(fail)
        with pytest.raises(openai.InternalServerError, match="boom"):
            client.completions.create(model="m", prompt=[1, 2], max_tokens=3)
        with pytest.raises(openai.APIError, match="boom"):  # mid-stream: an error event in the stream
            list(client.completions.create(model="m", prompt=[1, 2], max_tokens=3, stream=True))
        tiny.engine.forward_observers.remove(fail)
        assert client.completions.create(model="m", prompt=[1, 2], max_tokens=3).choices  # still serving
    assert tiny.kv_stats()["num_used_blocks"] == 0


class CharTokenizer:
    """Each token id is one string; decoding joins them (enough for the stop-string logic)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def one_token(token: int) -> SequenceUpdate:
    return SequenceUpdate(0, [token], None, None, None)


def test_stop_strings_are_held_back_until_they_are_ruled_out():
    tracker = CompletionTracker(CharTokenizer(["ab", "c", "de", "x", "cd"]), stop=("cde",))
    sent = []
    for token in [0, 1, 3, 1, 2, 4]:  # ab c x c de cd: "cde" appears across the 4th and 5th tokens
        delta = tracker.advance(one_token(token))
        if delta is not None:
            sent.append(delta.text)
        if tracker.finish_reason is not None:
            break
    # the last two characters always wait (they might begin "cde"); the text ends before the stop string
    assert sent == ["", "a", "b", "c", "x"] and tracker.finish_reason == "stop"
    assert tracker.advance(one_token(4)) is None  # nothing after the stop
