"""Where a decode step's time goes (guide §7, §8, §11): each part of `LLMEngine.step`, as the engine times it
(`LLMEngine.last_step_times`), against the memory floor, the time the step's bytes take to read once.

A decode step reads every weight of the model's layers and its LM head once (the embedding table only at the rows of
the step's tokens) and the K/V of every sequence's context. Reading them at the rate the device reads memory is the
least a step can take; a step that takes much longer waits on something else: the forward pass's arithmetic, or the
host (scheduling, building the inputs, launching kernels, sampling). Chapter 12 draws it on a CPU;
`benchmarks/host_time.py` prints it, and `benchmarks/gpu_engine_check.py` on a GPU, eager and with CUDA graphs.
"""

import statistics
import time

import torch

from paged.engine.llm_engine import LLMEngine
from paged.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "forward", "sample", "finish")  # LLMEngine.StepTimes' fields, in step order


def step_bytes(engine: LLMEngine, context_tokens: int) -> int:
    """Bytes one decode step of `engine` reads: its layers' weights, the final norm and LM head, and context_tokens
    tokens of K/V."""
    model, kv_cache = engine.model, engine.kv_cache
    tensors = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    weights = sum(t.numel() * t.element_size() for t in [*tensors, model.final_norm, model.lm_head])
    return weights + context_tokens * kv_cache.nbytes // (kv_cache.num_blocks * kv_cache.block_size)


def decode_step_times(engine: LLMEngine, batch: int, prompt_len: int, steps: int, temperature: float = 0.0) -> dict:
    """`batch` requests of prompt_len tokens run into their decode on an idle engine, then `steps` decode steps
    timed, the whole batch in each: the median wall time and the median of each part (seconds, "<part>_s"), and
    the bytes the middle step reads ("bytes"). The requests are aborted afterwards."""
    if engine.has_unfinished_requests():
        raise ValueError("decode_step_times needs an idle engine: it times steps of its own batch alone")
    # a prompt admitted early decodes while later ones are still computed: up to one token per prompt-filled step
    params = SamplingParams(temperature=temperature, max_tokens=steps + 2 + batch, ignore_eos=True)
    vocab = engine.model.vocab_size
    ids = [
        engine.add_request(engine.make_request([(31 * b + 7 * t) % (vocab - 1) + 1 for t in range(prompt_len)], params))
        for b in range(batch)
    ]
    try:
        while engine.scheduler.waiting or any(
            seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running
        ):
            engine.step()  # the prompts
        walls, parts, context = [], [], 0
        for step in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            parts.append(engine.last_step_times)
            if len(engine.last_schedule.batch) != batch:
                raise ValueError(
                    f"a step decoded {len(engine.last_schedule.batch)} of {batch} sequences: the engine "
                    f"needs max_num_seqs >= {batch} and room for them in its pool"
                )
            if step == steps // 2:
                context = sum(seq.num_computed_tokens for seq in engine.scheduler.running)  # read by this step
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    return {
        "batch": batch,
        "step_s": statistics.median(walls),
        "bytes": step_bytes(engine, context),
        **{f"{part}_s": statistics.median(getattr(times, part) for times in parts) for part in PARTS},
    }
