"""The guide's figures in one table, each recomputed by this package beside the value the guide states (guide §1-§18).

Every chapter of the book checks a few of the guide's numbers where its mechanism is built. This module gathers them:
`guide_numbers()` returns one `GuideNumber` per figure, with the value the package computes, the value the guide
states, and a verdict that is itself computed, never written down: a stated number agrees when the computed one,
rounded to the precision the guide gives, is the same number; a stated claim (a yes or no) agrees when the
computation says the same.

Where the guide is off, the row says why and what the right figure is. Most slips are one of three kinds: a binary
unit read as a decimal one (MiB as MB), a figure taken from another part of the guide than the one it is used in
(a pool of 40 GiB in a budget of 200), or a formula that forgets a term (the expected tokens of speculative decoding,
the first token of an answer, the per-card share of the weights). A figure the guide gives as a round number is
compared at the precision it is given with: "~50 GiB" at tens (`decimals=-1`).

Each row names the book's chapter that discusses it and a `key`, a regular expression that chapter's prose must
match (tests/test_guide_numbers.py reads the notebooks). Chapter 12 (reading vLLM) shows the table.
"""

from dataclasses import dataclass

import numpy as np

from paged.analysis.fragmentation import four_request_example
from paged.analysis.speculative_cost import expected_tokens
from paged.analysis.traces import sharegpt_trace
from paged.engine.metrics import RequestRecord
from paged.geometry import (
    H100_MEMORY,
    H100_SXM_BANDWIDTH,
    H100_SXM_BF16_FLOPS,
    LLAMA3_70B_PARAMS,
    GiB,
    KiB,
    KVGeometry,
    MiB,
    block_table_bytes,
    decode_step_flops_per_byte,
    read_time_s,
    worked_example,
)

GB = 1e9
PAPER_KV_IN_USE = (0.204, 0.382)  # vLLM paper, Fig. 2: share of reserved KV memory holding tokens, old systems
VLLM_V1_PREFIX_CACHING_DEFAULT = True  # vllm/config/cache.py, CacheConfig.enable_prefix_caching (chapter 12)
BELADY_REFERENCES = (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)  # the reference string of Belady, Nelson and Shedler (1969)
LLAMA2_7B_PARAMS = 6_738_415_616  # Llama-2-7B's weights: 32 layers of hidden size 4,096, a 32,000-token vocabulary


# small models the guide's arithmetic needs and the engine does not ---------------------------------------------------
def page_faults(policy: str, references, num_frames: int) -> int:
    """Page faults of FIFO or LRU replacement over a reference string with num_frames frames."""
    if policy not in ("fifo", "lru"):
        raise ValueError(f"policy must be 'fifo' or 'lru', got {policy!r}")
    frames: list = []  # fifo: oldest loaded first; lru: least recently used first
    faults = 0
    for page in references:
        if page in frames:
            if policy == "lru":
                frames.remove(page)
                frames.append(page)
            continue
        faults += 1
        if len(frames) == num_frames:
            frames.pop(0)
        frames.append(page)
    return faults


def shows_belady_anomaly(policy: str, references=BELADY_REFERENCES, max_frames: int = 6) -> bool:
    """True when adding a frame ever raises the number of faults. FIFO does on Belady's string (9 faults with 3
    frames, 10 with 4); LRU is a stack algorithm and never does."""
    faults = [page_faults(policy, references, n) for n in range(1, max_frames + 1)]
    return any(later > earlier for earlier, later in zip(faults, faults[1:]))


def chunk_sizes(prompt_len: int, budget: int, decode_tokens) -> list[int]:
    """Chunks of one long prompt under a per-step token budget, when step i first schedules decode_tokens[i] decodes
    (the last entry repeats): each chunk is what the budget leaves, the last one the rest of the prompt."""
    chunks, left, i = [], prompt_len, 0
    while left > 0:
        room = budget - decode_tokens[min(i, len(decode_tokens) - 1)]
        if room < 1:
            raise ValueError(f"step {i} leaves no room for a chunk: budget {budget}, decodes {decode_tokens[i]}")
        chunks.append(min(room, left))
        left -= chunks[-1]
        i += 1
    return chunks


def compute_bound_batch(geometry: KVGeometry, num_params: float, context_len: int, max_batch: int = 4096) -> int | None:
    """The smallest batch whose decode step reaches the H100's ridge (FLOPs per byte = peak FLOP/s / bandwidth),
    with every sequence at context_len tokens; None if no batch up to max_batch does."""
    ridge = H100_SXM_BF16_FLOPS / H100_SXM_BANDWIDTH
    return next(
        (
            batch
            for batch in range(1, max_batch + 1)
            if decode_step_flops_per_byte(geometry, num_params, batch, context_len) >= ridge
        ),
        None,
    )


