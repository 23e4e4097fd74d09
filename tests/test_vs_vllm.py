"""benchmarks/vs_vllm.py keeps every configuration it was asked for across runs: a run replaces the ones it measured
again on the same CPU and keeps the rest, and each CPU's runs stay in a section of their own. vLLM itself never runs
here."""

import importlib
import json
from pathlib import Path

import pytest


@pytest.fixture
def vs_vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("vs_vllm")


def row(workload, dtype, threads, tok_s):
    return {"workload": workload, "dtype": dtype, "threads": threads, "paged": {"tok_s": tok_s},
            "vllm": {"tok_s": 1.0, "versions": {"vllm": "test"}}}


def test_a_run_replaces_what_it_measured_again_and_keeps_the_rest_in_matrix_order(vs_vllm, tmp_path, monkeypatch):
    out = tmp_path / "vs_vllm.json"
    monkeypatch.setattr("sys.argv", ["vs_vllm.py", "--workloads", "steady"])
    vs_vllm.save([row("steady", "float32", 1, 10.0), row("fixed", "bfloat16", 2, 20.0)], str(out))
    first = json.loads(out.read_text())["machines"][0]["configurations"]
    monkeypatch.setattr("sys.argv", ["vs_vllm.py", "--workloads", "fixed"])
    vs_vllm.save([row("steady", "float32", 1, 30.0), row("fixed", "float32", 1, 40.0)], str(out))
    machines = json.loads(out.read_text())["machines"]
    assert len(machines) == 1
    saved = machines[0]
    found = [(r["workload"], r["dtype"], r["threads"], r["paged"]["tok_s"]) for r in saved["configurations"]]
    assert found == [("fixed", "float32", 1, 40.0), ("fixed", "bfloat16", 2, 20.0), ("steady", "float32", 1, 30.0)]
    kept = saved["configurations"][1]
    assert kept == first[0]                                    # its own command, date and commit, as measured
    assert kept["command"].endswith("--workloads steady")
    assert saved["configurations"][0]["command"].endswith("--workloads fixed")
    assert all(r["commit"] for r in saved["configurations"])
    assert saved["configurations_asked"] == len(vs_vllm.MATRIX) and saved["cpu"] == vs_vllm.cpu_description()


def test_another_cpus_section_is_kept_as_it_was(vs_vllm, tmp_path):
    out = tmp_path / "vs_vllm.json"
    vs_vllm.save([row("fixed", "float32", 1, 10.0)], str(out))
    earlier = json.loads(out.read_text())
    earlier["machines"][0]["cpu"] = {**earlier["machines"][0]["cpu"], "model": "another CPU"}
    out.write_text(json.dumps(earlier))
    vs_vllm.save([row("steady", "float32", 2, 20.0)], str(out))
    vs_vllm.save([row("fixed", "float32", 2, 30.0)], str(out))
    other, this = json.loads(out.read_text())["machines"]
    assert other == earlier["machines"][0]
    assert this["cpu"] == vs_vllm.cpu_description()
    assert [(r["workload"], r["threads"]) for r in this["configurations"]] == [("fixed", 2), ("steady", 2)]
