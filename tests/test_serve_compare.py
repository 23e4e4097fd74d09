"""benchmarks/serve_compare.py reads the three clients' result files of `make bench-serve` into one shape (seconds),
averages the rounds, and compares the servers rate by rate. The files here are shaped as the clients write them;
no server runs."""

import importlib
import json
from pathlib import Path

import pytest


@pytest.fixture
def serve_compare(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("serve_compare")


def vllm_bench(ttft_p99_ms, itl_p99_ms, out_tok_s, goodput, completed=20, failed=0, duration=10.0):
    """The fields of `vllm bench serve --save-result` the comparison reads (times in ms)."""
    saved = {
        "request_throughput": completed / duration,
        "output_throughput": out_tok_s,
        "request_goodput": goodput,
        "completed": completed,
        "failed": failed,
        "duration": duration,
    }
    for name, p99 in (("ttft", ttft_p99_ms), ("itl", itl_p99_ms), ("tpot", 50.0), ("e2el", 5000.0)):
        saved[f"p50_{name}_ms"], saved[f"p99_{name}_ms"] = p99 / 2, p99
    return saved


def guidellm(ttft_p99_ms, successful=10, duration=5.0, late_s=(0.0,)):
    """The fields of GuideLLM 0.8.1's `--output kind=json` report the comparison reads (times in ms, latency in s);
    its requests go out late_s after their arrival times (cycled over them)."""

    def stats(p50, p99):
        return {"successful": {"percentiles": {"p50": p50, "p99": p99}}}

    metrics = {
        "request_totals": {"successful": successful, "errored": 1, "incomplete": 0},
        "output_token_count": {"successful": {"total_sum": 500}},
        "time_to_first_token_ms": stats(ttft_p99_ms / 2, ttft_p99_ms),
        "inter_token_latency_ms": stats(40.0, 60.0),
        "time_per_output_token_ms": stats(45.0, 70.0),
        "request_latency": stats(3.0, 4.0),
    }
    requests = [
        {"info": {"timings": {"targeted_start": 100.0 + i, "request_start": 100.0 + i + late_s[i % len(late_s)]}}}
        for i in range(successful)
    ]
    return {"benchmarks": [{"metrics": metrics, "duration": duration, "requests": {"successful": requests}}]}


def write(folder: Path, name: str, saved: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(saved))


def test_every_client_in_seconds_rounds_averaged_and_servers_compared_rate_by_rate(serve_compare, tmp_path):
    write(tmp_path, "paged_vllm-bench_random_1_r1", vllm_bench(1000, 200, 100, 2.0))
    write(tmp_path, "paged_vllm-bench_random_1_r2", vllm_bench(3000, 400, 120, 1.0))
    write(tmp_path, "vllm_vllm-bench_random_1_r1", vllm_bench(1500, 500, 100, 2.0))
    write(tmp_path, "vllm_vllm-bench_random_1_r2", vllm_bench(1500, 500, 100, 2.0))
    write(tmp_path, "paged_vllm-bench_random_4_r1", vllm_bench(9000, 300, 90, 0.5))
    write(tmp_path, "vllm_vllm-bench_random_4_r1", vllm_bench(5000, 900, 110, 1.9))
    write(tmp_path, "paged_guidellm_synthetic_2_r1", guidellm(800))
    write(tmp_path, "paged_serve-bench_sharegpt_2_r1", {"summary": {name: 1.0 for name in serve_compare.FIGURES}})
    write(tmp_path, "paged_vllm-bench_sharegpt_2_r1", vllm_bench(700, 150, 80, 1.8))  # ShareGPT-like file, every round
    write(tmp_path, "vllm_vllm-bench_sharegpt_2_r1", vllm_bench(600, 300, 90, 1.9))
    runs = serve_compare.read_runs(tmp_path)
    assert len(runs) == 10
    rows = {(r["client"], r["workload"], r["rate"], r["server"]): r for r in serve_compare.average(runs)}
    paged = rows[("vllm-bench", "random", 1.0, "paged")]
    assert paged["rounds"] == 2 and paged["ttft_p99"] == pytest.approx(2.0) and paged["itl_p99"] == pytest.approx(0.3)
    assert paged["output_tok_s"] == pytest.approx(110) and paged["goodput_rps"] == pytest.approx(1.5)
    assert paged["slo_attainment"] == pytest.approx((2.0 * 10 / 20 + 1.0 * 10 / 20) / 2)  # met / sent, per round
    guide = rows[("guidellm", "synthetic", 2.0, "paged")]
    assert guide["ttft_p99"] == pytest.approx(0.8) and guide["itl_p99"] == pytest.approx(0.06)
    assert guide["tpot_p99"] == pytest.approx(0.06)  # vLLM's TPOT leaves out the first token, as GuideLLM's ITL does
    assert guide["throughput_rps"] == pytest.approx(2.0) and guide["output_tok_s"] == pytest.approx(100)
    assert guide["failures"] == 1
    compared = serve_compare.comparisons(list(rows.values()))
    at = {c["rate"]: c for c in compared["at_rates"]}
    assert at[1.0]["itl p99 <= vllm"] and at[1.0]["output tok/s >= vllm"]
    assert not at[1.0]["ttft p99 <= vllm"] and not at[1.0]["goodput >= vllm"]  # 2 s against 1.5; 1.5 against 2
    assert at[1.0]["itl p99 ratio"] == pytest.approx(0.6)
    assert at[4.0]["itl p99 <= vllm"] and not at[4.0]["ttft p99 <= vllm"]
    assert compared["highest_rate_90pct_slo"] == {"paged": None, "vllm": 4.0}  # 19 of 20 met at 4 req/s
    assert compared["highest_rate_90pct_slo_over_vllm"] == {"paged": None}
    sharegpt = next(c for c in compared["at_rates"] if c["workload"] == "sharegpt")  # beside serve_bench.py's run
    assert sharegpt["client"] == "vllm-bench" and sharegpt["rate"] == 2.0 and sharegpt["itl p99 <= vllm"]
    assert not sharegpt["ttft p99 <= vllm"] and sharegpt["itl p99 ratio"] == pytest.approx(0.5)
    assert rows[("serve-bench", "sharegpt", 2.0, "paged")]["ttft_p99"] == 1.0


def test_the_tables_show_every_client_and_workload(serve_compare, tmp_path, capsys):
    write(tmp_path, "paged_vllm-bench_sharegpt_0.5_r1", vllm_bench(700, 150, 80, 0.5))
    write(tmp_path, "vllm_vllm-bench_sharegpt_0.5_r1", vllm_bench(600, 300, 90, 0.5))
    write(tmp_path, "paged_guidellm_synthetic_0.5_r1", guidellm(800))
    rows = serve_compare.average(serve_compare.read_runs(tmp_path))
    serve_compare.print_tables(rows, serve_compare.comparisons(rows), [])
    out = capsys.readouterr().out
    assert "vllm-bench, sharegpt prompts (mean of the rounds)" in out and "guidellm, synthetic prompts" in out
    assert "vllm-bench, sharegpt, 0.5 req/s: goodput >= vllm yes, ttft p99 <= vllm NO" in out


def test_guidellm_counts_no_goodput_so_none_is_compared(serve_compare, tmp_path, capsys):
    write(tmp_path, "paged_guidellm_synthetic_2_r1", guidellm(800))
    write(tmp_path, "vllm_guidellm_synthetic_2_r1", guidellm(900))
    rows = serve_compare.average(serve_compare.read_runs(tmp_path))
    compared = serve_compare.comparisons(rows)
    (at,) = compared["at_rates"]
    assert at["goodput >= vllm"] is None and at["ttft p99 <= vllm"]
    serve_compare.print_tables(rows, compared, [])
    assert "guidellm, synthetic, 2 req/s: goodput >= vllm not counted, ttft p99 <= vllm yes" in capsys.readouterr().out


def test_a_guidellm_run_that_sent_its_requests_late_is_kept_out_of_the_comparison(serve_compare, tmp_path, capsys):
    # as GuideLLM 0.8.1's Poisson profile did once its arrival clock was read unset: every request at once
    write(tmp_path, "paged_guidellm_synthetic_2_r1", guidellm(9000, late_s=(0.0, 30.0, 0.5)))
    write(tmp_path, "vllm_guidellm_synthetic_2_r1", guidellm(900, late_s=(0.0, 0.9)))  # on time: within a second
    runs = serve_compare.read_runs(tmp_path)
    late = {r["server"]: r["left_out"] for r in runs}
    assert late == {"paged": "3 of 10 requests went out more than 1 s after their arrival time", "vllm": None}
    rows = serve_compare.average(runs)
    assert [r["server"] for r in rows] == ["vllm"]
    compared = serve_compare.comparisons(rows)
    assert compared["at_rates"] == []  # no pair left to compare at 2 req/s
    serve_compare.print_tables(rows, compared, runs)
    out = capsys.readouterr().out
    assert "left out: paged, guidellm, synthetic, 2 req/s, round 1: 3 of 10 requests went out more than 1 s" in out


def test_the_comparison_file_says_how_each_server_ran(serve_compare, tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs, "paged_vllm-bench_random_0.5_r1", vllm_bench(400, 100, 50, 0.5))
    out = tmp_path / "serve_vs_vllm.json"
    serve_compare.main([str(runs), "--out", str(out), "--how", "cores=0-1", "paged=python -m paged serve"])
    saved = json.loads(out.read_text())
    assert saved["how"] == {"cores": "0-1", "paged": "python -m paged serve"}
    assert [r["rate"] for r in saved["summary"]] == [0.5] and len(saved["runs"]) == 1
    assert "0.5 paged" in capsys.readouterr().out


def test_a_detailed_run_keeps_its_requests_in_the_order_sent(serve_compare, tmp_path):
    detailed = {
        **vllm_bench(900, 100, 50, 0.5, completed=2, failed=1),
        "start_times": [105.5, 104.0, 105.0],
        "input_lens": [300, 128, 512],
        "ttfts": [0.9, 0.2, 0.0],
        "errors": ["", "", "the server hung up"],
    }
    write(tmp_path, "paged_vllm-bench_random_1_r1", detailed)
    write(tmp_path, "vllm_vllm-bench_random_1_r1", vllm_bench(800, 100, 50, 0.5))
    runs = {run["server"]: run for run in serve_compare.read_runs(tmp_path)}
    assert runs["paged"]["requests"] == [
        {"sent_s": 0.0, "prompt_tokens": 128, "ttft_s": 0.2},
        {"sent_s": 1.5, "prompt_tokens": 300, "ttft_s": 0.9},
    ]
    assert runs["vllm"]["requests"] is None  # saved without --save-detailed


def test_a_budget_sweep_compares_each_budget_with_vllm(serve_compare, tmp_path, capsys):
    write(tmp_path, "paged_vllm-bench_random_2_r1", vllm_bench(3000, 200, 100, 1.0))
    write(tmp_path, "paged-b512_vllm-bench_random_2_r1", vllm_bench(1000, 400, 120, 2.0))
    write(tmp_path, "vllm_vllm-bench_random_2_r1", vllm_bench(1500, 500, 110, 1.9))
    rows = serve_compare.average(serve_compare.read_runs(tmp_path))
    compared = serve_compare.comparisons(rows)
    by_server = {c["server"]: c for c in compared["at_rates"]}
    assert set(by_server) == {"paged", "paged-b512"}
    assert not by_server["paged"]["ttft p99 <= vllm"] and by_server["paged-b512"]["ttft p99 <= vllm"]
    assert by_server["paged-b512"]["output tok/s >= vllm"] and not by_server["paged"]["output tok/s >= vllm"]
    assert compared["highest_rate_90pct_slo"] == {"paged": None, "paged-b512": 2.0, "vllm": 2.0}
    assert compared["highest_rate_90pct_slo_over_vllm"] == {
        "paged": None,
        "paged-b512": {"ratio": 1.0, "more_than": False},
    }
    serve_compare.print_tables(rows, compared, [])
    assert "paged-b512, vllm-bench, random, 2 req/s: goodput >= vllm yes" in capsys.readouterr().out


def test_where_vllm_met_the_slo_share_at_no_rate_the_ratio_is_a_bound_from_the_lowest_rate(
    serve_compare, tmp_path, capsys
):
    # goodput (req/s) over a 10 s run of 20 requests: 2.0 is all 20 in the SLO, 1.0 is half
    for rate, met_paged, met_vllm in ((0.25, 2.0, 1.0), (0.5, 2.0, 1.0), (1, 0.5, 0.5)):
        write(tmp_path, f"paged_vllm-bench_random_{rate}_r1", vllm_bench(1000, 200, 100, met_paged))
        write(tmp_path, f"vllm_vllm-bench_random_{rate}_r1", vllm_bench(1000, 200, 100, met_vllm))
    rows = serve_compare.average(serve_compare.read_runs(tmp_path))
    compared = serve_compare.comparisons(rows)
    assert compared["highest_rate_90pct_slo"] == {"paged": 0.5, "vllm": None}
    # vLLM's rate lies below 0.25 req/s, the lowest measured, so this server's 0.5 is more than twice it
    assert compared["highest_rate_90pct_slo_over_vllm"] == {"paged": {"ratio": 2.0, "more_than": True}}
    serve_compare.print_tables(rows, compared, [])
    assert "paged over vllm: more than 2.00x" in capsys.readouterr().out
