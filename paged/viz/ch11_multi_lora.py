"""Chapter 11's pictures (guide §16): LoRA's low-rank update on one layer, a batch with an adapter index per token,
the adapter slots beside the host registry, the memory of one base model plus N adapters, and the answers of one
mixed batch side by side."""

import html
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

from paged.viz.common import PALETTE, html_table, player

BASE_COLOUR = "#d9d9d9"  # a token no adapter touches: the base matmul alone
_TOKEN_STYLE = (
    "display:inline-block;min-width:18px;height:20px;margin:1px;padding:0 2px;border-radius:3px;"
    "text-align:center;font:11px/20px monospace;color:#111;border:1px solid #888;"
)


def adapter_colour(name: str | None, names: list[str]) -> str:
    """The base model grey; adapters by their place in `names`."""
    return BASE_COLOUR if name is None else PALETTE[names.index(name) % len(PALETTE)]


def plot_lora_update(weight, lora_a, lora_b, scaling: float, title: str = "", crop: int = 96):
    """W [d_out, d_in], B [d_out, r], A [r, d_in] and the update scaling * B A [d_out, d_in], the top-left `crop`
    rows and columns of each, on one colour scale per panel; the titles give the full shapes."""
    weight, lora_a, lora_b = (np.asarray(t, dtype=np.float64) for t in (weight, lora_a, lora_b))
    update = scaling * lora_b @ lora_a
    panels = [
        ("W", weight[:crop, :crop], weight.shape),
        ("B", lora_b[:crop], lora_b.shape),
        ("A", lora_a[:, :crop], lora_a.shape),
        (f"{scaling:g} · B A", update[:crop, :crop], update.shape),
    ]
    widths = [crop, max(lora_b.shape[1], 8), crop, crop]
    fig, axes = plt.subplots(1, 4, figsize=(11, 3.2), gridspec_kw={"width_ratios": widths})
    for ax, (name, values, shape) in zip(axes, panels):
        limit = float(np.abs(values).max()) or 1.0
        ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
        ax.set_title(f"{name}\n{shape[0]} × {shape[1]}", fontsize=10)
        ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(title or "W + scaling · B A", fontsize=11)
    fig.tight_layout()
    return fig


