"""The whole completions contract of the server, as clients that score and benchmark send it: batches of prompts,
echo with the prompt's own log-probabilities (what lm-evaluation-harness's local-completions scores with), vLLM's
prompt_logprobs, /tokenize, /detokenize and /tokenizer_info, usage per chunk and cached tokens, request ids, stop
tokens' text; and sampling fields this engine does not implement refused by name, never ignored."""

import contextlib
import json

import httpx
import openai
import pytest
import torch
from helpers import make_tiny_llm, tiny_llama

from paged import LLM, SamplingParams
from paged.serving.api_server import build_app, serve_in_thread

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    model, tokenizer = smollm2
    return LLM(
        model=model,
        tokenizer=tokenizer,
        num_blocks=128,
        block_size=16,
        device="cpu",
        dtype=torch.float32,
        enable_prefix_caching=True,
    )


@pytest.fixture
def tiny():
    return make_tiny_llm(tiny_llama(), num_blocks=16)


@contextlib.contextmanager
def server(llm, name="m", **kwargs):
    with serve_in_thread(build_app(llm, name, **kwargs)) as url:
        yield url
    assert not llm.engine.has_unfinished_requests()


def post(url, path, body, **kwargs):
    return httpx.post(f"{url}{path}", json=body, timeout=DEADLINE_S, **kwargs)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids) - 1, vocab] of tokens 1.. given those before them."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_echo_scores_each_prompt_token_as_transformers_does(smollm2, smollm2_llm):
    """lm-evaluation-harness's loglikelihood request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1
    (and 0, as older versions send). Each echoed token's log-probability is transformers'; the first is null."""
    model, tokenizer = smollm2
    texts = ["The capital of France is Paris", "Two plus two equals four, and three plus three equals six"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    with server(smollm2_llm, "smollm2") as url:
        for max_tokens in (1, 0):
            answer = post(
                url,
                "/v1/completions",
                {
                    "model": "smollm2",
                    "prompt": prompts,
                    "echo": True,
                    "logprobs": 1,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            assert answer.status_code == 200, answer.text
            choices = answer.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            for prompt, text, choice in zip(prompts, texts, choices):
                logprobs, reference = choice["logprobs"], hf_logprobs(model, prompt)
                assert len(logprobs["tokens"]) == len(prompt) + max_tokens
                assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
                assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(
                    [float(reference[j, t]) for j, t in enumerate(prompt[1:])], abs=1e-3
                )
                for chosen, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
                    assert 1 <= len(top) <= 2 and max(top.values()) >= chosen  # the token and the most likely
                assert choice["text"].startswith(text) and "".join(logprobs["tokens"]) == choice["text"]
                assert logprobs["text_offset"][0] == 0 and all(
                    b - a == len(token)
                    for a, b, token in zip(logprobs["text_offset"], logprobs["text_offset"][1:], logprobs["tokens"])
                )
                if max_tokens == 0:
                    assert choice["text"] == text
            usage = answer.json()["usage"]
            assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 2 * max_tokens


def test_batches_of_text_numbered_prompt_times_n_plus_completion(smollm2_llm):
    texts = ["Once upon a time", "The weather today"]
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=11, n=2, ignore_eos=True)
    expected = [[c.text for c in out.outputs] for out in smollm2_llm.generate(texts, params, use_tqdm=False)]
    with server(smollm2_llm, "smollm2") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)
        answer = client.completions.create(
            model="smollm2", prompt=texts, max_tokens=5, temperature=0.8, seed=11, n=2, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text for c in answer.choices] == [t for pair in expected for t in pair]
        chunks = list(
            client.completions.create(
                model="smollm2",
                prompt=texts,
                max_tokens=5,
                temperature=0.8,
                seed=11,
                n=2,
                stream=True,
                echo=True,
                extra_body={"ignore_eos": True},
            )
        )
        streamed = {}
        for chunk in chunks:
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert streamed == {i: texts[i // 2] + expected[i // 2][i % 2] for i in range(4)}


def test_vllms_prompt_logprobs_field_and_cached_tokens(smollm2, smollm2_llm):
    """prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}; asking for it reads no cached
    prefix, and a later request for the same prompt reads the blocks it left (usage's cached_tokens)."""
    model, tokenizer = smollm2
    prompt = tokenizer(
        "A long shared preamble that fills a few blocks of sixteen tokens each, and then a question "
        "about what comes next in this sentence"
    )["input_ids"]
    reference = hf_logprobs(model, prompt)
    with server(smollm2_llm, "smollm2") as url:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        scored = post(url, "/v1/completions", {**body, "prompt_logprobs": 2}).json()
        field = scored["choices"][0]["prompt_logprobs"]
        assert field[0] is None and len(field) == len(prompt)
        for j, (entry, token) in enumerate(zip(field[1:], prompt[1:])):
            assert list(entry)[0] == str(token) and 1 <= len(entry) <= 3
            assert entry[str(token)]["logprob"] == pytest.approx(float(reference[j, token]), abs=1e-3)
            assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert scored["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        again = post(url, "/v1/completions", body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) // 16 * 16
        assert again["choices"][0]["text"] == scored["choices"][0]["text"]
        assert "prompt_logprobs" not in again["choices"][0]


def test_tokenize_detokenize_and_tokenizer_info(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    with server(smollm2_llm, "smollm2") as url:
        answer = post(url, "/tokenize", {"model": "smollm2", "prompt": "Hello world", "return_token_strs": True})
        ids = tokenizer("Hello world")["input_ids"]
        assert answer.json() == {
            "count": len(ids),
            "max_model_len": smollm2_llm.engine.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids),
        }
        assert post(url, "/detokenize", {"model": "smollm2", "tokens": ids}).json() == {"prompt": "Hello world"}
        bad = post(url, "/detokenize", {"tokens": [10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        info = httpx.get(f"{url}/tokenizer_info", timeout=DEADLINE_S).json()
        assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"]
        assert post(url, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_chat_content_may_be_openais_text_parts(smollm2_llm):
    """GuideLLM and the OpenAI client send a message's content as a list of parts: the text ones are joined by
    newlines, as vLLM joins them; any other part is refused naming the message."""
    greedy = {"model": "smollm2", "max_tokens": 6, "temperature": 0}
    with server(smollm2_llm, "smollm2") as url:

        def answer(content):
            reply = post(url, "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": content}]})
            return reply.status_code, reply.json()

        plain = answer("Name a colour.\nOne word.")[1]["choices"][0]["message"]["content"]
        status, parts = answer([{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}])
        assert status == 200 and parts["choices"][0]["message"]["content"] == plain
        status, refused = answer([{"type": "image_url", "image_url": {"url": "data:,"}}])
        assert status == 400 and refused["error"]["param"] == "messages[0]"


def test_usage_per_chunk_request_ids_and_stop_tokens(tiny):
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    greedy = (
        tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    with server(tiny) as url:
        stream = post(
            url,
            "/v1/completions",
            {
                **body,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
        answer = post(url, "/v1/completions", body, headers={"x-request-id": "mine-1"})
        assert answer.headers["x-request-id"] == "mine-1" and answer.json()["id"] == "cmpl-mine-1"
        kept = post(url, "/v1/completions", {**body, "request_id": "client-7"})
        assert kept.json()["id"] == "cmpl-client-7" and kept.headers["x-request-id"] == "client-7"
        stop = greedy[2]  # the engine stops at its third token: a stop token, whose text is left out
        ended = post(url, "/v1/completions", {**body, "stop_token_ids": [stop], "return_token_ids": True}).json()
        assert ended["choices"][0]["token_ids"][-1] == stop and ended["choices"][0]["finish_reason"] == "stop"


STOP_TEXT_PROMPT = "The first three letters of the alphabet are"


def test_a_stop_tokens_text_is_left_out_unless_asked_for(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    greedy = (
        smollm2_llm.generate(
            STOP_TEXT_PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = greedy[1]
    body = {"model": "smollm2", "prompt": STOP_TEXT_PROMPT, "max_tokens": 4, "temperature": 0, "stop_token_ids": [stop]}
    with server(smollm2_llm, "smollm2") as url:
        for include in (False, True):
            for stream in (False, True):
                answer = post(url, "/v1/completions", {**body, "include_stop_str_in_output": include, "stream": stream})
                if stream:
                    text = "".join(
                        json.loads(line[6:])["choices"][0]["text"]
                        for line in answer.text.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]
                    )
                else:
                    text = answer.json()["choices"][0]["text"]
                assert text == tokenizer.decode(greedy[:2] if include else greedy[:1]), (include, stream)


REFUSED = [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"best_of": 3, "n": 2}, "best_of"),
]
NEUTRAL = [
    {"frequency_penalty": 0},
    {"presence_penalty": 0.0},
    {"repetition_penalty": 1},
    {"min_tokens": 0},
    {"logit_bias": {}},
    {"best_of": 2, "n": 2},
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_fields_this_engine_lacks_are_refused_by_name(request, path):
    """Each gets a 400 naming it when set to anything but the value that changes nothing, which is served."""
    chat = path == "/v1/chat/completions"
    llm = request.getfixturevalue("smollm2_llm" if chat else "tiny")  # a chat needs a template
    body = {"model": "m", "max_tokens": 2, "temperature": 1.0}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": [1, 2]})
    with server(llm) as url:
        for extra, param in REFUSED:
            if param == "best_of" and chat:
                continue
            answer = post(url, path, {**body, **extra})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (extra, answer.text)
        for extra in NEUTRAL:
            if "best_of" in extra and chat:
                continue
            assert post(url, path, {**body, **extra}).status_code == 200, extra
