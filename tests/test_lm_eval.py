"""lm-evaluation-harness as a real client: a small multiple-choice task of this repository's (tests/data), scored
through `local-completions` against this engine's server and through lm-eval's own `hf` backend on the same
weights. Every choice's loglikelihood agrees within 1e-3 and so does the accuracy: the server's echo and prompt
log-probabilities are what lm-eval's scoring needs."""

from pathlib import Path

import pytest

from paged import LLM
from paged.model.loader import model_cache_dir
from paged.serving.api_server import build_app, serve_in_thread

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install -e '.[dev]'")

TASK_DATA = Path(__file__).resolve().parent / "data" / "lm_eval_mc.jsonl"
TASK = """task: paged_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def loglikelihoods(result) -> list[list[float]]:
    """Each document's choices' loglikelihoods, in document order."""
    samples = sorted(result["samples"]["paged_mc"], key=lambda sample: sample["doc_id"])
    return [[resp[0][0] for resp in sample["resps"]] for sample in samples]


def test_lm_eval_scores_the_server_as_its_hf_backend_scores_the_weights(smollm2, tmp_path):
    from lm_eval.tasks import TaskManager

    (tmp_path / "paged_mc.yaml").write_text(TASK.format(data=TASK_DATA))
    tasks = TaskManager(include_path=str(tmp_path))
    folder = model_cache_dir()  # the SmolLM2 checkpoint both sides read
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32,device=cpu",
        tasks=["paged_mc"],
        task_manager=tasks,
        log_samples=True,
        batch_size=4,
    )
    llm = LLM(model=str(folder), num_blocks=256, device="cpu")
    with serve_in_thread(build_app(llm, "smollm2")) as url:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            tasks=["paged_mc"],
            task_manager=tasks,
            log_samples=True,
            model_args=f"model=smollm2,base_url={url}/v1/completions,tokenizer={folder},tokenized_requests=True,"
            f"max_retries=1",
        )
    expected, got = loglikelihoods(reference), loglikelihoods(served)
    assert len(got) == len(expected) == 8 and [len(c) for c in got] == [len(c) for c in expected]
    for doc, (choices, reference_choices) in enumerate(zip(got, expected)):
        assert choices == pytest.approx(reference_choices, abs=1e-3), f"document {doc}"
    accuracy = served["results"]["paged_mc"]["acc,none"]
    assert accuracy == reference["results"]["paged_mc"]["acc,none"]
    assert accuracy >= 0.5  # chance over these choices is 0.31