def e2e_formula_holds(ttft: float = 1.0, tpot: float = 0.05, num_output_tokens: int = 20) -> bool:
    """Does end-to-end latency equal TTFT + output_length x TPOT (guide §13) for a request whose tokens come at
    TTFT and then every TPOT seconds? The first token arrives at TTFT, so only num_output_tokens - 1 gaps follow."""
    finished = ttft + tpot * (num_output_tokens - 1)
    record = RequestRecord("r", 1, num_output_tokens, 0.0, 0.0, ttft, finished)
    return abs(record.e2e_latency - (record.ttft + num_output_tokens * record.tpot)) < 1e-9


def lora_weights(num_layers: int, shapes, rank: int) -> int:
    """Weights of a LoRA adapter of one rank: for each targeted projection W [out, in] of each layer, A [rank, in] and
    B [out, rank]. shapes: the (out, in) of the projections targeted in every layer."""
    return num_layers * sum(rank * (out + inp) for out, inp in shapes)


def unaligned_fraction(prompt_lens, block_size: int) -> float:
    """Fraction of prompts whose last block is partly filled: forking any of them (parallel sampling, beam search)
    makes the first write of every child copy that block."""
    lens = np.asarray(prompt_lens)
    return float(np.mean(lens % block_size != 0))


# the table ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuideNumber:
    """One figure: what it is, the computed value (in `unit`), what the guide states and how precisely."""

    chapter: str  # the book's chapter the figure belongs to, "01"
    figure: str  # what is counted, in words
    computed: float  # the package's value, in `unit` (a bool for a claim)
    unit: str
    stated: float  # the guide's value, in `unit` (a bool for a claim)
    decimals: int = 0  # the precision the guide states it with
    note: str = ""  # how it is computed; for a figure the guide gets wrong, why
    shown_decimals: int | None = None  # decimals to show the computed value with (default: `decimals`)
    key: str = ""  # a regular expression the chapter's prose matches where it discusses the figure

    @property
    def agrees(self) -> bool:
        if isinstance(self.stated, bool):
            return bool(self.computed) == self.stated
        return round(self.computed, self.decimals) == round(self.stated, self.decimals)

    @property
    def verdict(self) -> str:
        return "agrees" if self.agrees else "corrected"

    def shown(self, value, decimals: int | None = None) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        decimals = max(self.decimals if decimals is None else decimals, 0)
        text = f"{value:,.{decimals}f}" if abs(value) < 1e7 else f"{value:.3g}"
        return f"{text} {self.unit}".strip()