def segments(indices: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal adapter index in a batch's token order, as (start, end, index): the segments a segmented
    gather (SGMV) walks, one shrink and one expand each. -1, the base model, is a run too."""
    runs: list[tuple[int, int, int]] = []
    for position, index in enumerate(indices):
        if runs and runs[-1][2] == index and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1, index)
        else:
            runs.append((position, position + 1, index))
    return runs


def token_indices_html(requests: list[dict], slots: list[str | None]) -> str:
    """One step's batch flattened to tokens, the way the forward pass sees it. `requests`: per scheduled request
    {"request", "adapter" (a name or None), "tokens" (the token texts it brings to this step)}; `slots`: the adapter in
    each slot. Three rows: the tokens coloured by adapter; each token's slot index (-1: base only); and the segments
    of equal index that the shrink and expand kernels take one at a time. The base matmul takes every token at once."""
    names = [name for name in slots if name is not None]
    cells, index_cells, indices = [], [], []
    for request in requests:
        name = request["adapter"]
        index = -1 if name is None else slots.index(name)
        colour = adapter_colour(name, names)
        for token in request["tokens"]:
            label = html.escape(token.replace(" ", "␣").replace("\n", "⏎"))
            cells.append(
                f'<div class="tok" data-request="{html.escape(str(request["request"]))}" '
                f'data-index="{index}" style="{_TOKEN_STYLE}background:{colour}">{label}</div>'
            )
            index_cells.append(f'<div class="idx" style="{_TOKEN_STYLE}background:{colour}">{index}</div>')
            indices.append(index)
    runs = "".join(
        f'<div class="seg" data-index="{index}" data-start="{start}" data-end="{end}" style="display:inline-block;'
        f"margin:1px;padding:0 4px;border-radius:3px;font:11px/20px monospace;background:"
        f'{BASE_COLOUR if index < 0 else adapter_colour(slots[index], names)}">'
        f"{'base' if index < 0 else html.escape(str(slots[index]))} [{start}:{end})</div>"
        for start, end, index in segments(indices)
    )
    legend = " ".join(
        f'<span style="background:{adapter_colour(name, names)};padding:0 4px">slot {i}: {html.escape(name)}</span>'
        for i, name in enumerate(slots)
        if name is not None
    )
    label = 'style="display:inline-block;width:120px;font:12px sans-serif;vertical-align:top"'
    return (
        f'<div class="token-indices"><div style="font:12px sans-serif;margin:2px 0">{len(indices)} tokens in '
        f'this step; <span style="background:{BASE_COLOUR};padding:0 4px">base only</span> {legend}</div>'
        f'<div style="white-space:nowrap"><span {label}>tokens</span>{"".join(cells)}</div>'
        f'<div style="white-space:nowrap"><span {label}>adapter index</span>{"".join(index_cells)}</div>'
        f'<div style="white-space:nowrap"><span {label}>segments</span>{runs}</div></div>'
    )


@dataclass(frozen=True)
class SlotSnapshot:
    """The adapters resident in slots, the host registry, and what the step that led here did."""

    slots: tuple[str | None, ...]  # the adapter in each slot (None: empty)
    registry: tuple[str, ...]  # every adapter the host knows, in the order it was registered
    wanted: tuple[str, ...]  # the adapters the batch that led here needed
    loaded: tuple[str, ...]  # copied from the host into a slot for it
    evicted: tuple[str, ...]  # sent out of their slot to make room
    caption: str = ""


def engine_slots(
    engine, wanted: tuple = (), loaded: tuple = (), evicted: tuple = (), caption: str = ""
) -> SlotSnapshot:
    """A SlotSnapshot of a LoRA engine (enable_lora=True): its slots and its host registry, by adapter name."""
    manager = engine.lora
    names = {lora_id: adapter.name for lora_id, adapter in manager.registry.items()}
    return SlotSnapshot(
        tuple(names.get(lora_id) for lora_id in manager.slots.slot_ids),
        tuple(names.values()),
        tuple(wanted),
        tuple(loaded),
        tuple(evicted),
        caption,
    )


def slot_replay(llm, prompt, steps: list[list]) -> list[SlotSnapshot]:
    """Drive a LoRA engine one batch per entry of `steps` (a list of LoRARequests): the prompt under each of them,
    one token each, so that the batch is one step and leaves; a snapshot of the slots before the first and after
    each. Which slot an adapter gets, and which adapter leaves, is the engine's own doing."""
    from paged.sampling_params import SamplingParams

    engine = llm.engine
    frames = [
        engine_slots(
            engine, caption=f"{engine.lora.max_loras} slots, {len(engine.lora.registry)} adapters in the host registry"
        )
    ]
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    for step, requests in enumerate(steps, start=1):
        before = frames[-1].slots
        llm.generate([prompt] * len(requests), one_token, lora_request=list(requests), use_tqdm=False)
        after = engine_slots(engine).slots
        changed = [(old, new) for old, new in zip(before, after) if old != new]
        loaded = tuple(new for _, new in changed)
        evicted = tuple(old for old, _ in changed if old is not None)
        wanted = tuple(dict.fromkeys(request.lora_name for request in requests))
        caption = (
            f"batch {step} needs {', '.join(wanted)}"
            + (f"; loads {', '.join(loaded)}" if loaded else "; every one already in a slot")
            + (f"; evicts {', '.join(evicted)} (least recently used)" if evicted else "")
        )
        frames.append(engine_slots(engine, wanted, loaded, evicted, caption))
    return frames


def slot_snapshot_html(snap: SlotSnapshot) -> str:
    """The slots as boxes (an adapter this step uses outlined, one just loaded marked), then the host registry with
    every adapter that is resident shaded."""
    names = list(snap.registry)
    boxes = []
    for i, name in enumerate(snap.slots):
        colour = "#ffffff" if name is None else adapter_colour(name, names)
        outline = "3px solid #111" if name in snap.wanted else "1px solid #888"
        mark = " (loaded)" if name in snap.loaded else ""
        boxes.append(
            f'<div class="slot" data-slot="{i}" data-adapter="{html.escape(name or "")}" style="display:'
            f"inline-block;width:110px;height:44px;margin:3px;border-radius:6px;border:{outline};"
            f'background:{colour};font:12px/20px sans-serif;text-align:center">slot {i}<br>'
            f"{html.escape(name or 'empty')}{mark}</div>"
        )
    entries = []
    for name in names:
        resident = name in snap.slots
        style = f"background:{adapter_colour(name, names)}" if resident else "background:#fff;color:#555"
        evicted = " evicted" if name in snap.evicted else ""
        entries.append(
            f'<span class="registry-entry" data-adapter="{html.escape(name)}" '
            f'data-resident="{int(resident)}" style="display:inline-block;margin:2px;padding:0 5px;'
            f'border:1px solid #888;border-radius:3px;font:12px/20px monospace;{style}">'
            f"{html.escape(name)}{evicted}</span>"
        )
    return (
        f'<div class="slots-view"><div class="caption" style="font:13px sans-serif;margin:4px 0">'
        f"{html.escape(snap.caption)}</div><b>slots</b> (device memory, stacked weights)<div>{''.join(boxes)}</div>"
        f"<b>host registry</b> (shaded: resident in a slot)<div>{''.join(entries)}</div></div>"
    )


def slot_player(frames: list[SlotSnapshot], interval_ms: int = 1200) -> widgets.VBox:
    """A player over slot snapshots; its first frame is on show before anything moves."""
    return player([slot_snapshot_html(frame) for frame in frames], interval_ms, label="batch")


def record_lora_step(engine) -> tuple[list[dict], list[str | None]]:
    """Run one engine step and return its batch as the forward pass laid it out (each adapter's tokens side by
    side): per scheduled sequence its request id, adapter name (None: the base model) and the token ids it brought
    to the step; and the adapter in each slot during the step. Chapter 11 turns it into token_indices_html's input."""
    manager, laid_out = engine.lora, []
    prepare_step = manager.prepare_step

    def recording(batch, running):
        ordered, lora_batch = prepare_step(batch, running)
        for seq, num_new in ordered:
            laid_out.append(
                {
                    "request": seq.request.request_id,
                    "adapter": seq.request.lora_request.lora_name if seq.request.lora_request else None,
                    "token_ids": seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new],
                }
            )
        return ordered, lora_batch

    manager.prepare_step = recording
    try:
        engine.step()
    finally:
        del manager.prepare_step  # the class's own method again
    return laid_out, list(engine_slots(engine).slots)


