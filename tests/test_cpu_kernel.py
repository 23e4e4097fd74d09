"""The C++ CPU kernel (paged/kernels/cpu.py) against the torch reference in paged.model.attention (guide §7).

Random shapes: block sizes 2-128, GQA 1:1 to 8:1, head_dim 24-128, ragged contexts with partly filled last
blocks, and prefill chunks of every kind (a whole prompt, a chunk after cached tokens, a prefix-cache hit, one
token, none). Bad input raises the same ValueErrors as the Triton wrappers. The first test builds the kernel if
no cached build exists (a minute on two cores).
"""

import functools
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import helpers
import pytest
import torch
from helpers import make_tiny_llm, random_prompts, tiny_llama

from paged import LLM, SamplingParams
from paged.kernels import cpu
from paged.model import attention as ref
from paged.model.attention_backends import get_attn_backend
from paged.model.layer_ops import add_rms_norm, apply_rope, get_layer_ops, silu_and_mul

# the kernel tests' inputs, on the CPU even where there is a GPU
paged_pool = functools.partial(helpers.paged_pool, device="cpu")
random_query = functools.partial(helpers.random_query, device="cpu")
decode_call = functools.partial(helpers.decode_call, device="cpu")

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
SHAPES = [
    (block_size, group, num_kv_heads, head_dim)
    for block_size in (8, 16, 32, 64, 128)
    for group, num_kv_heads in ((1, 2), (3, 3), (4, 1), (8, 2))
    for head_dim in (64, 128)
][::3] + [(2, 3, 1, 40), (4, 2, 2, 80), (8, 1, 3, 24)]  # a spread of the combinations; every value of each
# appears; then blocks narrower than a vector and head_dims that are not whole groups of vectors


@pytest.fixture(scope="module", autouse=True)
def built():
    helpers.require_cpu_kernel()


