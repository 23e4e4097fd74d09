"""Time to first token by prompt length, on an idle server or beside streams decoding (guide §11 prefill, §13 TTFT):
where a tail under load starts.

    python benchmarks/ttft_by_length.py \
        --server "paged=python -m paged serve --port 8011 --served-model-name smollm2" \
        --server "vllm=vllm serve <the same model folder> --port 8011 --served-model-name smollm2 --dtype float32"

Each server is started by its command, waited for (/health), timed, and stopped, in turns A B A B (--rounds), so
that a slow spell of the machine falls on all of them; never two at once, as an idle server's threads can still
spin on the cores the other one computes on. By default one streamed request at a time, so no request waits for
another: its TTFT is the front end, the prompt's prefill steps and the first token's way back, nothing else. Every
prompt is new random token ids (no prefix-cache hit anywhere).

Two settings bring back a part of load at a time. With --streams N, N other streams decode all the while (each
restarted with a new prompt when it ends), so that every timed prompt is computed in a step with N decodes, as under
load, without the queueing of random arrivals. With --burst K, K prompts of each length are sent at once, and the
last of their first tokens is timed: a step, or several, computing a burst's prompts.

Printed: each server's median TTFT at each length over all rounds, and each median against the first server's.
"""

import argparse
import concurrent.futures
import os
import random
import signal
import statistics
import subprocess
import threading
import time

import httpx


def first_token_seconds(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion of `prompt` to its first chunk of text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True, "temperature": 0}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError(f"{url} streamed no token")


def burst_first_token_seconds(url: str, model: str, prompts: list[list[int]]) -> float:
    """Seconds from sending all of `prompts` at once, each from a thread and a connection of its own, until the last
    of them has its first chunk of text: the first token of a burst's last request."""
    start = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> float:
        with httpx.Client(timeout=300) as client:
            start.wait()
            return first_token_seconds(client, url, model, prompt)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return max(pool.map(one, prompts))


def keep_streaming(url: str, model: str, seed: int, stop: threading.Event) -> None:
    """One stream decoding until `stop` is set: streamed completions of new 64-token prompts, one after another."""
    rng = random.Random(seed)
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            prompt = [rng.randrange(1000, 40000) for _ in range(64)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1024, "stream": True, "ignore_eos": True}
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    if stop.is_set():
                        break  # closing the stream aborts the request


def start_server(command: str, url: str) -> subprocess.Popen:
    """Run `command` in a process group of its own and wait, at most 10 minutes, until `url`/health answers."""
    server = subprocess.Popen(command, shell=True, start_new_session=True, stdout=subprocess.DEVNULL)
    for _ in range(1200):
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was healthy: {command}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server, url)
    raise RuntimeError(f"the server was not healthy within 10 minutes: {command}")


def stop_server(server: subprocess.Popen, url: str) -> None:
    """Stop the server's whole process group, and wait until nothing answers at `url` (the shell that ran a
    compound command can end before the server it started has let go of the port)."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    for _ in range(60):
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            return
        time.sleep(0.5)
    raise RuntimeError(f"a server still answers at {url} after it was stopped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=COMMAND; the first is the baseline")
    parser.add_argument("--url", default="http://127.0.0.1:8011", help="where every server's command listens")
    parser.add_argument("--model", default="smollm2", help="the served model name")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 384, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="requests per length, server and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=0, help="other streams decoding while each prompt is timed")
    parser.add_argument("--burst", type=int, default=1, help="prompts sent at once; timed: the last first token")
    args = parser.parse_args()
    servers = dict(entry.split("=", 1) for entry in args.server)
    times = {name: {length: [] for length in args.lengths} for name in servers}
    for round_number in range(args.rounds):
        for name, command in servers.items():
            rng = random.Random(args.seed + round_number)  # every server gets the same prompts in a round
            new_prompt = lambda length: [rng.randrange(1000, 40000) for _ in range(length)]  # noqa: E731
            server = start_server(command, args.url)
            stop = threading.Event()
            streams = [
                threading.Thread(target=keep_streaming, args=(args.url, args.model, 1000 * round_number + i, stop))
                for i in range(args.streams)
            ]
            try:
                with httpx.Client(timeout=300) as client:
                    first_token_seconds(client, args.url, args.model, new_prompt(64))  # not timed: a warm-up
                    for stream in streams:
                        stream.start()
                    time.sleep(3.0 if streams else 0.0)  # the streams' own prompts computed: they decode
                    for length in args.lengths:
                        for _ in range(args.repeats):
                            if args.burst == 1:
                                seconds = first_token_seconds(client, args.url, args.model, new_prompt(length))
                            else:
                                prompts = [new_prompt(length) for _ in range(args.burst)]
                                seconds = burst_first_token_seconds(args.url, args.model, prompts)
                            times[name][length].append(seconds)
            finally:
                stop.set()
                for stream in streams:
                    stream.join()
                stop_server(server, args.url)
            print(f"round {round_number + 1}: {name} done", flush=True)
    print(f"{'prompt':>7} " + " ".join(f"{name + ' ms':>12}" for name in servers) + "   against the first")
    for length in args.lengths:
        medians = {name: statistics.median(times[name][length]) for name in servers}
        baseline = medians[next(iter(servers))]
        ratios = " ".join(f"{name} {median / baseline:.2f}x" for name, median in medians.items())
        print(f"{length:>7} " + " ".join(f"{median * 1e3:>12.0f}" for median in medians.values()) + f"   {ratios}")


if __name__ == "__main__":
    main()
