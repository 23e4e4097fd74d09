"""Widgets and plots for the chapters: one module per chapter, what several chapters share in `common`.

Each picture is built in two layers: a pure function that returns data or an HTML string (tested without a
browser), and a thin matplotlib or ipywidgets wrapper that shows it. This is the only part of `paged` that imports
matplotlib or ipywidgets; nothing else in the package imports it. A chapter's module may draw on an earlier
chapter's (05 and 06 draw pools the way 03 does), never on a later one's.

    common                         HTML tables, the palette, the frame player
    ch01_kv_cache                  §1-§2   KV bytes per request, decode intensity
    ch02_fragmentation             §1, §3, §8   memory maps, utilisation, breakdowns, block-size sweep
    ch03_block_tables              §5-§6   pool snapshots, replays, block tables over the physical pool
    ch05_prefix_caching            §9      hash chains, cached pools, eviction order, TTFT
    ch06_copy_on_write             §10     forks, beam search frames, sharing savings
    ch07_continuous_batching       §11     the timeline of a replay
    ch08_chunked_prefill_goodput   §12-§13 token gaps, latency distributions, goodput
    ch09_speculative_decoding      §14     verify steps and their blocks, speedup against acceptance and batch, token histograms
    ch10_offload                   §15     the memory tiers, blocks moving out and back, swap-or-recompute
    ch10_disaggregation            §15     the prefill-to-decode handoff block by block, decode gaps
    ch11_multi_lora                §16     the low-rank update, adapter indices per token, slots, memory, styles
    ch12_reading_vllm              §7, §11 a decode step's parts against its memory floor
    ch13_serving                   §13     a streamed answer timed by the engine and the client, its tokens'
                                           log-probabilities, a server under load, its steps by scheduling
                                           policy, two servers against the request rate, their
                                           first tokens request by request
    ch14_parallel                  §1, §8  one block table over N ranks' pools of KV heads, an all-reduce's
                                           time against its bytes, a step's time against the parallel size
"""

from paged.viz.ch01_kv_cache import (
    decode_intensity_series,
    plot_decode_intensity,
    plot_request_bytes,
    request_bytes_series,
)
from paged.viz.ch02_fragmentation import (
    STATE_COLORS,
    SUMMARY_FORMATS,
    cell_fractions,
    memory_map_html,
    memory_map_widget,
    plot_block_size_sweep,
    plot_breakdown,
    plot_length_histograms,
    plot_utilisation_over_time,
    state_legend_html,
    step_caption,
    summary_table_html,
    utilisation_series,
)
from paged.viz.ch03_block_tables import (
    FREE_COLOUR,
    PoolSnapshot,
    block_cell,
    block_tables_html,
    decode_script,
    engine_snapshot,
    physical_pool_html,
    pool_player,
    replay,
    seq_colour,
    snapshot,
    snapshot_html,
)
from paged.viz.ch05_prefix_caching import (
    CACHED_OUTLINE,
    IDLE_CACHED_COLOUR,
    CacheSnapshot,
    cache_player,
    cache_pool_html,
    cache_snapshot,
    cache_snapshot_html,
    engine_cache_snapshot,
    hash_chain_html,
    hash_names,
    plot_ttft,
    prefix_replay,
    scheduled_prefills,
)
from paged.viz.ch06_copy_on_write import (
    beam_search_frames,
    fork_caption,
    plot_savings,
    plot_usage_over_time,
    savings_table_html,
    sequences_snapshot,
)
from paged.viz.ch07_continuous_batching import (
    TIMELINE_STATES,
    schedule_caption,
    timeline_html,
    timeline_player,
    timeline_states,
)
from paged.viz.ch08_chunked_prefill_goodput import empirical_cdf, plot_goodput, plot_latency_cdfs, plot_token_gaps
from paged.viz.ch09_speculative_decoding import (
    plot_speedup_curves,
    plot_speedup_vs_batch,
    plot_token_histograms,
    record_verifies,
    verify_steps_html,
)
from paged.viz.ch10_disaggregation import handoff_player, handoff_replay, plot_decode_gaps
from paged.viz.ch10_offload import (
    TIERS,
    plot_crossover,
    plot_ttft_tiers,
    record_tier_frames,
    tier_player,
    tier_snapshot_html,
    tiers_html,
)
from paged.viz.ch11_multi_lora import (
    BASE_COLOUR,
    SlotSnapshot,
    adapter_colour,
    batch_outputs_html,
    engine_slots,
    memory_rows,
    memory_table_html,
    plot_lora_update,
    record_lora_step,
    segments,
    slot_player,
    slot_replay,
    slot_snapshot_html,
    token_indices_html,
)
from paged.viz.ch12_reading_vllm import plot_step_parts, step_part_bars
from paged.viz.ch13_serving import (
    plot_load,
    plot_servers_by_rate,
    plot_step_trace,
    plot_stream_timing,
    plot_token_logprobs,
    plot_ttft_by_send_time,
    stream_timing_series,
)
from paged.viz.ch14_parallel import (
    draw_shared_block_table,
    plot_all_reduce,
    plot_engine_rates,
    plot_tp_step_time,
    shared_table_layout,
)
from paged.viz.common import PALETTE, html_table, player
