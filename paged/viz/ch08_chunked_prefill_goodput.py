"""Chapter 08's plots (guide §12-§13): the gaps between output tokens, latency distributions at several request
rates, and goodput against throughput under several SLOs."""

import matplotlib.pyplot as plt
import numpy as np

from paged.analysis.replay import ReplayResult
from paged.engine.metrics import SLO
from paged.viz.common import PALETTE


def plot_token_gaps(results: dict[str, ReplayResult], request_ids: list[str], title: str = ""):
    """For each replay, the gap before each output token of the given requests against the time it appeared:
    a long prefill in the batch shows as a spike in every running decode's gap."""
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.2), sharey=True, squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        for record in result.requests:
            if record.request_id in request_ids:
                ax.plot(record.token_times[1:], record.itl, marker=".", label=f"req {record.request_id}")
        ax.set(title=label, xlabel="clock (s)")
    axes[0][0].set_ylabel("gap before the token (s)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def empirical_cdf(values) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of values <= each."""
    x = np.sort(np.asarray(values, dtype=float))
    return x, np.arange(1, x.size + 1) / x.size


def plot_latency_cdfs(results: dict[str, dict[float, ReplayResult]], slo: SLO | None = None):
    """Distributions of TTFT, TPOT and each request's worst inter-token gap (rows), one column per request rate,
    one curve per configuration; an SLO's finite limits as dashed lines."""
    rates = sorted(next(iter(results.values())))
    metrics = [
        ("TTFT (s)", lambda r: [r.ttft], "ttft"),
        ("TPOT (s)", lambda r: [r.tpot] if r.tpot else [], "tpot"),
        ("worst gap between tokens (s)", lambda r: [max(r.itl)] if r.itl else [], "itl"),
    ]
    fig, axes = plt.subplots(len(metrics), len(rates), figsize=(3.6 * len(rates), 2.6 * len(metrics)), squeeze=False)
    for row, (name, values, limit) in enumerate(metrics):
        for col, rate in enumerate(rates):
            ax = axes[row][col]
            for label, by_rate in results.items():
                ax.step(
                    *empirical_cdf([v for r in by_rate[rate].requests for v in values(r)]), where="post", label=label
                )
            if slo is not None and np.isfinite(getattr(slo, limit)):
                ax.axvline(getattr(slo, limit), color="k", ls="--", lw=1)
            ax.set(xlabel=name, ylim=(0, 1.02))
        axes[row][0].set_ylabel("fraction of requests")
    for col, rate in enumerate(rates):
        axes[0][col].set_title(f"{rate:g} requests/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_goodput(results: dict[str, dict[float, ReplayResult]], slos: dict[str, SLO]):
    """One panel per SLO: goodput (solid) and throughput (dotted) of each configuration against the offered rate."""
    fig, axes = plt.subplots(1, len(slos), figsize=(4.4 * len(slos), 3.4), sharey=True, squeeze=False)
    for ax, (title, slo) in zip(axes[0], slos.items()):
        for k, (label, by_rate) in enumerate(results.items()):
            rates = sorted(by_rate)
            summaries = [by_rate[rate].summary(slo) for rate in rates]
            colour = PALETTE[k % len(PALETTE)]
            ax.plot(rates, [s["goodput_rps"] for s in summaries], "o-", color=colour, label=f"{label}")
            ax.plot(rates, [s["throughput_rps"] for s in summaries], ":", color=colour)
        ax.set(xlabel="offered load (requests/s)", title=title)
    axes[0][0].set_ylabel("goodput (solid), throughput (dotted), req/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig
