"""benchmarks/vs_vllm.py keeps every configuration it was asked for across runs: a run replaces the ones it measured
again on the same CPU and keeps the rest, and each CPU's runs stay in a section of their own; the steps it times the
matmul ceiling over are the ones the engine computed. vLLM itself never runs here."""

import importlib
import json
from pathlib import Path

import pytest
from helpers import make_tiny_llm, tiny_llama

from paged import SamplingParams


@pytest.fixture
def vs_vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("vs_vllm")


def row(workload, dtype, threads, tok_s):
    return {
        "workload": workload,
        "dtype": dtype,
        "threads": threads,
        "paged": {"tok_s": tok_s},
        "vllm": {"tok_s": 1.0, "versions": {"vllm": "test"}},
    }


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
    assert kept == first[0]  # its own command, date and commit, as measured
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


@pytest.mark.parametrize("budget", [None, 8])
def test_the_ceiling_gets_every_token_the_engine_computed_and_every_row_it_sampled(vs_vllm, tiny_model, budget):
    from throughput import record_steps

    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=4) if budget else {}
    llm = make_tiny_llm(tiny_model, **chunked)
    steps = []
    record_steps(llm.engine, steps)
    prompts, lengths = [list(range(10, 15)), list(range(20, 29))], [3, 1]
    llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths], use_tqdm=False
    )
    # every prompt token once, and every output token but the last of each request (it is sampled, not computed)
    assert sum(tokens for tokens, _ in steps) == sum(map(len, prompts)) + sum(n - 1 for n in lengths)
    assert sum(rows for _, rows in steps) == sum(lengths)  # one logits row for each token sampled
    # whole prompts; or the 9-token prompt in chunks of what the budget leaves, its row in the step that ends it
    assert steps == ([(14, 2), (1, 1), (1, 1)] if budget is None else [(8, 1), (7, 2), (1, 1)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_ceiling_times_the_matmuls_in_the_model_dtype(vs_vllm, dtype):
    """A bf16 model's ceiling is bf16 matmuls (packed as the engine packs them), not an fp32 copy of the model."""
    import torch
    from throughput import Matmuls

    model = tiny_llama().to(getattr(torch, dtype))
    matmuls = Matmuls(model)
    assert matmuls.dtype == model.dtype == getattr(torch, dtype)  # the model given is left in its dtype
    weights = [w for layer in matmuls.layers for w in layer] + [matmuls.lm_head]
    wanted = {getattr(torch, dtype)}
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        wanted.add(torch.float32)  # packed_linear's fp32 copy on a CPU without bf16 matmuls
    assert {w.dtype for w in weights} <= wanted
    assert matmuls.seconds(4, 2, repeats=1) > 0
