"""What the tests share: a tiny random Llama and adapters for it, random prompts, transformers' greedy tokens, the
empty-pool check, interrupted steps, the prefix cache's contents against transformers, a player's frames, and the
kernel tests' paged pools and bad inputs (on the GPU when there is one)."""

import functools
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from paged import LLM
from paged.kernels import cpu, triton_missing


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random Llama small enough to run hundreds of engine steps in a second (GQA 2:1)."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=255,
        bos_token_id=0,
        initializer_range=0.3,
    )  # wide weights: peaked logits, so sampling follows the model
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def make_tiny_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 8)
    return LLM(model=model, device="cpu", dtype=torch.float32, **kwargs)


def random_prompts(count: int, seed: int = 0, low: int = 1, high: int = 60) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(1, 250, (n,), generator=generator).tolist() for n in lengths]


def assert_ref_counts_exact(manager) -> None:
    """Each block's ref count is the number of block tables holding it, and a block is in the free queue, once,
    exactly when nobody holds it."""
    holders = Counter(b for table in manager.block_tables.values() for b in table)
    free_ids = [block.block_id for block in manager.free_queue]
    assert len(free_ids) == len(set(free_ids)) == manager.num_free_blocks
    free = set(free_ids)
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id]  # exact ref counts
        assert (block.block_id in free) == (block.ref_count == 0)  # free iff nobody holds it


def assert_pool_empty(llm: LLM) -> None:
    """Every block is back in the free queue and nobody holds a table."""
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.block_tables == {}
    assert all(block.ref_count == 0 for block in manager.blocks)


def run_engine(engine, prompts, params) -> list[list[int]]:
    """Add every prompt at once and step the engine until all finish; token ids come back in prompt order."""
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[i] for i in ids]


def player_frames(player) -> list[str]:
    """The HTML of every frame of a paged.viz player, in order, after checking that its Play button and slider span
    the frames and that the browser links them to the frame on show (jslink: no kernel needed to move them)."""
    from ipywidgets.widgets.widget import _instances as live_widgets  # here: a GPU machine need not have ipywidgets
    from ipywidgets.widgets.widget_link import Link

    (play, slider), view = player.children[0].children, player.children[1]
    frames = [child.value for child in view.children]
    assert (play.max, slider.max) == (len(frames) - 1, len(frames) - 1)
    assert slider.value == play.value == view.selected_index
    links = {(link.source, link.target) for link in live_widgets.values() if isinstance(link, Link)}
    assert ((play, "value"), (slider, "value")) in links and ((slider, "value"), (view, "selected_index")) in links
    return frames


# ---- the engine against transformers, and interrupted steps -------------------------------------------------


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """transformers' own greedy tokens (generate, without sampling) after prompt_ids."""
    ids = torch.tensor([prompt_ids])
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )
    return out[0, ids.shape[1] :].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' next-token logits [vocab] after ids, in fp32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def assert_near_tie(
    label: str, model, prompt: list[int], ours: list[int], theirs: list[int], relative: float = 2**-6
) -> None:
    """Where two greedy continuations part (if they do), transformers must rank both tokens within a margin of
    `relative` times its largest logit there (the default is bf16-sized). Prints the margin."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        return
    logits = hf_logits(model, prompt + ours[:step])
    margin, scale = float(logits[theirs[step]] - logits[ours[step]]), float(logits.abs().max())
    print(f"{label}: a near-tie at step {step}, transformers' margin {margin:.4f} of logits up to {scale:.2f}")
    assert margin <= relative * scale, f"{label}, step {step}: margin {margin:.4f} of logits up to {scale:.2f}"


class Interrupt(Exception):
    """What a failing forward observer raises (KeyboardInterrupt behaves the same: both are caught as BaseException)."""


class FailOnForward:
    """A forward observer that raises on its `at`-th call from now (1 = the next forward pass), once."""

    def __init__(self, at: int = 1, error=Interrupt):
        self.countdown, self.error = at, error

    def __call__(self, plan):
        self.countdown -= 1
        if self.countdown == 0:
            raise self.error("interrupted")


def run_through_interrupts(engine, request_ids: list[str], interrupt_at: tuple[int, ...]) -> list[list[int]]:
    """Step the engine to the end while each of interrupt_at in turn interrupts the at-th forward pass from then;
    returns the requests' first completions, in the order of request_ids."""
    outputs = {}
    for at in interrupt_at:
        engine.forward_observers[:] = [FailOnForward(at)]
        with pytest.raises(Interrupt):
            for _ in range(100):
                outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    engine.forward_observers.clear()
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    return [outputs[i] for i in request_ids]


