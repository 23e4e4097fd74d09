"""The engine core in a process of its own (serving/engine_core.py), as `python -m paged serve` runs it: the same answers
as LLM.generate, text and stop strings made on the server's side, metrics fed across the pipe, a dead engine core
reported instead of waited on, and no process left behind."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_checkpoints import random_model, save

from paged import LLM, SamplingParams
from paged.serving.api_server import build_app, serve_in_thread, server_defaults
from paged.serving.engine_core import AsyncMPClient

DEADLINE_S = 60.0
PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [9] * 12]
SETTINGS = dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, device="cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save(random_model("llama-1to1-hd64"), tmp_path_factory.mktemp("core") / "model"))


def post(url, body):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)


def test_answers_equal_generate_and_metrics_cross_the_pipe(folder):
    llm = LLM(model=folder, **{**server_defaults(), **SETTINGS})
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    client = AsyncMPClient.start(folder, SETTINGS)
    try:
        assert client.max_model_len == llm.engine.max_model_len and client.token_budget is None
        with serve_in_thread(build_app(client, "m")) as url, ThreadPoolExecutor(3) as pool:
            answers = list(
                pool.map(
                    lambda p: post(
                        url,
                        {
                            "model": "m",
                            "prompt": p,
                            "max_tokens": 12,
                            "temperature": 0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                        },
                    ).json(),
                    PROMPTS,
                )
            )
            for answer, want in zip(answers, expected):
                assert answer["choices"][0]["token_ids"] == want.outputs[0].token_ids
                assert answer["choices"][0]["text"] == want.outputs[0].text
            # a stop string is found on the server's side, which aborts the completion in the engine core
            text = expected[1].outputs[0].text
            stop = text.split()[3]
            stopped = post(
                url,
                {
                    "model": "m",
                    "prompt": PROMPTS[1],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stop": [stop],
                },
            ).json()["choices"][0]
            assert stopped["finish_reason"] == "stop" and stopped["text"] == text[: text.index(stop)]
            streamed = httpx.post(
                f"{url}/v1/completions",
                timeout=DEADLINE_S,
                json={
                    "model": "m",
                    "prompt": PROMPTS[0],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
            ).text
            assert streamed.count("data: ") == 13 and streamed.endswith("data: [DONE]\n\n")
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:  # the stopped request's end reaches the metrics a step later
                metrics = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
                if 'vllm:request_success_total{model_name="m"} 5.0' in metrics:
                    break
                time.sleep(0.05)
            assert 'vllm:request_success_total{model_name="m"} 5.0' in metrics
            assert 'vllm:num_requests_running{model_name="m"} 0.0' in metrics
            assert httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 200
    finally:
        client.shutdown()
    assert not client.is_running and client._core_process.exitcode == 0


def test_every_thread_that_asks_reads_the_engine_core_exit_code():
    # the client's reader thread and shutdown both wait for the process to exit; joining it from both at once
    # left one of them, about one time in two, reading None for a process that had exited with 0
    context = multiprocessing.get_context("fork")
    for _ in range(40):
        client = AsyncMPClient.__new__(AsyncMPClient)
        client._core_process = context.Process(target=time.sleep, args=(0.02,))
        client._exit_lock = threading.Lock()
        client._core_process.start()
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda _: client._exit_code(timeout=DEADLINE_S), range(2))) == [0, 0]


def test_a_dead_engine_core_is_reported_not_waited_on(folder):
    client = AsyncMPClient.start(folder, SETTINGS)
    try:
        with serve_in_thread(build_app(client, "m")) as url:
            body = {
                "model": "m",
                "prompt": PROMPTS[1],
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the first tokens came
                os.kill(client._core_process.pid, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "engine core process has exited" in rest and rest.strip().endswith("data: [DONE]")
            assert httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 503
            answer = post(url, {"model": "m", "prompt": [1, 2], "max_tokens": 2})
            assert answer.status_code == 500 and "engine loop has stopped" in answer.text
    finally:
        client.shutdown()


def test_a_bad_setting_is_raised_from_the_engine_core(folder):
    with pytest.raises(ValueError, match="tensor_parallel_size \\(3\\) must divide the model's 2 query heads"):
        AsyncMPClient.start(folder, {**SETTINGS, "tensor_parallel_size": 3})


def test_the_command_line_serves_from_an_engine_core_and_leaves_no_process(folder):
    port = 8000 + os.getpid() % 1000
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paged",
            "serve",
            "--model",
            folder,
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        answer = post(
            f"http://127.0.0.1:{port}", {"model": "m", "prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True}
        )
        assert answer.json()["usage"]["completion_tokens"] == 4
        children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
        assert children  # the engine core
        server.send_signal(signal.SIGINT)
        server.wait(timeout=DEADLINE_S)
        deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves once it sees the server go
        while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [open(f"/proc/{pid}/cmdline").read() for pid in children if os.path.exists(f"/proc/{pid}")]
        assert not left
    finally:
        server.kill()