def assert_close(out, expected, dtype):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def random_chunks(rng, block_size, count=6):
    """(cached tokens, new tokens) per sequence: prompts whole and chunked, prefix hits on whole blocks,
    chunks that start and end mid-block, one token, and an empty chunk."""
    chunks = [
        (0, rng.randint(1, 3 * block_size)),
        (rng.randint(1, 2 * block_size), rng.randint(1, 40)),
        (block_size * rng.randint(1, 3), rng.randint(1, block_size)),
        (rng.randint(1, 200), 1),
        (rng.randint(0, 50), 0),
    ]
    return chunks + [(rng.randint(0, 100), rng.randint(1, 60)) for _ in range(count - len(chunks))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_the_reference(shape):
    block_size, group, num_kv_heads, head_dim = shape
    rng = random.Random(str(shape))
    lens = [1, block_size - 1, block_size, block_size + 1] + [rng.randint(1, 300) for _ in range(4)]
    key_cache, value_cache, tables, lens = paged_pool(
        lens, block_size, num_kv_heads, head_dim, torch.float32, seed=rng.randint(0, 99)
    )
    query = random_query(len(lens), group * num_kv_heads, head_dim, torch.float32, seed=1)
    args = query, key_cache, value_cache, tables, lens, head_dim**-0.5
    assert_close(cpu.paged_decode_attention(*args), ref.decode_attention(*args), torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_matches_the_reference(shape):
    block_size, group, num_kv_heads, head_dim = shape
    rng = random.Random(str(shape))
    chunks = random_chunks(rng, block_size)
    key_cache, value_cache, tables, lens = paged_pool(
        [c + n for c, n in chunks], block_size, num_kv_heads, head_dim, torch.float32, seed=rng.randint(0, 99)
    )
    query_lens = torch.tensor([n for _, n in chunks])
    query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32)
    query = random_query(int(query_lens.sum()), group * num_kv_heads, head_dim, torch.float32, seed=2)
    args = query, key_cache, value_cache, tables, query_start_loc, lens, head_dim**-0.5
    assert_close(cpu.paged_prefill_attention(*args), ref.prefill_attention(*args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pools(dtype):
    chunks = random_chunks(random.Random(0), 16)
    key_cache, value_cache, tables, lens = paged_pool([c + n for c, n in chunks], 16, 3, 64, dtype, seed=3)
    query_lens = torch.tensor([n for _, n in chunks])
    query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32)
    query = random_query(int(query_lens.sum()), 9, 64, dtype, seed=3)
    args = query, key_cache, value_cache, tables, query_start_loc, lens, 0.125
    assert_close(cpu.paged_prefill_attention(*args), ref.prefill_attention(*args), dtype)


def test_reads_nothing_outside_the_context():
    """Every pool slot no sequence's context covers (free blocks, the unused tail of a last block) holds NaN:
    a kernel that read one, even to mask it or to turn it, would return NaN."""
    key_cache, value_cache, tables, lens = paged_pool([5, 16, 37], 16, 2, 64, torch.float32, seed=4)
    query = random_query(3, 4, 64, torch.float32, seed=4)
    expected = ref.decode_attention(query, key_cache, value_cache, tables, lens, 0.125)
    in_context = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for seq, n in enumerate(lens.tolist()):
        for pos in range(n):
            in_context[tables[seq, pos // 16], pos % 16] = True
    query_start_loc = torch.tensor([0, 5, 8, 28], dtype=torch.int32)  # prefill: a whole prompt, then two chunks
    prefill_query = random_query(28, 4, 64, torch.float32, seed=5)
    prefill_args = prefill_query, key_cache, value_cache, tables, query_start_loc, lens, 0.125
    expected_prefill = ref.prefill_attention(*prefill_args)
    key_cache[~in_context], value_cache[~in_context] = float("nan"), float("nan")
    out = cpu.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.125)
    assert_close(out, expected, torch.float32)
    assert_close(cpu.paged_prefill_attention(*prefill_args), expected_prefill, torch.float32)


def test_strided_query_and_neither_tiles_nor_threads_change_the_bits():
    """A query sliced from a fused qkv tensor works. A batch of many sequences runs a tile per sequence, a lone
    sequence a tile per KV head, on one thread or two: every row's arithmetic is the same, and so are the bits."""
    key_cache, value_cache, tables, lens = paged_pool(
        [3, 40, 130, 77, 16, 9, 64, 200], 16, 3, 64, torch.float32, seed=5
    )
    qkv = random_query(8, 15, 64, torch.float32, seed=5)
    query = qkv[:, :9]
    assert not query.is_contiguous()
    threads = torch.get_num_threads()
    outs = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            outs.append(cpu.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.125))
            outs.append(
                torch.cat(
                    [
                        cpu.paged_decode_attention(
                            query[s : s + 1], key_cache, value_cache, tables[s : s + 1], lens[s : s + 1], 0.125
                        )
                        for s in range(8)
                    ]
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs)
    expected = ref.decode_attention(query.contiguous(), key_cache, value_cache, tables, lens, 0.125)
    assert_close(outs[0], expected, torch.float32)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_matches_write_kv(slot_dtype):
    key_cache, value_cache, _, _ = paged_pool([40], 16, 3, 64, torch.float32, seed=6)
    slots = torch.randperm(key_cache.shape[0] * 16, generator=torch.Generator().manual_seed(6))[:12].to(slot_dtype)
    slots[[2, 7]] = -1  # skipped tokens
    key, value = random_query(12, 3, 64, torch.float64, seed=7), random_query(12, 3, 64, torch.float64, seed=8)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, expected_k, expected_v, slots)
    cpu.reshape_and_cache(key, value, key_cache, value_cache, slots)  # float64 rows are cast to the pool's fp32
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_fused_layer_ops_give_the_torch_bits(num_tokens, dtype):
    """RoPE in place on a strided slice of a fused qkv tensor, SiLU-and-multiply (a width whose last elements torch
    computes one by one), and RMSNorm with the residual add: the same floats as paged.model.layer_ops's torch code, to
    the last bit, in fp32 and bf16 (so the engine's tokens cannot drift from the oracle here)."""
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = (3 * torch.randn(num_tokens, 15 * 64, generator=gen)).to(dtype)
    cos, sin = (torch.randn(num_tokens, 64, generator=gen).to(dtype) for _ in range(2))
    qk = qkv[:, : 12 * 64].view(num_tokens, 12, 64)  # 9 query and 3 key heads, strided rows
    expected = apply_rope(qk, cos, sin)
    assert cpu.load().rotary(qk, cos, sin) is qk and torch.equal(qk, expected)
    gate_up = (4 * torch.randn(num_tokens, 2 * 1560, generator=gen)).to(dtype)
    assert torch.equal(cpu.load().silu_and_mul(gate_up), silu_and_mul(gate_up.clone()))
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # there the engine keeps torch's RMSNorm
        assert get_layer_ops("cpu", dtype).add_rms_norm is add_rms_norm
        return
    for hidden_size in (5, 576, 4100, 40000):  # a partial vector; cascades of 16 vectors; a row torch's sum splits
        hidden = (3 * torch.randn(num_tokens, hidden_size, generator=gen)).to(dtype)
        delta = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
        weight = torch.randn(hidden_size, generator=gen).to(dtype)
        for maybe_delta in (None, delta):
            fused_hidden, torch_hidden = hidden.clone(), hidden.clone()
            fused = cpu.load().rms_norm(fused_hidden, maybe_delta, weight, 1e-5)
            assert torch.equal(fused, add_rms_norm(torch_hidden, maybe_delta, weight, 1e-5))
            assert torch.equal(fused_hidden, torch_hidden)  # the residual add, in place


def test_fused_silu_and_mul_against_torch_when_torch_splits_a_row_between_threads():
    """torch's elementwise loop cuts its work between threads at element counts, and each thread's piece runs
    vectors from where it starts, then single values: where a cut falls inside a row off the vector step, a few
    elements get torch's scalar exp where the fused loop uses its vector exp, or the reverse. On one thread, and at
    SmolLM2's width of 1536 (every cut on a vector step) on two, the bits are torch's for every batch of 1-48
    tokens; at width 3000 on two threads some fp32 elements differ, by at most 3 ulp, and no bf16 one does."""
    threads = torch.get_num_threads()
    differing = 0
    try:
        for num_threads, width, dtype in [
            (1, 3000, torch.float32),
            (2, 1536, torch.float32),
            (2, 3000, torch.float32),
            (2, 3000, torch.bfloat16),
        ]:
            torch.set_num_threads(num_threads)
            for num_tokens in range(1, 49):
                gen = torch.Generator().manual_seed(num_tokens)
                gate_up = (4 * torch.randn(num_tokens, 2 * width, generator=gen)).to(dtype)
                fused, plain = cpu.load().silu_and_mul(gate_up), silu_and_mul(gate_up.clone())
                if (num_threads, width) != (2, 3000) or dtype == torch.bfloat16:
                    assert torch.equal(fused, plain), (num_threads, width, dtype, num_tokens)
                    continue
                ulps = (fused.view(torch.int32).long() - plain.view(torch.int32).long()).abs()
                assert ulps.max() <= 3 and (ulps > 0).sum() <= 8, num_tokens
                differing += int((ulps > 0).sum())
    finally:
        torch.set_num_threads(threads)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # x86's vector exp: the exception is real
        assert differing > 0


# --- bad input: the Triton wrappers' messages ---------------------------------------------------------------

CPU_CASES = [
    (change, message)
    for change, message in helpers.bad_decode_inputs("cpu")
    if not {"version", "num_splits"} & change.keys()
]  # options of the Triton kernels only


@pytest.mark.parametrize("change, message", CPU_CASES, ids=lambda x: str(x)[:40])
def test_decode_rejects_bad_input_as_triton_does(change, message):
    call = decode_call(**change)
    with pytest.raises(ValueError, match=message):
        call()  # the Triton wrapper
    with pytest.raises(ValueError, match=message):
        cpu.paged_decode_attention(**call.keywords)


def test_prefill_and_cache_write_reject_bad_input():
    helpers.assert_prefill_rejects_bad_input(cpu.paged_prefill_attention, "cpu")
    kc, vc, _, _ = paged_pool([5, 9], 8, 2, 64, torch.float32, seed=0)
    key = random_query(3, 2, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 \(skip\) or in \[0, 64\)"):
        cpu.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 64, 2]))


