"""KV offload (paged/offload.py, guide §15): stable block hashes, swap preemption, the prefix cache's second tier.

On a tiny random Llama: greedy tokens with swap (memory and disk tier) and with the tier serving evicted prefixes
equal transformers' (and, with forks, speculation or both tiers, those of a pool roomy enough to need neither); swapped and offloaded blocks come back bit for bit; a full tier
falls back to recompute; an unwritable tier file and bad settings raise a ValueError naming the argument; an
interrupted step leaves both tiers consistent. A hypothesis state machine drives the block manager and both tiers
directly and checks that nothing leaks, ref counts are exact, and no block is in two places at once.
"""

import gc
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_pool_empty, assert_ref_counts_exact, make_tiny_llm, random_prompts
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged import SamplingParams
from paged.core.block_manager import AllocStatus, BlockManager, canonical_extra_key, hash_block_tokens
from paged.engine.kv_cache import KVCache
from paged.offload import KVTier, PrefixTier, SwapSpace

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TIGHT = {"num_blocks": 12, "block_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 4}


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_tiers_empty(llm):
    engine = llm.engine
    if engine.swap_space is not None:
        assert engine.swap_space.slots == {} and not engine.scheduler.swapped
        assert sorted(engine.swap_space.tier.free_slots) == list(range(engine.swap_space.tier.num_slots))


@pytest.fixture(scope="module")
def long_prompts():
    return random_prompts(4, seed=13, low=30, high=31)  # 30 tokens + 30 new: up to 8 blocks of 8 each


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored: the oracle."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def long_expected(tiny_model, long_prompts):
    return [hf_greedy(tiny_model, prompt, LONG.max_tokens) for prompt in long_prompts]


# ---- stable block hashes --------------------------------------------------------------------------------------------


def test_a_block_hash_is_sha256_of_a_canonical_encoding_and_chains():
    first = hash_block_tokens(None, [1, 2, 3], None)
    assert isinstance(first, bytes) and len(first) == 32
    assert first == hash_block_tokens(None, (1, 2, 3))
    assert first != hash_block_tokens(None, [1, 2, 4]) != hash_block_tokens(first, [1, 2, 3])
    keys = [None, 0, 7, "pirate", ("pirate", 3), ((1, "a"), None)]
    digests = {hash_block_tokens(first, [4, 5], key) for key in keys}
    assert len(digests) == len(keys)  # every extra key names a different block
    assert hash_block_tokens(None, [1], 1) != hash_block_tokens(None, [1], "1")


def test_block_hashes_are_the_same_in_another_process():
    """Python's hash() of a str differs between processes (PYTHONHASHSEED); the digest must not."""
    code = (
        "from paged.core.block_manager import hash_block_tokens as h; "
        "print(h(h(None, [5, 6], ('pirate', 2)), [7, 8], 'x').hex())"
    )
    here = hash_block_tokens(hash_block_tokens(None, [5, 6], ("pirate", 2)), [7, 8], "x").hex()
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=".",
        )
        assert out.stdout.strip() == here


@pytest.mark.parametrize("bad", [1.5, [1, 2], {"a": 1}, True, (1, [2]), object(), b"raw"])
def test_an_extra_key_that_does_not_encode_canonically_is_refused(bad):
    with pytest.raises(ValueError, match="cache_key"):
        hash_block_tokens(None, [1, 2], bad)
    with pytest.raises(ValueError, match="cache_key"):
        canonical_extra_key(bad)


def test_the_block_manager_names_blocks_by_the_digest_chain():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    manager.allocate(0, 5)
    manager.cache_full_blocks(0, [1, 2, 3, 4, 5], 5, extra_key=("lora", 1))
    first = hash_block_tokens(None, [1, 2], ("lora", 1))
    assert manager.block_hashes[0] == [first, hash_block_tokens(first, [3, 4], ("lora", 1))]
    assert manager.find_cached_prefix([1, 2, 3, 4, 9], ("lora", 1)) != []
    assert manager.find_cached_prefix([1, 2, 3, 4, 9], ("lora", 2)) == []


