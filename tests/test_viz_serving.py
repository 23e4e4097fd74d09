"""Chapter 13's plot of a run's first tokens request by request, from make bench-serve's file."""

import matplotlib

matplotlib.use("Agg")

from paged.viz import plot_ttft_by_send_time  # noqa: E402


def test_plot_ttft_by_send_time_draws_each_server_round_and_the_slo():
    def run(server, round_, ttfts):
        requests = [{"sent_s": float(i), "prompt_tokens": 300, "ttft_s": t} for i, t in enumerate(ttfts)]
        return {"server": server, "round": round_, "requests": requests}

    comparison = {
        "runs": [run("paged", 1, [0.5, 1.0]), run("vllm", 1, [0.7, 2.5]), run("paged", 2, [9.0, 9.0])],
    }
    fig = plot_ttft_by_send_time(comparison, round_=1, slo_ttft_s=2.0)
    (ax,) = fig.axes
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["python -m paged serve"] == [0.5, 1.0] and lines["vllm serve"] == [0.7, 2.5]
    assert lines["the SLO's TTFT"] == [2.0, 2.0]
