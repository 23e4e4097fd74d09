"""Measure the StepCost of SmolLM2 on this machine (paged/analysis/step_cost.py, guide §13): time real engine steps of
known shapes (lone prefills of several lengths, decode batches of several sizes and contexts) and fit

    seconds = fixed + per_token * batched tokens + per_seq * sequences + per_pair * attended (query, key) pairs

by least squares. Each shape runs `--repeats` times and keeps its fastest time, which shrugs off other processes
sharing the CPU. paged.analysis.step_cost.SMOLLM2_CPU holds what this printed once on a 2-core CPU; the simulated clock
charges those constants, so the chapters' numbers do not depend on the machine that runs them.

    python benchmarks/step_cost.py [--repeats 3]
"""

import argparse

import numpy as np

from paged import LLM
from paged.analysis.replay import replay
from paged.analysis.step_cost import SMOLLM2_CPU, StepCost
from paged.analysis.traces import TraceRequest


def shapes() -> list[list[TraceRequest]]:
    """Traces whose steps span the space: lone prefills, then decode batches at two contexts."""
    traces = [[TraceRequest(0, n, 1, 0.0)] for n in (16, 64, 256, 512, 1024)]
    traces += [
        [TraceRequest(i, context, 4, 0.0) for i in range(batch)] for batch in (1, 4, 16, 32) for context in (32, 256)
    ]
    return traces + [[TraceRequest(i, 32, 4, 0.0) for i in range(64)]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model="smollm2", block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, seed=0)
    replay(llm.engine, [TraceRequest(0, 16, 4, 0.0)], clock="real")  # warm up
    runs = [
        [step for trace in shapes() for step in replay(llm.engine, trace, clock="real").steps]
        for _ in range(args.repeats)
    ]
    steps = [min(same, key=lambda s: s.duration) for same in zip(*runs)]  # the same shapes, step by step
    fitted = StepCost.fit(steps)
    print(f"{len(steps)} step shapes, fastest of {args.repeats}; fitted: {fitted}")
    print(f"in paged.analysis.step_cost: {SMOLLM2_CPU}")
    print(f"{'tokens':>7} {'seqs':>5} {'pairs':>9} {'measured s':>11} {'fitted s':>9} {'SMOLLM2_CPU s':>14}")
    for s in steps:
        shape = (s.num_batched_tokens, s.num_seqs, s.num_pairs)
        print(
            f"{shape[0]:7d} {shape[1]:5d} {shape[2]:9d} {s.duration:11.3f} {fitted(*shape):9.3f} "
            f"{SMOLLM2_CPU(*shape):14.3f}"
        )
    errors = [abs(fitted(s.num_batched_tokens, s.num_seqs, s.num_pairs) - s.duration) / s.duration for s in steps]
    print(f"relative error of the fit: median {np.median(errors):.1%}, max {max(errors):.1%}")


if __name__ == "__main__":
    main()
