"""CUDA graphs for decode (guide §11, the engine step; §7, why decode should be bound by memory), as vLLM V1 captures
them (vllm/compilation/cuda_graph.py `CUDAGraphWrapper`, vllm/v1/cudagraph_dispatcher.py).

A decode step of a small model launches a few hundred kernels, each of which costs the host some microseconds to
enqueue, while the GPU finishes it sooner: the step then waits on Python, not on memory. A CUDA graph records the
launches of one forward pass once and replays all of them with one call. It replays exactly what it recorded, the
same kernels on the same addresses with the same shapes, so:
  - the inputs live in InputBuffers (engine/input_buffers.py), whose addresses never change; each step fills them;
  - one graph is captured per batch size in `cudagraph_capture_sizes`, and a decode batch is padded up to the
    smallest size that holds it (padding rows write no K/V, and their logits are dropped);
  - every length a kernel needs is read from the device (the Triton decode kernel reads context_lens); what the
    host chose at capture (the decode kernel's split count) was chosen for the longest context the model allows.
Prefill and mixed steps, steps with LoRA adapters and tensor-parallel steps run eagerly, as does every step with
`enforce_eager=True`.

A CPU has no graphs. There, `enforce_eager=False` runs the same padded decode batches eagerly over the same buffers:
what a replay computes, which is how the padding is tested without a GPU.
"""

import warnings

import torch
from tqdm.auto import tqdm

from paged.engine.input_buffers import PAD_SLOT_ID, InputBuffers


class DecodeGraphs:
    """The decode forward pass of `model` for each of `sizes` sequences, over `buffers` and the pool `kv_cache`:
    captured as CUDA graphs when `capture` (the model on a GPU), else run eagerly at the padded size."""

    def __init__(
        self, model, kv_cache, buffers: InputBuffers, sizes: tuple[int, ...], max_model_len: int, capture: bool
    ):
        self.model, self.kv_cache, self.buffers, self.sizes = model, kv_cache, buffers, sizes
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, its logits)
        if capture:
            self._capture_all(max_model_len)

    def run(self, size: int, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        """The logits [size, vocab] of a decode step filled into the buffers and padded to `size` rows."""
        if size not in self.graphs:
            return self.model.forward(input_ids, positions, meta, self.kv_cache, logits_indices)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits

    def _capture_all(self, max_model_len: int) -> None:
        """Capture every size, the largest first (the smaller ones then fit in its memory pool); a capture that
        fails leaves every step eager, after a warning that says why."""
        pool = None
        try:
            for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs (decode)", unit="size"):
                args = self._padding_inputs(size, max_model_len)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compile the kernels and settle the allocator outside the capture
                    self.model.forward(*args[:3], self.kv_cache, args[3])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.forward(*args[:3], self.kv_cache, args[3])  # [size, vocab]
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        except RuntimeError as error:
            self.graphs.clear()
            warnings.warn(
                f"capturing the decode step as a CUDA graph failed ({error}); every step runs eagerly, as "
                f"with enforce_eager=True",
                stacklevel=2,
            )

    def _padding_inputs(self, size: int, max_model_len: int):
        """A decode batch of `size` padding rows in the buffers, its AttentionMetadata claiming the longest context
        the model allows, so that what the host chooses at capture suits every step, and no padding: the graph
        writes every row's K/V, and the kernel skips the padding rows of a replay by their slot (-1)."""
        input_ids, positions, meta, logits_indices = self.buffers.fill(
            [0] * size,
            [0] * size,
            [PAD_SLOT_ID] * size,
            list(range(size)),
            [[0]] * size,
            [1] * size,
            [1] * size,
            num_decodes=size,
        )
        meta.decode_max_context_len = max_model_len
        return input_ids, positions, meta, logits_indices