# ---- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"preemption_mode": "swap", "swap_space": -1}, "swap_space"),
        ({"preemption_mode": "swap", "swap_space": "1"}, "swap_space"),
        ({"preemption_mode": "swap", "swap_space": float("nan")}, "swap_space"),
        ({"preemption_mode": "swap", "swap_space": None}, "swap_space"),
        ({"enable_prefix_caching": True, "kv_offloading_size": -0.5}, "kv_offloading_size"),
        ({"enable_prefix_caching": True, "kv_offloading_size": "big"}, "kv_offloading_size"),
        ({"kv_offloading_size": 0.1}, "kv_offloading_size"),  # needs the prefix cache
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"preemption_mode": None}, "preemption_mode"),
        ({"preemption_mode": "swap", "kv_offload_dir": 3}, "kv_offload_dir"),
        ({"preemption_mode": "swap", "kv_offload_dir": ""}, "kv_offload_dir"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 0.01, "kv_offload_dir": " "}, "kv_offload_dir"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 1e-9}, "kv_offloading_size .* one KV block"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 0}, "kv_offloading_size .* one KV block"),
        ({"preemption_mode": "swap", "swap_space": 1e6}, "swap_space .* available host memory"),
        ({"enable_prefix_caching": True, "kv_offloading_size": 1e6}, "kv_offloading_size .* available host memory"),
    ],
)
def test_bad_offload_settings_raise_a_value_error_naming_the_argument(
    tiny_model, kwargs, name, long_prompts, long_expected
):
    with pytest.raises(ValueError, match=name):
        make_tiny_llm(tiny_model, **kwargs)
    llm = make_tiny_llm(tiny_model, preemption_mode="swap", swap_space=0.01, **TIGHT)  # a good one still works
    assert tokens(llm.generate(long_prompts[:2], LONG, use_tqdm=False)) == long_expected[:2]


def test_tiers_larger_than_the_disk_are_refused_before_a_file_is_made(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="swap_space 1e\\+06 GiB .* free disk space"):
        make_tiny_llm(tiny_model, preemption_mode="swap", swap_space=1e6, kv_offload_dir=tmp_path / "tiers")
    assert not (tmp_path / "tiers").exists()


