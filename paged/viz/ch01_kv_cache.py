"""Chapter 01's plots (guide §1-§2): one request's KV bytes against its length, and the arithmetic intensity of a
decode step against the batch size, under the GPU's ridge point."""

import matplotlib.pyplot as plt
import numpy as np

from paged.geometry import H100_SXM_BANDWIDTH, H100_SXM_BF16_FLOPS, KVGeometry, decode_step_flops_per_byte


def request_bytes_series(geometries: dict[str, KVGeometry], context_lens) -> dict[str, np.ndarray]:
    """KV bytes of one request at each context length, per named model: name -> float [len(context_lens)]."""
    return {name: np.array([g.request_bytes(n) for n in context_lens], dtype=float) for name, g in geometries.items()}


def plot_request_bytes(geometries: dict[str, KVGeometry], context_lens=(256, 512, 1024, 2048, 4096, 8192)):
    """Log-log lines: KV bytes of one request against its context length, one line per model."""
    series = request_bytes_series(geometries, context_lens)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        ax.plot(context_lens, values / 2**20, marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens in the request",
        ylabel="KV cache (MiB)",
        title="One request's KV cache grows linearly with its length",
    )
    ax.set_xticks(context_lens, [str(n) for n in context_lens])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def decode_intensity_series(
    geometry: KVGeometry, num_params: float, batch_sizes, context_lens
) -> dict[int, np.ndarray]:
    """FLOPs per byte of a decode step: context_len -> float [len(batch_sizes)]."""
    return {
        n: np.array([decode_step_flops_per_byte(geometry, num_params, b, n) for b in batch_sizes]) for n in context_lens
    }


def plot_decode_intensity(
    geometry: KVGeometry,
    num_params: float,
    batch_sizes=(1, 4, 16, 64, 256, 1024),
    context_lens=(512, 2048, 8192),
    flops=H100_SXM_BF16_FLOPS,
    bandwidth=H100_SXM_BANDWIDTH,
):
    """Arithmetic intensity of a decode step against batch size, with the GPU's ridge point (flops / bandwidth).
    Below the ridge a step's time is set by bytes read, not by FLOPs: decode is memory-bound."""
    series = decode_intensity_series(geometry, num_params, batch_sizes, context_lens)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for context_len, values in series.items():
        ax.plot(batch_sizes, values, marker="o", label=f"context {context_len}")
    ax.axhline(flops / bandwidth, color="black", linestyle="--", label=f"H100 ridge {flops / bandwidth:.0f} FLOP/B")
    ax.axhline(
        geometry.attention_flops_per_byte,
        color="grey",
        linestyle=":",
        label=f"attention alone {geometry.attention_flops_per_byte:.0f} FLOP/B",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch size (sequences per decode step)",
        ylabel="FLOP per byte read",
        title="A decode step levels off under the ridge, but for short contexts",
    )
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
