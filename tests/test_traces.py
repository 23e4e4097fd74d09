"""Seeded traces: deterministic, within the model's limits, with the datasets' mean lengths."""

import pytest

from paged.analysis.traces import (
    ALPACA,
    SHAREGPT,
    alpaca_trace,
    clipped_lognormal_mean,
    fit_lognormal_mu,
    make_trace,
    sharegpt_trace,
    trace_stats,
)


@pytest.mark.parametrize("profile", [SHAREGPT, ALPACA], ids=lambda p: p.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_sample_means_land_near_the_targets(profile, seed):
    stats = trace_stats(make_trace(profile, 10_000, seed))
    assert stats["mean_input"] == pytest.approx(profile.mean_input, rel=0.04)
    assert stats["mean_output"] == pytest.approx(profile.mean_output, rel=0.04)


def test_same_seed_same_trace_other_seed_other_trace():
    assert sharegpt_trace(50, seed=3, request_rate=4.0) == sharegpt_trace(50, seed=3, request_rate=4.0)
    assert sharegpt_trace(50, seed=3) != sharegpt_trace(50, seed=4)


def test_lengths_respect_the_model_limits():
    trace = sharegpt_trace(5_000, seed=0, max_model_len=1024, max_input_len=256)
    assert all(1 <= r.input_len <= 256 and 1 <= r.output_len <= 768 and r.final_len <= 1024 for r in trace)
    assert max(r.input_len for r in trace) == 256  # the long tail is really clipped


def test_arrivals_are_poisson_or_all_at_zero():
    assert {r.arrival_time for r in alpaca_trace(20)} == {0.0}
    arrivals = [r.arrival_time for r in alpaca_trace(4_000, request_rate=8.0)]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 8.0, rel=0.05)


def test_fitted_mu_reproduces_the_clipped_mean():
    mu = fit_lognormal_mu(338, 0.9, 0.5, 1024.5)
    assert clipped_lognormal_mean(mu, 0.9, 0.5, 1024.5) == pytest.approx(338, rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_requests=0), "num_requests must be a positive integer"),
        (dict(num_requests=5, max_model_len=1), "max_model_len must be an integer >= 2"),
        (dict(num_requests=5, max_input_len=2048), "max_input_len must lie in"),
        (dict(num_requests=5, request_rate=0), "request_rate must be > 0"),
        (dict(num_requests=5, max_model_len=300), "mean .* must lie strictly between"),  # 338 cannot fit in 150
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trace(SHAREGPT, **kwargs)
