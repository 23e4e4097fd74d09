"""benchmarks/step_profile.py puts every op of a step in a part; the parts it names must be the ones that run."""

import importlib
from pathlib import Path

import pytest
from helpers import make_tiny_llm, random_prompts, require_cpu_kernel, tiny_llama

from paged import SamplingParams


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_each_part_of_a_decode_step_is_found(monkeypatch, backend):
    if backend == "cpu":
        require_cpu_kernel()  # its parts are the C++ kernel's ops
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    step_profile = importlib.import_module("step_profile")
    engine = make_tiny_llm(tiny_llama(), attention_backend=backend).engine
    for prompt in random_prompts(6):
        engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    engine.step()  # the prefill; the profiled steps are decodes
    plain_ms, outside_ms, wall_ms, parts = step_profile.profile_steps(engine, steps=3)
    # If torch renames an op, its time would fall into "other ops" and the profile would mislead: fail instead.
    for name in set(step_profile.parts_of(backend).values()):
        assert parts.get(name, 0.0) > 0, name
    assert abs(sum(parts.values()) - wall_ms) < 1e-6 * wall_ms
    assert 0 < outside_ms < plain_ms  # the forward pass was timed, inside the step
    assert "forward" not in vars(engine.model)  # and the model is as it was
