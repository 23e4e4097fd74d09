"""Defects found by probing the server and its command line, one test per class, each on cases of its own; after
each bad request the server answers the next one as usual."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import make_tiny_llm, tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from paged import LLM, SamplingParams
from paged.__main__ import main as command_line
from paged.sampling_params import Logprob
from paged.serving.api_server import build_app, chat_logprobs, serve_in_thread, token_bytes

DEADLINE_S = 60.0
PIRATE = str(Path(__file__).resolve().parent.parent / "adapters" / "pirate")
GOOD = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


class RecordingTokenizer:
    """One token per character, and the name of every thread that tokenized text."""

    def __init__(self):
        self.threads = []

    def __call__(self, text, add_special_tokens=False):
        self.threads.append(threading.current_thread().name)
        return {"input_ids": [ord(char) % 200 + 1 for char in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(64 + i % 60) for i in ids)


@pytest.fixture
def tiny():
    return make_tiny_llm(tiny_llama(), num_blocks=16)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    model, tokenizer = smollm2
    return LLM(model=model, tokenizer=tokenizer, num_blocks=64, block_size=16, device="cpu")


def post(url, path, body=None, content=None, **kwargs):
    if content is not None:
        kwargs["headers"] = {"content-type": "application/json", **kwargs.get("headers", {})}
        return httpx.post(f"{url}{path}", content=content, timeout=DEADLINE_S, **kwargs)
    return httpx.post(f"{url}{path}", json=body, timeout=DEADLINE_S, **kwargs)


def assert_error(response, status: int, param, word: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == param and word in error["message"], error


def assert_serving(url) -> None:
    assert post(url, "/v1/completions", GOOD).status_code == 200


def test_lone_surrogates_are_refused_by_field(smollm2_llm):
    with pytest.raises(ValueError, match="prompt holds a lone UTF-16 surrogate at character 2"):
        smollm2_llm.generate("ab\ud800c", SamplingParams(max_tokens=2), use_tqdm=False)
    with serve_in_thread(build_app(smollm2_llm, "m")) as url, httpx.Client(timeout=DEADLINE_S) as client:
        cases = [
            ('{"model": "m", "prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
            ('{"model": "m", "prompt": ["fine", "\\udfff"], "max_tokens": 2}', "prompt"),
            ('{"model": "m", "prompt": [1], "stop": ["\\ud83d"]}', "stop"),
            ('{"model": "m", "messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages"),
        ]
        for content, param in cases:
            path = "/v1/chat/completions" if "messages" in content else "/v1/completions"
            answer = client.post(f"{url}{path}", content=content, headers={"content-type": "application/json"})
            assert_error(answer, 400, param, "surrogate")
            assert answer.headers.get("connection") != "close"  # the connection is kept
            assert client.post(f"{url}/v1/completions", json=GOOD).status_code == 200
        assert_error(post(url, "/tokenize", content='{"prompt": "\\ud800"}'), 400, "prompt", "surrogate")


def test_a_chat_template_that_raises_is_a_400_on_messages(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    try:
        with serve_in_thread(build_app(smollm2_llm, "m")) as url:
            body = {
                "model": "m",
                "max_tokens": 2,
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            }
            assert_error(post(url, "/v1/chat/completions", body), 400, "messages", "System role not supported")
            body["messages"] = body["messages"][1:]
            assert post(url, "/v1/chat/completions", body).status_code == 200
            assert_serving(url)
    finally:
        tokenizer.chat_template = template


def test_a_request_that_arrives_while_a_step_fails_is_served(tiny):
    expected = (
        tiny.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    )
    entered, release, calls = threading.Event(), threading.Event(), []

    def fail_the_first_step(plan):
        calls.append(plan)
        if len(calls) == 1:
            entered.set()
            release.wait(DEADLINE_S)
            raise RuntimeError("boom")

    tiny.engine.forward_observers.append(fail_the_first_step)
    app = build_app(tiny, "m")
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        failing = pool.submit(post, url, "/v1/completions", GOOD)
        assert entered.wait(DEADLINE_S)
        arriving = pool.submit(post, url, "/v1/completions", {**GOOD, "prompt": [4, 5, 6], "return_token_ids": True})
        deadline = time.monotonic() + DEADLINE_S
        while app.state.async_llm._inbox.empty() and time.monotonic() < deadline:  # it waits for the step
            time.sleep(0.01)
        release.set()
        assert_error(failing.result(), 500, None, "boom")
        served = arriving.result()
        assert served.status_code == 200 and served.json()["choices"][0]["token_ids"] == expected
        assert_serving(url)


def test_text_is_tokenized_off_the_engine_loop_and_bodies_are_bounded():
    tokenizer = RecordingTokenizer()
    llm = make_tiny_llm(tiny_llama(), tokenizer=tokenizer, num_blocks=16)
    with serve_in_thread(build_app(llm, "m", max_body_bytes=2**20)) as url, ThreadPoolExecutor(1) as pool:
        stream = pool.submit(
            post, url, "/v1/completions", {**GOOD, "max_tokens": 40, "stream": True, "ignore_eos": True}
        )
        answer = post(url, "/v1/completions", {"model": "m", "prompt": "x" * 500_000})
        assert_error(answer, 400, "prompt", "prompt has 500000 tokens")
        assert_error(post(url, "/v1/completions", {"model": "m", "prompt": "x" * 2**20}), 413, None, "larger")

        def in_chunks(body: bytes):  # no Content-Length: the body's size shows only as it is read
            yield from (body[i : i + 65536] for i in range(0, len(body), 65536))

        chunked = httpx.post(
            f"{url}/v1/completions",
            timeout=DEADLINE_S,
            headers={"content-type": "application/json"},
            content=in_chunks(json.dumps({"model": "m", "prompt": "x" * 2**21}).encode()),
        )
        assert_error(chunked, 413, None, "in chunks")
        small = httpx.post(
            f"{url}/v1/completions",
            timeout=DEADLINE_S,
            headers={"content-type": "application/json"},
            content=in_chunks(json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 2}).encode()),
        )
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
        assert stream.result().text.endswith("data: [DONE]\n\n")
        assert post(url, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2}).status_code == 200
    assert tokenizer.threads and "paged-engine-loop" not in tokenizer.threads


def test_metrics_count_each_completion_of_n_on_its_own(tiny):
    with serve_in_thread(build_app(tiny, "m")) as url:
        body = {
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "n": 3,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
        }
        assert post(url, "/v1/completions", body).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"model_name"}
    }
    assert samples["vllm:inter_token_latency_seconds_count"] == 3 * 4  # 4 gaps in each completion of 5 tokens
    assert samples["vllm:request_time_per_output_token_seconds_count"] == 3
    # the three completions step together: each completion's mean gap is its span / 4, the gaps sum to 3 spans
    assert samples["vllm:inter_token_latency_seconds_sum"] == pytest.approx(
        4 * samples["vllm:request_time_per_output_token_seconds_sum"], rel=1e-6
    )
    assert samples["vllm:generation_tokens_total"] == 15


def test_an_adapter_named_as_the_served_model_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="'m' is the served model's name"):
        build_app(tiny, "m", lora_modules={"m": PIRATE})
    with pytest.raises(SystemExit, match="'smollm2', the served model's name"):
        command_line(["serve", "--lora-modules", f"smollm2={PIRATE}"])
    (tmp_path / "adapter_config.json").write_text('{"r": "eight"')
    with pytest.raises(SystemExit, match="adapter_config.json in .* is malformed"):
        command_line(["serve", "--lora-modules", f"broken={tmp_path}"])
    (tmp_path / "adapter_config.json").write_text('{"r": "eight", "lora_alpha": 16}')
    with pytest.raises(SystemExit, match="r must be a positive number"):
        command_line(["serve", "--lora-modules", f"broken={tmp_path}"])


def test_a_prompt_longer_than_the_model_is_blamed_on_the_prompt(tiny):
    with serve_in_thread(build_app(tiny, "m")) as url:
        for max_tokens in (5, None):
            body = {"model": "m", "prompt": [1] * 600, **({"max_tokens": max_tokens} if max_tokens else {})}
            assert_error(post(url, "/v1/completions", body), 400, "prompt", "prompt has 600 tokens")
        batch = {"model": "m", "prompt": [[1, 2], [1] * 512], "max_tokens": 2}
        assert_error(post(url, "/v1/completions", batch), 400, "prompt[1]", "prompt has 512 tokens")
        assert_serving(url)


def test_the_api_key_guards_every_route_but_health_and_metrics_and_hosts_are_checked(tiny):
    with serve_in_thread(build_app(tiny, "m", api_key="sesame")) as url:
        key = {"Authorization": "Bearer sesame"}
        for path in ("/docs", "/openapi.json", "/v1/models", "/tokenizer_info"):
            assert httpx.get(f"{url}{path}", timeout=DEADLINE_S).status_code == 401, path
            for wrong in ("Bearer sesam", "Bearer sesame!", "sesame", "Bearer " + "x" * 1000):
                assert (
                    httpx.get(f"{url}{path}", headers={"Authorization": wrong}, timeout=DEADLINE_S).status_code == 401
                )
        assert httpx.get(f"{url}/openapi.json", headers=key, timeout=DEADLINE_S).json()["info"]["title"] == "paged"
        assert httpx.get(f"{url}/docs", headers=key, timeout=DEADLINE_S).status_code == 200
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=DEADLINE_S).status_code == 200
        port = url.rsplit(":", 1)[1]
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io", "localhost.evil"):
            assert_error(httpx.get(f"{url}/health", headers={"host": host}, timeout=DEADLINE_S), 400, None, "Host")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(f"{url}/health", headers={"host": host}, timeout=DEADLINE_S).status_code == 200, host
        assert post(url, "/v1/completions", GOOD, headers=key).status_code == 200
    with serve_in_thread(build_app(tiny, "m", allowed_hosts=None)) as url:  # a server bound to a public address
        assert httpx.get(f"{url}/health", headers={"host": "paged.example:80"}, timeout=DEADLINE_S).status_code == 200


def test_logprob_bytes_of_a_token_holding_part_of_a_character_are_its_own(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    for text in ("🍮", "東京", "Zürich"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids]
        assert b"".join(bytes(p) for p in pieces) == text.encode("utf-8"), text
    ids = tokenizer("🍮", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode([ids[0]])  # the case at hand: a partial character
    entries = [{i: Logprob(-0.5, 1, tokenizer.decode([i]))} for i in ids]
    shaped = chat_logprobs(entries, 1, tokenizer)["content"]
    assert b"".join(bytes(item["bytes"]) for item in shaped) == "🍮".encode()
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in shaped)
    with serve_in_thread(build_app(smollm2_llm, "m")) as url:
        answer = post(
            url,
            "/v1/chat/completions",
            {"model": "m", "max_tokens": 6, "logprobs": True, "messages": [{"role": "user", "content": "Say 東京"}]},
        )
        content = answer.json()["choices"][0]["logprobs"]["content"]
        assert (
            bytes(b for item in content for b in item["bytes"]).decode("utf-8", errors="strict")
            == answer.json()["choices"][0]["message"]["content"]
        )


def test_a_request_id_in_use_is_refused_and_the_first_request_keeps_its_tokens(tiny):
    with serve_in_thread(build_app(tiny, "m")) as url, ThreadPoolExecutor(1) as pool:
        body = {
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 60,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
        }
        first = pool.submit(post, url, "/v1/completions", body, headers={"x-request-id": "same"})
        deadline = time.monotonic() + DEADLINE_S
        while not tiny.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.005)
        second = post(url, "/v1/completions", body, headers={"x-request-id": "same"})
        assert_error(second, 400, "request_id", "already in use")
        assert len(first.result(timeout=DEADLINE_S).json()["choices"][0]["token_ids"]) == 60
        assert_serving(url)
