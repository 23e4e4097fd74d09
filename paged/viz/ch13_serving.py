"""Chapter 13's plots (guide §13): one streamed answer as the engine and the client timed it, the block pool
and the queues of a server under load, as its /metrics reported them while the load ran, the serving loop's steps
under three scheduling policies, and two servers' tails against the request rate and request by request (make
bench-serve's results)."""

import matplotlib.pyplot as plt
import numpy as np

from paged.analysis.load_client import LoadResult
from paged.core.sequence import RequestMetrics
from paged.viz.common import PALETTE

SERVER_LABELS = {"paged": "python -m paged serve", "vllm": "vllm serve"}


def stream_timing_series(sent: float, metrics: RequestMetrics, arrivals: list[float]) -> dict[str, np.ndarray]:
    """Milliseconds after the client sent its request: when the engine sampled each token, and when the client
    received each chunk (one per token); the server's arrival stamp as a one-element series."""
    return {
        "arrival": np.array([metrics.arrival_time - sent]) * 1e3,
        "engine": (np.asarray(metrics.token_times) - sent) * 1e3,  # [num_tokens]
        "client": (np.asarray(arrivals) - sent) * 1e3,
    }  # [num_chunks]


def plot_stream_timing(sent: float, metrics: RequestMetrics, arrivals: list[float]):
    """Token index against time since the send, for the engine's stamps and the client's receipts."""
    series = stream_timing_series(sent, metrics, arrivals)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(series["engine"], np.arange(series["engine"].size), ".-", color=PALETTE[0], label="engine samples it")
    ax.plot(
        series["client"],
        np.arange(series["client"].size),
        ".-",
        color=PALETTE[1],
        alpha=0.8,
        label="client receives it",
    )
    ax.axvline(series["arrival"][0], color="grey", ls=":", label="server stamps the arrival")
    ax.set(xlabel="ms after the client sent the request", ylabel="output token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_load(results: dict[str, LoadResult], num_blocks: int):
    """For each load: KV-cache usage (blocks in use / pool) and the running and waiting requests over time, as
    polled from /metrics, with each request's arrival marked below."""
    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 4.6), sharex="col", squeeze=False)
    for column, (label, result) in enumerate(results.items()):
        t = np.array([s["t"] for s in result.samples])  # [num_samples] s
        usage, top = axes[0][column], axes[1][column]
        usage.fill_between(
            t, [s["kv_usage"] * num_blocks for s in result.samples], step="post", color=PALETTE[0], alpha=0.6
        )
        usage.axhline(num_blocks, color="grey", ls="--", lw=1)
        usage.set(title=label, ylabel=f"blocks in use (of {num_blocks})", ylim=(0, num_blocks * 1.08))
        top.step(t, [s["running"] for s in result.samples], where="post", color=PALETTE[2], label="running")
        top.step(t, [s["waiting"] for s in result.samples], where="post", color=PALETTE[3], label="waiting")
        top.plot(
            [r.arrival_time for r in result.records],
            np.zeros(len(result.records)) - 0.5,
            "|",
            color="k",
            ms=8,
            label="arrivals",
        )
        top.set(xlabel="seconds since the load began", ylabel="requests")
        top.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_token_logprobs(content):
    """One chat answer's tokens (OpenAI's logprobs.content: token, logprob, top_logprobs): at each position the
    model's most likely tokens, top to bottom, each cell shaded by its probability; the chosen one outlined."""
    ranks = max(len(item.top_logprobs) for item in content)
    probs = np.zeros((ranks, len(content)))  # [rank, position]
    fig, ax = plt.subplots(figsize=(1.1 * len(content) + 1, 0.55 * ranks + 1.2))
    for x, item in enumerate(content):
        for y, other in enumerate(item.top_logprobs):
            probs[y, x] = np.exp(other.logprob)
            ax.text(
                x,
                y,
                f"{other.token!r}"[1:-1],
                ha="center",
                va="center",
                fontsize=8,
                color="white" if probs[y, x] > 0.6 else "black",
            )
            if other.token == item.token:
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, lw=2, color=PALETTE[1]))
    image = ax.imshow(probs, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ax.set(
        xticks=range(len(content)),
        yticks=range(ranks),
        yticklabels=[f"#{r + 1}" for r in range(ranks)],
        xlabel="output token",
        ylabel="the model's rank",
    )
    fig.colorbar(image, ax=ax, label="probability", fraction=0.03)
    fig.tight_layout()
    return fig


POLICY_LABELS = {
    "whole": "whole prompts, 2048 tokens a step",
    "chunked-2048": "chunked, 2048 tokens a step",
    "sized-every-step": "chunked, budget sized for the machine, in every step",
    "sized": "chunked, budget sized for the machine",
}


def plot_step_trace(trace: dict):
    """benchmarks/serve_trace.py's file: for each scheduling policy, every step's wall time against the prompt
    tokens it ran (left), and the client's ITL and TTFT p99 under that policy (right)."""
    fig, (steps_ax, tails_ax) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    names = list(trace["policies"])
    for color, name in zip(PALETTE, names):
        steps = trace["policies"][name]["steps"]
        tokens = np.array([s["prompt_tokens"] for s in steps])  # [num_steps]
        times = np.array([s["duration"] for s in steps]) * 1e3  # [num_steps] ms
        budget = trace["policies"][name]["settings"]["max_num_batched_tokens"]
        steps_ax.scatter(
            tokens, times, s=10, color=color, alpha=0.6, label=f"{POLICY_LABELS.get(name, name)} ({budget})"
        )
    steps_ax.set(xlabel="prompt tokens in the step", ylabel="step time (ms)", title="every step of the serving loop")
    steps_ax.legend(fontsize=7)
    width = 0.8 / len(names)
    for i, (color, name) in enumerate(zip(PALETTE, names)):
        summary = trace["policies"][name]["summary"]
        tails_ax.bar(
            np.arange(2) + (i - (len(names) - 1) / 2) * width,
            [summary["itl_p99"] * 1e3, summary["ttft_p99"] * 1e3],
            width,
            color=color,
        )
    tails_ax.set_xticks(np.arange(2), ["ITL p99", "TTFT p99"])
    tails_ax.set(ylabel="ms", title="what the clients saw")
    fig.tight_layout()
    return fig


def plot_servers_by_rate(comparison: dict, client: str = "vllm-bench", workload: str = "random"):
    """make bench-serve's file: TTFT p99, ITL p99, output throughput and the share of requests in the SLO against the
    request rate, one line per server."""
    rows = [r for r in comparison["summary"] if r["client"] == client and r["workload"] == workload]
    panels = [
        ("ttft_p99", "TTFT p99 (s)", 1),
        ("itl_p99", "ITL p99 (ms)", 1e3),
        ("output_tok_s", "output tokens/s", 1),
        ("slo_attainment", "share in the SLO", 1),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3))
    for color, server in zip(PALETTE, ("paged", "vllm")):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        for ax, (key, label, scale) in zip(axes, panels):
            ax.plot(
                [r["rate"] for r in mine],
                [r[key] * scale for r in mine],
                "o-",
                color=color,
                label=SERVER_LABELS[server],
            )
            ax.set(xlabel="requests/s", ylabel=label, xscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_ttft_by_send_time(comparison: dict, round_: int, slo_ttft_s: float):
    """One round of a run saved with each request (make bench-serve with vLLM's client): every request's TTFT against
    when it was sent, one line per server (the same arrivals for both), and the SLO's TTFT."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for color, server in zip(PALETTE, ("paged", "vllm")):
        (run,) = (r for r in comparison["runs"] if r["server"] == server and r["round"] == round_)
        ax.plot(
            [q["sent_s"] for q in run["requests"]],
            [q["ttft_s"] for q in run["requests"]],
            ".-",
            color=color,
            label=SERVER_LABELS[server],
        )
    ax.axhline(slo_ttft_s, color="grey", linestyle=":", label="the SLO's TTFT")
    ax.set(xlabel="sent at (s after the first request)", ylabel="TTFT (s)", title=f"round {round_}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
