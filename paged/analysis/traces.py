"""Seeded request traces with ShareGPT- and Alpaca-like lengths (the workloads of the paper's §6, used in §1, §3, §8).

The vLLM paper (arXiv 2309.06180) serves two datasets: ShareGPT conversations, long and varied (mean input 161
tokens, mean output 338), and Alpaca instructions, short (mean input 19, mean output 58). We ship no data:
each length is drawn from a log-normal distribution whose location is solved so that, after rounding and
clipping to the model's limits, its mean is the dataset's. The spreads (sigma) are our choice, wide for
ShareGPT and narrower for Alpaca, in the spirit of the paper's Figure 11.

A request's prompt is clipped to [1, max_input_len] and its output to [1, max_model_len - max_input_len], so
that input + output never exceeds max_model_len (2,048 by default, as for the paper's OPT models).
Arrivals are a Poisson process at `request_rate` requests per second, or all at time 0 when it is None.
The same seed always gives the same trace.
"""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    request_id: int
    input_len: int  # prompt tokens
    output_len: int  # tokens the request will generate before it stops
    arrival_time: float  # seconds from the start of the trace

    @property
    def final_len(self) -> int:
        """Tokens in its KV cache when it finishes."""
        return self.input_len + self.output_len


@dataclass(frozen=True)
class LengthProfile:
    name: str
    mean_input: float
    mean_output: float
    sigma_input: float  # log-space spread of the input length
    sigma_output: float  # log-space spread of the output length


SHAREGPT = LengthProfile("sharegpt", mean_input=161, mean_output=338, sigma_input=1.0, sigma_output=0.9)
ALPACA = LengthProfile("alpaca", mean_input=19, mean_output=58, sigma_input=0.7, sigma_output=0.8)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for log X ~ Normal(mu, sigma^2), in closed form.

    = low * P(X < low) + E[X; low <= X <= high] + high * P(X > high), where
    E[X; X in [low, high]] = exp(mu + sigma^2 / 2) * (Phi(b - sigma) - Phi(a - sigma)), a, b = standardised logs.
    """
    a = (math.log(low) - mu) / sigma
    b = (math.log(high) - mu) / sigma
    middle = math.exp(mu + sigma**2 / 2) * (_normal_cdf(b - sigma) - _normal_cdf(a - sigma))
    return low * _normal_cdf(a) + middle + high * (1 - _normal_cdf(b))


def fit_lognormal_mu(mean: float, sigma: float, low: float, high: float) -> float:
    """The mu whose clipped log-normal has the given mean (bisection; the clipped mean grows with mu)."""
    if not low < mean < high:
        raise ValueError(f"mean ({mean}) must lie strictly between the clip limits {low} and {high}")
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_lognormal_mean(mid, sigma, low, high) < mean else (lo, mid)
    return (lo + hi) / 2


def _sample_lengths(rng: np.random.Generator, num: int, mean: float, sigma: float, high: int) -> np.ndarray:
    # Integer lengths in [1, high]. Limits of 0.5 and high + 0.5 make the continuous clip match rounding.
    mu = fit_lognormal_mu(mean, sigma, 0.5, high + 0.5)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=num)), 1, high).astype(np.int64)  # [num]


def make_trace(
    profile: LengthProfile,
    num_requests: int,
    seed: int = 0,
    max_model_len: int = 2048,
    max_input_len: int | None = None,
    request_rate: float | None = None,
) -> list[TraceRequest]:
    """num_requests requests with `profile`'s length statistics, deterministic for a seed.

    max_input_len defaults to max_model_len // 2; outputs are clipped to max_model_len - max_input_len.
    request_rate: mean arrivals per second of a Poisson process; None puts every arrival at time 0.
    """
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    if not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
    max_input_len = max_model_len // 2 if max_input_len is None else max_input_len
    if not 1 <= max_input_len < max_model_len:
        raise ValueError(f"max_input_len must lie in [1, max_model_len - 1 = {max_model_len - 1}], got {max_input_len}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (or None), got {request_rate}")
    rng = np.random.default_rng(seed)
    inputs = _sample_lengths(rng, num_requests, profile.mean_input, profile.sigma_input, max_input_len)
    outputs = _sample_lengths(
        rng, num_requests, profile.mean_output, profile.sigma_output, max_model_len - max_input_len
    )
    if request_rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1 / request_rate, size=num_requests))  # [num_requests] seconds
    return [
        TraceRequest(i, int(n_in), int(n_out), float(t))
        for i, (n_in, n_out, t) in enumerate(zip(inputs, outputs, arrivals))
    ]


def sharegpt_trace(num_requests: int, seed: int = 0, **kwargs) -> list[TraceRequest]:
    """ShareGPT-like: mean input 161, mean output 338 tokens."""
    return make_trace(SHAREGPT, num_requests, seed, **kwargs)


def alpaca_trace(num_requests: int, seed: int = 0, **kwargs) -> list[TraceRequest]:
    """Alpaca-like: mean input 19, mean output 58 tokens."""
    return make_trace(ALPACA, num_requests, seed, **kwargs)


def trace_stats(trace: list[TraceRequest]) -> dict:
    """Mean and max of input, output and final lengths."""
    inputs = np.array([r.input_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    return {
        "num_requests": len(trace),
        "mean_input": float(inputs.mean()),
        "mean_output": float(outputs.mean()),
        "max_input": int(inputs.max()),
        "max_output": int(outputs.max()),
        "mean_final": float((inputs + outputs).mean()),
        "max_final": int((inputs + outputs).max()),
    }