def test_a_disk_tier_whose_file_cannot_be_written_is_refused(tiny_model, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        make_tiny_llm(tiny_model, preemption_mode="swap", kv_offload_dir=blocker / "tiers")


# ---- swap preemption -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("disk", [False, True])
def test_swap_keeps_greedy_tokens_and_returns_every_block(tiny_model, long_prompts, long_expected, tmp_path, disk):
    llm = make_tiny_llm(
        tiny_model, preemption_mode="swap", swap_space=0.01, kv_offload_dir=tmp_path if disk else None, **TIGHT
    )
    assert tokens(llm.generate(long_prompts, LONG, use_tqdm=False)) == long_expected
    stats = llm.kv_stats()
    assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"]
    assert stats["num_swapped"] == 0
    assert_pool_empty(llm)
    assert_tiers_empty(llm)
    if disk:
        path = Path(llm.kv_offload_files()["swap"])
        assert path.parent == tmp_path and path.stat().st_size == llm.engine.swap_space.tier.storage.nbytes


def test_swapped_blocks_come_back_bit_exact(tiny_model, long_prompts):
    """Every block copied in at a swap-in holds, at the forward pass, exactly what its pool block held when the
    sequence was swapped out."""
    llm = make_tiny_llm(tiny_model, preemption_mode="swap", **TIGHT)
    engine, saved, checked = llm.engine, {}, []

    def before_copies(plan):  # runs before the step's copies: the blocks to swap out still hold their K/V
        for block, slot in plan.blocks_to_swap_out:
            saved[slot] = engine.kv_cache.storage[:, :, block].clone()

    forward = engine.model.forward

    def after_copies(*args, **kwargs):
        for slot, block in engine.last_schedule.blocks_to_swap_in:
            assert torch.equal(engine.kv_cache.storage[:, :, block], saved.pop(slot))
            checked.append(block)
        return forward(*args, **kwargs)

    engine.forward_observers.append(before_copies)
    engine.model.forward = after_copies
    llm.generate(long_prompts, LONG, use_tqdm=False)
    assert checked and saved == {}


def test_a_full_swap_tier_falls_back_to_recompute(tiny_model, long_prompts, long_expected):
    block_bytes = make_tiny_llm(tiny_model, num_blocks=1).kv_stats()["bytes_per_block"]
    for slots in (0, 1, 5):  # none, too few for any victim, enough for some
        llm = make_tiny_llm(tiny_model, preemption_mode="swap", swap_space=slots * block_bytes / 2**30, **TIGHT)
        assert llm.engine.swap_space.tier.num_slots == slots
        assert tokens(llm.generate(long_prompts, LONG, use_tqdm=False)) == long_expected
        stats = llm.kv_stats()
        assert stats["num_preemptions"] > 0
        assert (stats["swap_out_blocks"] > 0) == (slots == 5)
        assert_pool_empty(llm)
        assert_tiers_empty(llm)


@pytest.mark.parametrize("case", ["forks", "speculation", "prefix tier"])
def test_swap_works_with_forks_speculation_and_the_prefix_tier(tiny_model, case):
    """Forks (n = 2, seeded sampling) share their prompt's blocks: a fork is recomputed, a sequence holding its
    blocks alone is swapped. Verifying ngram drafts and storing cached blocks in a tier go on as before."""
    prompts = random_prompts(5, seed=4, low=20, high=35)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    settings_ = {"enable_chunked_prefill": True}
    params = greedy
    if case == "forks":
        params = [
            SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) if i % 2 else greedy
            for i in range(len(prompts))
        ]
    elif case == "speculation":
        settings_["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    else:
        settings_.update(enable_prefix_caching=True, kv_offloading_size=0.01)

    def completions(llm):
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = completions(make_tiny_llm(tiny_model, num_blocks=256, **settings_))
    llm = make_tiny_llm(tiny_model, preemption_mode="swap", **TIGHT | {"max_num_seqs": 6}, **settings_)
    assert completions(llm) == expected
    stats = llm.kv_stats()
    assert stats["swap_out_blocks"] > 0 and stats["num_preemptions"] > 0
    assert_pool_empty(llm)
    assert_tiers_empty(llm)


class Interrupt(Exception):
    pass


def test_an_interrupted_step_leaves_both_tiers_consistent(tiny_model, long_prompts, long_expected):
    """Steps fail before their copies are made, again and again; swapped-out sequences of a failed step are
    recomputed instead, and the engine still finishes every request with the same tokens."""
    llm = make_tiny_llm(
        tiny_model, preemption_mode="swap", enable_prefix_caching=True, kv_offloading_size=0.001, **TIGHT
    )
    engine, steps, moving = llm.engine, [0], [0]

    def fail_often(plan):  # every other step that moves blocks between tiers, and every seventh step
        steps[0] += 1
        moving[0] += bool(plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_load)
        if (moving[0] % 2 and (plan.blocks_to_swap_out or plan.blocks_to_swap_in)) or steps[0] % 7 == 0:
            raise Interrupt

    engine.forward_observers.append(fail_often)
    ids = [engine.add_request(engine.make_request(p, LONG)) for p in long_prompts]
    outputs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
        except Interrupt:
            failures += 1
    assert failures > 0 and [outputs[i] for i in ids] == long_expected
    assert_pool_empty(llm)
    assert_tiers_empty(llm)


def test_a_failing_swap_copy_is_rolled_back_and_the_engine_stays_usable(tiny_model, long_prompts, long_expected):
    """The tier's write fails (a disk error): generate raises it, aborts its requests, and leaves no block behind."""
    llm = make_tiny_llm(tiny_model, preemption_mode="swap", **TIGHT)
    tier = llm.engine.swap_space.tier
    save = tier.save

    def failing_save(copies):
        raise OSError("No space left on device")

    tier.save = failing_save
    with pytest.raises(OSError, match="No space"):
        llm.generate(long_prompts, LONG, use_tqdm=False)
    assert_pool_empty(llm)
    assert_tiers_empty(llm)
    tier.save = save
    assert tokens(llm.generate(long_prompts, LONG, use_tqdm=False)) == long_expected


# ---- tier files: each engine its own --------------------------------------------------------------------------------


def run_side_by_side(llms, prompt_lists, params) -> list[list[list[int]]]:
    """Step the engines in turn, one step each, until all finish: their tiers' writes interleave."""
    engines = [llm.engine for llm in llms]
    ids = [
        [engine.add_request(engine.make_request(p, params)) for p in prompts]
        for engine, prompts in zip(engines, prompt_lists)
    ]
    outputs = [{} for _ in engines]
    while any(engine.has_unfinished_requests() for engine in engines):
        for engine, done in zip(engines, outputs):
            if engine.has_unfinished_requests():
                done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    return [[done[i] for i in request_ids] for done, request_ids in zip(outputs, ids)]


def test_two_engines_swapping_into_one_folder_keep_their_own_blocks(tiny_model, long_prompts, long_expected, tmp_path):
    others = random_prompts(4, seed=21, low=30, high=31)
    llms = [
        make_tiny_llm(tiny_model, preemption_mode="swap", swap_space=0.01, kv_offload_dir=tmp_path, **TIGHT)
        for _ in range(2)
    ]
    got = run_side_by_side(llms, [long_prompts, others], LONG)
    assert got == [long_expected, [hf_greedy(tiny_model, p, LONG.max_tokens) for p in others]]
    assert all(llm.kv_stats()["swap_out_blocks"] > 0 for llm in llms)
    files = [llm.kv_offload_files()["swap"] for llm in llms]
    assert files[0] != files[1] and sorted(map(str, tmp_path.iterdir())) == sorted(files)


def test_two_engines_sharing_a_prefix_tier_folder_get_their_own_hits(tiny_model, tmp_path):
    """Each engine's prefix tier serves its system prompt after its pool forgot it, while the other engine stores
    blocks of its own in the same folder: every hit must be the engine's own K/V."""
    systems = random_prompts(2, seed=22, low=40, high=41)
    fillers = random_prompts(3, seed=6, low=88, high=89)
    llms = [
        make_tiny_llm(
            tiny_model, num_blocks=12, enable_prefix_caching=True, kv_offloading_size=0.01, kv_offload_dir=tmp_path
        )
        for _ in range(2)
    ]
    got, expected = [[], []], [[], []]
    for round_, question in enumerate(random_prompts(3, seed=23, low=5, high=10)):
        for llm, system, out, want in zip(llms, systems, got, expected):
            prompt = system + question
            out += tokens(llm.generate([prompt], SHORT, use_tqdm=False))
            want.append(hf_greedy(tiny_model, prompt, SHORT.max_tokens))
            llm.generate([fillers[round_]], SHORT, use_tqdm=False)  # the pool forgets the system prompt
    assert got == expected
    assert [llm.kv_stats()["offload_hit_tokens"] for llm in llms] == [2 * 40, 2 * 40]
    files = [llm.kv_offload_files()["prefix"] for llm in llms]
    assert files[0] != files[1] and sorted(map(str, tmp_path.iterdir())) == sorted(files)


def test_a_tier_file_lives_as_long_as_its_engine(tiny_model, tmp_path):
    llm = make_tiny_llm(
        tiny_model,
        preemption_mode="swap",
        swap_space=0.01,
        enable_prefix_caching=True,
        kv_offloading_size=0.01,
        kv_offload_dir=tmp_path / "tiers",
    )
    files = llm.kv_offload_files()
    assert sorted(files) == ["prefix", "swap"]
    assert all(
        Path(path).parent == tmp_path / "tiers" and Path(path).name.startswith(f"paged-{kind}-")
        for kind, path in files.items()
    )
    del llm
    gc.collect()
    assert list((tmp_path / "tiers").iterdir()) == []


def test_a_file_a_live_tier_holds_is_refused_and_a_stale_one_is_deleted(tiny_model, tmp_path):
    cache = make_tiny_llm(tiny_model, num_blocks=4).engine.kv_cache
    tier = KVTier(cache, 2, tmp_path / "swap.kv")
    with pytest.raises(ValueError, match="belongs to another live tier"):
        KVTier(cache, 2, tmp_path / "swap.kv")
    tier.close()
    assert not (tmp_path / "swap.kv").exists()
    KVTier(cache, 2, tmp_path / "swap.kv").close()  # free again
    # A process killed with its tier open leaves an unlocked file behind; the next engine in the folder deletes it.
    script = (
        f"import os, sys, torch; sys.path[:0] = {sys.path!r}\n"
        f"from paged.engine.kv_cache import KVCache; from paged.offload import KVTier\n"
        f"tier = KVTier(KVCache(1, 1, 4, 4, 8), 2, {str(tmp_path)!r}, kind='swap')\n"
        f"print(tier.path, flush=True); os._exit(0)\n"
    )
    stale = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(stale).exists()
    llm = make_tiny_llm(tiny_model, preemption_mode="swap", swap_space=0.01, kv_offload_dir=tmp_path)
    assert not Path(stale).exists() and list(tmp_path.iterdir()) == [Path(llm.kv_offload_files()["swap"])]


# ---- the prefix cache's tier -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("disk", [False, True])
def test_the_tier_serves_evicted_prefixes_with_greedy_tokens_unchanged(tiny_model, tmp_path, disk):
    system = random_prompts(1, seed=3, low=40, high=41)[0]
    prompts = [system + p for p in random_prompts(4, seed=5, low=5, high=10)]
    fillers = random_prompts(4, seed=6, low=88, high=89)  # with 5 new tokens, all 12 blocks: the pool forgets
    expected = [hf_greedy(tiny_model, prompt, SHORT.max_tokens) for prompt in prompts]
    llm = make_tiny_llm(
        tiny_model,
        num_blocks=12,
        enable_prefix_caching=True,
        kv_offloading_size=0.01,
        kv_offload_dir=tmp_path if disk else None,
    )
    got = []
    for prompt, filler in zip(prompts, fillers):
        got += tokens(llm.generate([prompt], SHORT, use_tqdm=False))
        llm.generate([filler], SHORT, use_tqdm=False)
    assert got == expected
    stats = llm.kv_stats()
    assert stats["prefix_hit_tokens"] == 0  # the pool never kept the system prompt
    assert stats["offload_hit_tokens"] == 3 * 40  # 5 blocks of 8, for each later prompt
    assert stats["offload_stored_blocks"] > 0
    assert_pool_empty(llm)


def test_tier_blocks_come_back_bit_exact_and_the_tier_evicts_least_recently_used():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=3, num_blocks=8, block_size=2, dtype=torch.float64)
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    tier = PrefixTier(manager, KVTier(cache, num_slots=2))
    torch.manual_seed(0)
    cache.storage.normal_()
    original = cache.storage.clone()
    prompts = {name: [i, i, i, i, 0] for i, name in enumerate("abc", start=1)}  # 2 full blocks to cache each
    for seq_id, prompt in enumerate(prompts.values()):
        manager.allocate(seq_id, 3)  # only the first block is cached: 2 full tokens
        tier.store(manager.cache_full_blocks(seq_id, prompt, 2))
    assert tier.stored_blocks == 3 and len(tier.entries) == 2
    assert tier.find(prompts["a"], None, skip=0) == []  # 'a' was the least recently used: evicted
    hits = tier.find(prompts["b"], None, skip=0)
    assert len(hits) == 1
    b_block = manager.block_tables[1][0]
    manager.free(1)
    for seq_id in (0, 2):
        manager.free(seq_id)
    cache.storage.zero_()
    manager.allocate(9, 5)
    copies, registered = tier.load(9, 0, hits)
    tier.tier.load(copies)
    target = manager.block_tables[9][0]
    assert torch.equal(cache.storage[:, :, target], original[:, :, b_block])
    assert registered == [] or registered[0].block_id == target
    assert tier.hit_tokens == 2


