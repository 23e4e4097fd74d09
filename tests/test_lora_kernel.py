"""The Triton LoRA shrink/expand (paged/kernels/lora.py) against the torch reference in paged.lora (guide §16).

Without CUDA the kernel runs in Triton's interpreter (paged/kernels/interpreter.py switches it on); fp32 there,
small shapes. On CUDA the same checks run compiled, in fp32, fp16 and bf16. Skipped where Triton is not installed.
"""

import pytest
import torch

from paged import kernels

if kernels.triton_missing():
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from paged import lora as ref  # noqa: E402
from paged.kernels import lora as triton_lora  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def random_segments(num_tokens, num_slots, seed):
    """Runs of random lengths covering [0, num_tokens), each on a random slot or none (the base model: no run)."""
    gen = torch.Generator().manual_seed(seed)
    runs, start = [], 0
    while start < num_tokens:
        end = min(num_tokens, start + int(torch.randint(1, 40, (1,), generator=gen)))
        slot = int(torch.randint(-1, num_slots, (1,), generator=gen))
        if slot >= 0:
            runs.append((start, end, slot))
        start = end
    return ref.Segments.build(runs, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,in_features,rank,out_features", [(1, 64, 16, 48), (37, 96, 8, 130), (90, 64, 48, 64)]
)
def test_shrink_then_expand_match_the_reference(dtype, num_tokens, in_features, rank, out_features):
    gen = torch.Generator().manual_seed(num_tokens)
    num_slots = 3
    x = torch.randn(num_tokens, in_features, generator=gen).to(DEVICE, dtype)
    lora_a = (torch.randn(num_slots, rank, in_features, generator=gen) / 8).to(DEVICE, dtype)
    lora_b = (torch.randn(num_slots, out_features, rank, generator=gen) / 4).to(DEVICE, dtype)
    segments = random_segments(num_tokens, num_slots, seed=num_tokens) or ref.Segments.build([(0, 1, 0)], DEVICE)
    rows = torch.cat([torch.arange(s, e) for s, e in zip(segments.starts, segments.ends)]).to(DEVICE)

    y_ref, y = ref.sgmv_shrink(x, lora_a, segments), triton_lora.sgmv_shrink(x, lora_a, segments)
    tol = TOL[dtype]
    torch.testing.assert_close(y[rows].float(), y_ref[rows].float(), atol=tol, rtol=tol)

    # expand into a column slice of a wider, fused output: the columns around it must stay as they were
    base = torch.randn(num_tokens, out_features + 20, generator=gen).to(DEVICE, dtype)
    out_ref, out = base.clone(), base.clone()
    ref.sgmv_expand(y_ref, lora_b, out_ref[:, 7 : 7 + out_features], segments)
    triton_lora.sgmv_expand(y_ref, lora_b, out[:, 7 : 7 + out_features], segments)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol * 4, rtol=tol)
    untouched = torch.ones(num_tokens, dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(out[untouched], base[untouched])  # tokens outside every segment: no update
    assert torch.equal(out[:, :7], base[:, :7]) and torch.equal(out[:, 7 + out_features :], base[:, 7 + out_features :])


def test_the_reference_is_x_a_b_per_token():
    """The reference itself against the definition: token t under slot s gets x_t A_s^T B_s^T, others nothing."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 12, generator=gen, dtype=torch.float64)
    lora_a, lora_b = (
        torch.randn(2, 3, 12, generator=gen, dtype=torch.float64),
        torch.randn(2, 5, 3, generator=gen, dtype=torch.float64),
    )
    segments = ref.Segments.build([(0, 4, 1), (6, 9, 0)], "cpu")
    out = torch.zeros(10, 5, dtype=torch.float64)
    ref.sgmv_expand(ref.sgmv_shrink(x, lora_a, segments), lora_b, out, segments)
    slot_of = [1] * 4 + [None] * 2 + [0] * 3 + [None]
    for t, slot in enumerate(slot_of):
        expected = torch.zeros(5, dtype=torch.float64) if slot is None else lora_b[slot] @ (lora_a[slot] @ x[t])
        torch.testing.assert_close(out[t], expected)