def guide_numbers() -> list[GuideNumber]:
    """Every figure of the guide this book checks, recomputed. Rows are in the order of the book's chapters."""
    g = KVGeometry.llama3_70b()
    we = worked_example(g)
    four = four_request_example()["naive"].breakdown
    block_16 = g.block_bytes(16)
    weights = LLAMA3_70B_PARAMS * g.element_bytes  # bytes of fp16 weights, 141 GB
    chunks = chunk_sizes(8000, 2048, decode_tokens=[64, 65])
    sharegpt = sharegpt_trace(1000, seed=0)
    partial = unaligned_fraction([r.input_len for r in sharegpt], 16)
    low, high = (1 / share for share in reversed(PAPER_KV_IN_USE))
    rows = [
        GuideNumber(
            "01",
            "KV cache per token, Llama-3-70B fp16",
            g.bytes_per_token / KiB,
            "KiB",
            320,
            note="2 x 80 layers x 8 KV heads x 128 x 2 B = 327,680 B",
            key=r"320 KiB",
        ),
        GuideNumber(
            "01", "KV cache of one 2,048-token request", g.request_bytes(2048) / MiB, "MiB", 640, key=r"640 MiB"
        ),
        GuideNumber(
            "02",
            "§1: reserved KV per KV in use, the paper's measurement (guide: '5-10x')",
            low,
            "x",
            5,
            note=f"the paper's {PAPER_KV_IN_USE[0]:.1%} to {PAPER_KV_IN_USE[1]:.1%} of reserved KV in use is "
            f"{low:.1f}x to {high:.1f}x reserved per used, not the 5-10x the guide draws from it",
            shown_decimals=1,
            key=r"20\.4",
        ),
        GuideNumber(
            "01", "one block of one layer, block size 16", g.block_bytes_per_layer(16) / KiB, "KiB", 64, key=r"64 KiB"
        ),
        GuideNumber("03", "one block over 80 layers, block size 16", block_16 / MiB, "MiB", 5, key=r"5 MiB"),
        GuideNumber("01", "blocks in a 40 GiB pool", g.pool_blocks(40 * GiB, 16), "blocks", 8192, key=r"8,192 blocks"),
        GuideNumber("01", "tokens in a 40 GiB pool", g.pool_tokens(40 * GiB, 16), "tokens", 131072, key=r"131,072"),
        GuideNumber(
            "01",
            "K and V one layer reads for a 4,096-token decode",
            g.decode_read_bytes(4096, 1) / MiB,
            "MiB",
            16,
            key=r"16 MiB",
        ),
        GuideNumber(
            "01",
            "naive: 200 requests reserving 2,048 tokens each",
            we.naive_reserved_bytes / GiB,
            "GiB",
            125,
            key=r"125 GiB",
        ),
        GuideNumber(
            "01",
            "naive: reserved memory holding nothing at a mean of 400 tokens",
            100 * we.naive_waste_fraction,
            "%",
            80,
            note="1 - 400 / 2,048 = 80.5 %",
            key=r"80 %",
        ),
        GuideNumber(
            "01",
            "naive: requests a 200 GiB KV budget admits",
            we.naive_max_requests,
            "requests",
            320,
            key=r"320 requests",
        ),
        GuideNumber(
            "01",
            "naive: 'Used' = 200 requests x 400 tokens x 320 KiB",
            we.paged_reserved_bytes / GiB,
            "GiB",
            25.0,
            1,
            note="25,000 MiB is 24.4 GiB, as the guide's paged section itself says; the naive "
            "section's 25.0 divides MiB by 1,000",
            key=r"24\.4",
        ),
        GuideNumber("01", "paged: 200 requests x 125 MiB", we.paged_reserved_bytes / GiB, "GiB", 24.4, 1, key=r"24\.4"),
        GuideNumber(
            "01",
            "paged: requests a 200 GiB KV budget admits at a mean of 400",
            we.paged_max_requests,
            "requests",
            1638,
            note="200 GiB / (25 blocks x 5 MiB)",
            key=r"1,638",
        ),
        GuideNumber(
            "02",
            "§8: the naive batch the 200 GiB budget admits (guide: 'from 64')",
            we.naive_max_requests,
            "requests",
            64,
            note=f"64 is what §6's 40 GiB pool holds at 640 MiB a request; §8's 200 GiB "
            f"budget admits {we.naive_max_requests} naive requests, more than the 256 "
            "it then gives paging",
            key=r"64 \(naive\)",
        ),
        GuideNumber("02", "four-request example: slots holding tokens", four.live, "slots", 2880, key=r"2,880"),
        GuideNumber("02", "four-request example: slots reserved", four.allocated, "slots", 8192, key=r"8,192"),
        GuideNumber(
            "02",
            "four-request example: reserved slots wasted (guide: '~65%')",
            100 * four.wasted_fraction,
            "%",
            65,
            shown_decimals=1,
            key=r"64\.8",
        ),
        GuideNumber(
            "03",
            "block table [200, 512] int32",
            block_table_bytes(200, 8192, 16) / KiB,
            "KiB",
            400,
            note="200 sequences of up to 8,192 tokens at block size 16",
            key=r"400 KiB",
        ),
        GuideNumber(
            "04",
            "time to read those 16 MiB at 3.35 TB/s",
            read_time_s(g.decode_read_bytes(4096, 1)) * 1e6,
            "µs",
            4.8,
            1,
            note="16 MiB is 16.8 MB: 16,777,216 B / 3.35e12 B/s = 5.0 µs; 4.8 µs treats MiB as MB",
            key=r"5\.0 µs",
        ),
        GuideNumber(
            "06",
            "a fork's write into a shared partial block is rare (§10: 'very rare')",
            partial < 0.5,
            "",
            True,
            note=f"{partial:.0%} of ShareGPT-like prompts end inside a block of 16, so nearly every "
            "fork shares a partial last block that the children's first tokens write into "
            "(V0's copy-on-write); vLLM V1 shares only full blocks and has no copy-on-write",
            key=r"very rare",
        ),
        GuideNumber(
            "08",
            "§13: end-to-end latency = TTFT + output_length x TPOT",
            e2e_formula_holds(),
            "",
            True,
            note="the first token comes at TTFT, so n tokens leave n - 1 gaps: TTFT + (n - 1) x TPOT",
            key=r"n ?- ?1",
        ),
        GuideNumber(
            "09",
            "tokens per step: 75 % acceptance, 5 drafted tokens",
            expected_tokens(0.75, 5),
            "tokens",
            4,
            note="(1 - 0.75^6) / (1 - 0.75) = 3.29: acceptance stops at the first rejection",
            shown_decimals=2,
            key=r"3\.(29|3)\b",
        ),
        GuideNumber(
            "01",
            "worst tail waste of one request, block size 16",
            15 * g.bytes_per_token / MiB,
            "MiB",
            4.8,
            1,
            note="15 empty slots x 320 KiB = 4,800 KiB = 4.69 MiB; 4.8 reads KiB / 1,000 as MiB",
            shown_decimals=2,
            key=r"4\.69 MiB",
        ),
        GuideNumber(
            "01",
            "§1: memory left per card, 70B fp16 weights on two 80 GB H100s",
            (2 * H100_MEMORY - weights) / 2 / GB,
            "GB",
            20,
            -1,
            note=f"2 x 85.5 GB - 141.2 GB of weights = {(2 * H100_MEMORY - weights) / GB:.1f} GB for both "
            "cards, about 15 per card; the guide's 20 per card is what both keep together at nominal "
            "sizes (160 - 140 GB)",
            shown_decimals=1,
            key=r"\(15 GB\) per card|14\.9 GB",
        ),
        GuideNumber(
            "01",
            "§8: memory left per card, the same weights over four 80 GB H100s",
            (H100_MEMORY - weights / 4) / GiB,
            "GiB",
            50,
            -1,
            note="79.6 GiB - 32.9 GiB of weights = 46.8 GiB before activations: a fair '~50'",
            shown_decimals=1,
            key=r"46\.8 GiB",
        ),
        GuideNumber(
            "12",
            "§9: FLOPs that 1.5 B cached prefill tokens save, Llama-3-70B",
            2 * LLAMA3_70B_PARAMS * 1.5e9,
            "FLOPs",
            1.5e9,
            note="the 1.5 B is a count of prefill tokens; at 2 FLOPs per weight per token they are 2.1e20 "
            "FLOPs (attention not counted)",
            key=r"2\.1e20",
        ),
        GuideNumber(
            "12",
            "§9: LRU replacement shows Belady's anomaly",
            shows_belady_anomaly("lru"),
            "",
            True,
            note=f"Belady's string: FIFO faults {page_faults('fifo', BELADY_REFERENCES, 3)} with 3 frames, "
            f"{page_faults('fifo', BELADY_REFERENCES, 4)} with 4 (the anomaly); LRU "
            f"{page_faults('lru', BELADY_REFERENCES, 3)} and {page_faults('lru', BELADY_REFERENCES, 4)}",
            key=r"Belady",
        ),
        GuideNumber(
            "12",
            "§12: steps to prefill an 8,000-token prompt, budget 2,048, beside the running decodes",
            len(chunks),
            "steps",
            6,
            note=" + ".join(f"{c:,}" for c in chunks) + " = 8,000: 64 decodes in the first step, 65 after, "
            "as the guide's decomposition has it; its last chunk is not 256 tokens",
            key=r"1,983",
        ),
        GuideNumber(
            "12",
            "§16: a LoRA adapter's share of its model's weights (rank 16 on q and v, Llama-2-7B)",
            100 * lora_weights(32, [(4096, 4096)] * 2, 16) / LLAMA2_7B_PARAMS,
            "%",
            1,
            note="32 layers x 2 projections x 16 x (4,096 + 4,096) = 8,388,608 weights of 6.74 B: about a "
            "tenth of the guide's figure",
            shown_decimals=2,
            key=r"0\.12 %",
        ),
        GuideNumber(
            "12",
            "§18: vLLM V1 turns prefix caching on by default",
            VLLM_V1_PREFIX_CACHING_DEFAULT,
            "",
            False,
            note="read from vLLM's source: CacheConfig.enable_prefix_caching defaults to True (vllm/config/cache.py)",
            key=r"enable_prefix_caching = True",
        ),
        GuideNumber(
            "12",
            "§18: batch at which Llama-3-70B decode on an H100 turns compute-bound, 1,024-token context",
            compute_bound_batch(g, LLAMA3_70B_PARAMS, 1024),
            "sequences",
            512,
            note=f"the guide's 256-512 holds up to contexts of about 512 tokens (the ridge at batch "
            f"{compute_bound_batch(g, LLAMA3_70B_PARAMS, 512)}); at 2,048 tokens no batch reaches it",
            key=r"256.512",
        ),
    ]
    return sorted(rows, key=lambda row: row.chapter)  # stable: rows keep their order within a chapter


def corrections(rows=None) -> list[GuideNumber]:
    """The rows where the guide is off."""
    return [row for row in (rows or guide_numbers()) if not row.agrees]


def table_rows(rows=None) -> list[dict]:
    """The table as plain rows for a chapter's html_table."""
    return [
        {
            "chapter": r.chapter,
            "figure": r.figure,
            "computed": r.shown(r.computed, r.shown_decimals),
            "guide": r.shown(r.stated),
            "verdict": r.verdict,
            "why": r.note,
        }
        for r in (rows or guide_numbers())
    ]