def cached_blocks_hold_their_tokens(llm, model, prefix_of: dict) -> None:
    """Every block in the prefix cache holds, in every layer, the K/V that transformers computes for its tokens.
    prefix_of maps a block hash to the token ids from the sequence's start to the block's end."""
    manager, cache = llm.engine.block_manager, llm.engine.kv_cache
    size = manager.block_size
    for block_hash, block in manager.cached.items():
        prefix = prefix_of[block_hash]
        with torch.no_grad():
            layers = model(torch.tensor([prefix]), use_cache=True).past_key_values.layers
        for index, layer in enumerate(layers):
            keys = layer.keys[0, :, -size:].transpose(0, 1)  # [block_size, num_kv_heads, head_dim]
            values = layer.values[0, :, -size:].transpose(0, 1)
            torch.testing.assert_close(cache.key_cache(index)[block.block_id], keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(cache.value_cache(index)[block.block_id], values, atol=1e-4, rtol=1e-4)


def record_cached_prefixes(llm) -> dict:
    """Wrap the block manager so the test learns the tokens behind every hash it registers."""
    manager, prefix_of = llm.engine.block_manager, {}
    register = manager.cache_full_blocks

    def recording(seq_id, token_ids, num_computed_tokens, extra_key=None):
        registered = register(seq_id, token_ids, num_computed_tokens, extra_key)
        table = manager.block_tables[seq_id]
        for block in registered:
            prefix_of[block.block_hash] = list(token_ids[: (table.index(block.block_id) + 1) * manager.block_size])
        return registered

    manager.cache_full_blocks = recording
    return prefix_of


def make_adapter(path, seed, r=8, targets=("q_proj", "v_proj"), **config):
    """A PEFT LoRA on the tiny Llama with random A and B, saved to path; returns (path, the PEFT model)."""
    from peft import LoraConfig, get_peft_model

    targets = targets if isinstance(targets, str) else list(targets)  # a string is PEFT's regex form
    peft_model = get_peft_model(
        tiny_llama(),
        LoraConfig(r=r, lora_alpha=config.pop("lora_alpha", 2 * r), target_modules=targets, lora_dropout=0.0, **config),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (0.4 / param.shape[-1] ** 0.5))
    peft_model.save_pretrained(str(path))
    return str(path), peft_model.eval()


# ---- the kernel tests' inputs -------------------------------------------------------------------------------

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels' tests put their inputs


def edge_lens(block_size, long):
    """The context lengths where paging can go wrong: one token, around one full block, and a long one."""
    return [1, block_size - 1, block_size, block_size + 1, long]


def paged_pool(
    context_lens, block_size, num_kv_heads, head_dim, dtype, seed, spare_blocks=5, spare_columns=2, device=KERNEL_DEVICE
):
    """Random K/V pools and a shuffled block table: sequences own scattered blocks, some blocks are free,
    and every table has spare columns past its last block, filled with -1 that no kernel may read."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    used = [-(-n // block_size) for n in context_lens]
    width = max(used) + spare_columns
    num_blocks = sum(used) + spare_blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    for seq, n in enumerate(used):
        block_tables[seq, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return [t.to(device) for t in (key_cache, value_cache, block_tables, lens)]


def random_query(rows, num_heads, head_dim, dtype, seed, device=KERNEL_DEVICE):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype).to(device)


def decode_inputs(block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0, spare_columns=2, device=KERNEL_DEVICE):
    key_cache, value_cache, block_tables, lens = paged_pool(
        edge_lens(block_size, long=7 * block_size + 3),
        block_size,
        num_kv_heads,
        head_dim,
        dtype,
        seed,
        spare_columns=spare_columns,
        device=device,
    )
    query = random_query(len(lens), num_heads, head_dim, dtype, seed, device)
    return query, key_cache, value_cache, block_tables, lens, head_dim**-0.5


def decode_call(device=KERNEL_DEVICE, **change):
    """The Triton decode wrapper bound to valid inputs, with `change` replacing some of them."""
    from paged import kernels

    args = dict(
        zip(
            ["query", "key_cache", "value_cache", "block_tables", "context_lens", "scale"],
            decode_inputs(8, 4, 2, 64, torch.float32, device=device),
        )
    )
    args.update(change)
    return functools.partial(kernels.paged_decode_attention, **args)


def bad_decode_inputs(device=KERNEL_DEVICE):
    """(change, the ValueError's message) for decode_call: one bad argument each."""
    q, kc, vc, bt, lens, _ = decode_inputs(8, 4, 2, 64, torch.float32, device=device)
    overlong = lens.clone()
    overlong[2] = bt.shape[1] * 8 + 1
    stray = bt.clone()
    stray[4, 0] = kc.shape[0]
    return [
        (dict(block_tables=bt.long()), "block_tables must be int32"),
        (dict(context_lens=lens.long()), "context_lens must be int32"),
        (dict(context_lens=overlong), r"context_lens\[2\] = 81 is longer than its block table can hold"),
        (dict(context_lens=lens * 0), "context_lens must be >= 1"),
        (dict(block_tables=stray), r"block_tables\[4, 0\] = 18 is outside the pool \[0, 18\)"),
        (dict(block_tables=bt[:3]), "block_tables has 3 rows but context_lens has 5"),
        (dict(query=q[:3]), "query has 3 sequences but context_lens has 5"),
        (dict(query=q[..., :32]), "query head_dim 32 must equal key_cache head_dim 64"),
        (dict(query=q[:, :3]), "num_heads 3 .* must be a multiple of num_kv_heads 2"),
        (dict(query=q.half()), "query dtype torch.float16 must equal key_cache dtype torch.float32"),
        (dict(query=q[0]), r"query must be 3-D"),
        (dict(value_cache=vc[:-1]), "value_cache must have key_cache's shape"),
        (dict(key_cache=kc[:, :6], value_cache=vc[:, :6]), "block_size .* must be a power of two, got 6"),
        (dict(version=3), "version must be 1, 2 or None"),
        (dict(version=1, num_splits=2), "num_splits applies to version 2 only"),
        (dict(num_splits=0), r"num_splits must be an int in \[1, 64\]"),
    ]


def assert_prefill_rejects_bad_input(prefill, device=KERNEL_DEVICE) -> None:
    """prefill (the Triton wrapper or the C++ one) names each bad argument and its limit."""
    kc, vc, bt, lens = paged_pool([5, 9], 8, 2, 64, torch.float32, seed=0, device=device)
    q = random_query(6, 4, 64, torch.float32, seed=0, device=device)
    int32 = dict(dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3, 6], **int32)
    call = lambda **c: prefill(  # noqa: E731
        **{
            **dict(
                query=q,
                key_cache=kc,
                value_cache=vc,
                block_tables=bt,
                query_start_loc=qsl,
                context_lens=lens,
                scale=0.125,
            ),
            **c,
        }
    )
    with pytest.raises(ValueError, match=r"query_start_loc must be int32 \[num_seqs \+ 1 = 3\]"):
        call(query_start_loc=qsl[:2])
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to num_tokens = 6"):
        call(query_start_loc=torch.tensor([0, 3, 5], **int32))
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to num_tokens = 6"):
        call(query_start_loc=torch.tensor([0, 7, 6], **int32))
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 2 is shorter than its query length 3"):
        call(context_lens=torch.tensor([2, 9], **int32))
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 33 is longer than its block table"):
        call(context_lens=torch.tensor([5, 33], **int32))


# Triton has wheels for Linux only, and the C++ kernel needs a compiler: a laptop may have neither. Their tests skip
# there, saying why; a compiler that is found but fails to build the kernel is a failure, not a skip.
needs_triton = pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))


def require_cpu_kernel() -> None:
    """Skip the calling test (or module, from a fixture) where no C++ compiler is found and no build is cached;
    fail where a compiler is found but the kernel does not build."""
    if cpu.load() is None:
        if cpu.compiler() is None:
            pytest.skip(cpu.missing())
        pytest.fail(f"the CPU kernel did not build on this machine: {cpu.missing()}")