def test_the_ops_themselves_keep_to_the_pool():
    """The engine calls the ops without the Python checks; a stray block id still raises, it is never read."""
    query, key_cache, value_cache, tables, lens, scale = decode_call().keywords.values()
    stray = tables.clone()
    stray[1, 0] = key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 18 is outside the pool"):
        cpu.load().decode(query, key_cache, value_cache, stray, lens, scale)


WITHOUT_OPENMP = textwrap.dedent("""
    import sys, torch
    from paged.kernels import cpu
    cpu.OPENMP = []                                      # as where the compiler has no -fopenmp (Apple's clang)
    assert "-fopenmp" not in cpu.build_flags() and cpu.load() is not None
    torch.set_num_threads(2)
    inputs = torch.load(sys.argv[1])
    torch.save([cpu.paged_decode_attention(*inputs["decode"]), cpu.paged_prefill_attention(*inputs["prefill"])],
               sys.argv[2])
""")


def test_a_build_without_openmp_gives_the_same_bits(tmp_path):
    """Where the compiler has no OpenMP, the library is built without it (its own name, so it never replaces the
    OpenMP build); its loops then run on one thread and every result keeps its bits. In a process of its own,
    since one process cannot load two libraries of the same ops."""
    key_cache, value_cache, tables, lens = paged_pool(
        [3, 40, 130, 77, 16, 9, 64, 200], 16, 3, 64, torch.float32, seed=7
    )
    query = random_query(8, 9, 64, torch.float32, seed=7)
    chunk = random_query(12, 9, 64, torch.float32, seed=8)
    starts, chunk_lens = torch.tensor([0, 4, 9, 12], dtype=torch.int32), torch.tensor([40, 9, 16], dtype=torch.int32)
    inputs = {
        "decode": (query, key_cache, value_cache, tables, lens, 0.125),
        "prefill": (chunk, key_cache, value_cache, tables[[1, 5, 4]], starts, chunk_lens, 0.125),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPENMP, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    decode, prefill = torch.load(tmp_path / "out.pt")
    assert torch.equal(decode, cpu.paged_decode_attention(*inputs["decode"]))
    assert torch.equal(prefill, cpu.paged_prefill_attention(*inputs["prefill"]))


# --- the engine's switch -------------------------------------------------------------------------------------


def test_without_a_compiler_the_engine_warns_once_and_uses_the_reference(monkeypatch):
    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(cpu, "library_name", lambda: "paged_cpu_attention_never_built")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.warns(RuntimeWarning, match="no C.. compiler found .*the engine attends with the torch reference"):
        assert get_attn_backend("cpu", torch.device("cpu")).name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning at all
        assert get_attn_backend("cpu", torch.device("cpu")).name == "torch"


def test_the_cpu_backend_is_the_default_on_a_cpu(tiny_model):
    assert make_tiny_llm(tiny_model).engine.model.backend.name == "cpu"
    assert make_tiny_llm(tiny_model, attention_backend="torch").engine.model.backend.name == "torch"


def test_a_bfloat16_engine_runs_on_the_cpu_kernel():
    """The kernel reads bf16 pools; the fused layer ops are fp32 only, so a bf16 model keeps torch's there."""
    llm = LLM(model=tiny_llama(), device="cpu", dtype=torch.bfloat16, num_blocks=32, block_size=8)
    assert llm.engine.model.backend.name == "cpu"
    outs = llm.generate(random_prompts(3, seed=9), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