# ---- the state machine over the pool and both tiers ------------------------------------------------------------------


def stamp(prefix: tuple[int, ...]) -> float:
    """What the K of the last token of `prefix` is, in this model of a forward pass: a function of the whole prefix
    (as real K/V are), exact in float64. V holds its negative."""
    return float(int.from_bytes(hashlib.sha256(repr(prefix).encode()).digest()[:5], "big"))


class PoolAndTiers(RuleBasedStateMachine):
    """Sequences are allocated, grown, forked, swapped out and in, freed; the pool is flooded to evict its idle
    cached blocks, which the prefix tier keeps. Every copy the engine would make is made on a tiny KV cache whose
    slots hold a stamp of their token's prefix, so any misplaced or stale block shows."""

    BLOCK_SIZE, NUM_BLOCKS = 2, 10

    def __init__(self):
        super().__init__()
        self.cache = KVCache(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            num_blocks=self.NUM_BLOCKS,
            block_size=self.BLOCK_SIZE,
            dtype=torch.float64,
        )
        self.manager = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE, enable_prefix_caching=True)
        self.swap = SwapSpace(self.manager, KVTier(self.cache, num_slots=6))
        self.prefix = PrefixTier(self.manager, KVTier(self.cache, num_slots=4))
        self.running: dict[int, list[int]] = {}  # seq_id -> token ids, all computed
        self.swapped: dict[int, list[int]] = {}
        self.next_id = 0
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}
        self.history: list[list[int]] = []
        self.tier_hits = 0  # block hash -> the token ids up to the block's end

    # -- the forward pass, modelled
    def compute(self, seq_id: int, token_ids: list[int], start: int) -> None:
        slots = self.manager.slot_mapping(seq_id, start, len(token_ids))
        flat = self.cache.storage.view(2, -1)  # [K/V, num_blocks * block_size]
        for t, slot in zip(range(start, len(token_ids)), slots):
            flat[0, slot] = stamp(tuple(token_ids[: t + 1]))
            flat[1, slot] = -stamp(tuple(token_ids[: t + 1]))
        self.cache_and_store(seq_id, token_ids)

    def cache_and_store(self, seq_id: int, token_ids: list[int]) -> None:
        self.prefix.store(self.manager.cache_full_blocks(seq_id, token_ids, len(token_ids)))
        for index, block_hash in enumerate(self.manager.block_hashes.get(seq_id, [])):
            self.prefix_of[block_hash] = tuple(token_ids[: (index + 1) * self.BLOCK_SIZE])

    def block_holds(self, storage: torch.Tensor, block_hash: bytes) -> bool:
        """storage [2, 1, block_size, 1, 1]: a pool block or a tier slot, against the stamps of its prefix."""
        prefix = self.prefix_of[block_hash]
        expected = torch.tensor(
            [stamp(prefix[: t + 1]) for t in range(len(prefix) - self.BLOCK_SIZE, len(prefix))], dtype=torch.float64
        )
        return torch.equal(storage[0].flatten(), expected) and torch.equal(storage[1].flatten(), -expected)

    def assert_holds(self, seq_id: int, token_ids: list[int]) -> None:
        slots = self.manager.slot_mapping(seq_id, 0, len(token_ids))
        flat = self.cache.storage.view(2, -1)
        expected = torch.tensor([stamp(tuple(token_ids[: t + 1])) for t in range(len(token_ids))], dtype=torch.float64)
        assert torch.equal(flat[0, slots], expected) and torch.equal(flat[1, slots], -expected)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(token_ids=st.lists(st.integers(1, 3), min_size=1, max_size=9))
    def add(self, token_ids):
        self.history.append(token_ids)
        self.start(token_ids)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), more=st.lists(st.integers(1, 3), max_size=3))
    def add_again(self, data, more):
        """A prompt seen before, perhaps extended: its blocks may be in the pool, in the tier, or gone."""
        self.start(data.draw(st.sampled_from(self.history)) + more)

    def start(self, token_ids: list[int]) -> None:
        seq_id = self.new_id()
        hits = self.manager.find_cached_prefix(token_ids)
        tier_hits = self.prefix.find(token_ids, None, skip=len(hits))
        num_cached = (len(hits) + len(tier_hits)) * self.BLOCK_SIZE
        if self.manager.can_allocate(len(token_ids), seq_id, hits) is not AllocStatus.OK:
            return
        self.manager.allocate(seq_id, len(token_ids), hits)
        copies, loaded = self.prefix.load(seq_id, len(hits), tier_hits)
        self.prefix.tier.load(copies)
        self.compute(seq_id, token_ids, num_cached)
        self.prefix.store(loaded)
        self.assert_holds(seq_id, token_ids)
        self.tier_hits += len(tier_hits)
        self.running[seq_id] = list(token_ids)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), more=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def grow(self, data, more):
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        token_ids = self.running[seq_id] + more
        start = len(self.running[seq_id])
        if self.manager.can_allocate(len(token_ids), seq_id, write_from=start) is not AllocStatus.OK:
            return
        self.manager.allocate(seq_id, len(token_ids), write_from=start)
        copies = self.manager.take_pending_copies()  # copy-on-write of a shared last block
        if copies:
            self.cache.copy_blocks(*map(list, zip(*copies)))
        self.compute(seq_id, token_ids, start)
        self.assert_holds(seq_id, token_ids)
        self.running[seq_id] = token_ids

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.running)))
        child = self.new_id()
        self.manager.fork(parent, child)
        self.running[child] = list(self.running[parent])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        token_ids = self.running[seq_id]
        if not self.swap.can_swap_out(seq_id, len(token_ids)):
            shared = any(self.manager.ref_count(b) > 1 for b in self.manager.block_tables[seq_id])
            assert shared or self.swap.tier.num_free < len(self.manager.block_tables[seq_id])
            return
        self.swap.tier.save(self.swap.swap_out(seq_id, len(token_ids)))
        self.swapped[seq_id] = self.running.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        token_ids = self.swapped[seq_id]
        if self.manager.can_allocate(len(token_ids)) is not AllocStatus.OK:
            return
        self.swap.tier.load(self.swap.swap_in(seq_id, len(token_ids)))
        self.assert_holds(seq_id, token_ids)  # bit for bit what went out
        self.cache_and_store(seq_id, token_ids)
        self.running[seq_id] = self.swapped.pop(seq_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(seq_id)
        del self.running[seq_id]

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        self.swap.discard(seq_id)
        del self.swapped[seq_id]

    @rule()
    def flood(self):
        """A scratch sequence takes every free block and scribbles over it: the pool evicts its idle cached blocks."""
        free = self.manager.num_free_blocks
        if free:
            self.manager.allocate(-1, free * self.BLOCK_SIZE)
            self.cache.storage[:, :, self.manager.block_tables[-1]] = float("nan")
            self.manager.free(-1)

    # -- invariants
    @invariant()
    def ref_counts_are_exact_and_nothing_leaks(self):
        assert_ref_counts_exact(self.manager)

    @invariant()
    def a_swapped_sequence_is_in_the_tier_only(self):
        assert set(self.swap.slots) == set(self.swapped)
        assert not set(self.swapped) & set(self.manager.block_tables)
        assert set(self.running) == set(self.manager.block_tables)
        used = [slot for slots in self.swap.slots.values() for slot in slots]
        assert len(used) == len(set(used)) and not set(used) & set(self.swap.tier.free_slots)
        assert len(used) + self.swap.tier.num_free == self.swap.tier.num_slots
        for seq_id, token_ids in self.swapped.items():
            assert len(self.swap.slots[seq_id]) == -(-len(token_ids) // self.BLOCK_SIZE)

    @invariant()
    def the_prefix_tier_holds_each_hash_once_and_intact(self):
        slots = [slot for _, slot in self.prefix.entries.values()]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self.prefix.tier.free_slots)
        assert len(slots) + self.prefix.tier.num_free == self.prefix.tier.num_slots
        for block_hash, (key, slot) in self.prefix.entries.items():
            assert self.manager.hash_function(*key) == block_hash
            assert self.block_holds(self.prefix.tier.storage[slot], block_hash)

    @invariant()
    def cached_pool_blocks_hold_their_tokens(self):
        for block_hash, block in self.manager.cached.items():
            assert block.block_hash == block_hash
            assert self.manager.hash_function(*block.hash_key) == block_hash
            assert self.block_holds(self.cache.storage[:, :, block.block_id], block_hash)
        for seq_id, token_ids in self.running.items():
            self.assert_holds(seq_id, token_ids)


TestPoolAndTiers = PoolAndTiers.TestCase
TestPoolAndTiers.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_state_machine_reaches_tier_hits_and_swaps():
    """The rules above are not vacuous: a plain run of them loads blocks from the tier and swaps sequences."""
    machine = PoolAndTiers()
    machine.add([1, 2, 3, 1, 2, 3, 1])
    first = max(machine.running)
    machine.manager.free(first)
    del machine.running[first]
    machine.flood()
    machine.start([1, 2, 3, 1, 2, 3, 1])
    assert machine.tier_hits == 3
    seq_id = max(machine.running)
    machine.swap.tier.save(machine.swap.swap_out(seq_id, 7))
    assert machine.swap.num_swapped == 1 and seq_id not in machine.manager.block_tables