def memory_rows(base_bytes: int, adapter_bytes: int, counts: list[int]) -> list[dict]:
    """One base model plus N adapters against N full copies of the model (one merged model per adapter), in MiB."""
    mib = 2**20
    return [
        {
            "adapters": n,
            "one base + N adapters (MiB)": (base_bytes + n * adapter_bytes) / mib,
            "N merged models (MiB)": n * base_bytes / mib,
            "ratio": n * base_bytes / (base_bytes + n * adapter_bytes),
        }
        for n in counts
    ]


def memory_table_html(rows: list[dict]) -> str:
    return html_table(
        rows, formats={"one base + N adapters (MiB)": ",.1f", "N merged models (MiB)": ",.1f", "ratio": ".1f"}
    )


def batch_outputs_html(rows: list[dict], names: list[str]) -> str:
    """One row per request of one batch: its adapter (a chip in the adapter's colour), its prompt, its answer."""
    body = []
    for row in rows:
        name = row["adapter"]
        chip = (
            f'<span style="background:{adapter_colour(name, names)};padding:0 5px;border-radius:3px">'
            f"{html.escape(name or 'base')}</span>"
        )
        body.append(
            f'<tr class="answer" data-adapter="{html.escape(name or "")}"><td>{chip}</td>'
            f'<td style="text-align:left">{html.escape(row["prompt"])}</td>'
            f'<td style="text-align:left;font-family:monospace">{html.escape(row["text"])}</td></tr>'
        )
    return (
        "<table><thead><tr><th>adapter</th><th>prompt</th><th>answer</th></tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )
