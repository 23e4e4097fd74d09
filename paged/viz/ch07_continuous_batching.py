"""Chapter 07's picture (guide §11): the timeline of a replay, one row per request and one column per engine step,
and a player over its steps. Chapter 08 draws its runs the same way."""

import html
from itertools import groupby

import ipywidgets as widgets

from paged.analysis.replay import ReplayResult
from paged.engine.metrics import StepRecord
from paged.viz.common import player

TIMELINE_STATES = {  # state -> (colour, legend)
    "": ("#ffffff", "not arrived"),
    "waiting": ("#f1ce63", "waiting"),
    "prefill": ("#4e79a7", "prefill (prompt chunk or recompute)"),
    "decode": ("#59a14f", "decode (one token)"),
    "preempted": ("#e15759", "preempted (blocks freed)"),
    "finished": ("#e8e8e8", "finished"),
}
_TIMELINE_STYLE = (
    "<style>.tl{border-collapse:collapse;font:10px monospace}.tl td{width:7px;height:12px;padding:0;"
    "border:1px solid #fff}.tl td.label{width:auto;padding-right:4px;border:0}.tl td.now{outline:"
    "2px solid #111}"
    + "".join(f".tl .s-{state or 'none'}{{background:{colour}}}" for state, (colour, _) in TIMELINE_STATES.items())
    + "</style>"
)


def timeline_states(result: ReplayResult) -> list[list[str]]:
    """What each request did in each step of a replay: rows = requests (trace order), columns = steps, each a key
    of TIMELINE_STATES. A request is waiting from its arrival until a step schedules it (or after a preemption)."""
    grid, done = [], set()
    for step in result.steps:
        prefills = {request_id for request_id, _ in step.prefills}
        column = []
        for record in result.requests:
            rid = record.request_id
            column.append(
                "finished"
                if rid in done
                else "decode"
                if rid in step.decodes
                else "prefill"
                if rid in prefills
                else "preempted"
                if rid in step.preempted
                else "waiting"
                if record.arrival_time <= step.start
                else ""
            )
        grid.append(column)
        done.update(step.finished)
    return [list(row) for row in zip(*grid)] if grid else [[] for _ in result.requests]


def schedule_caption(step: StepRecord) -> str:
    """One line on what a step ran: its clock interval, its tokens, prefill chunks, decodes, preemptions, finishes."""
    chunks = ", ".join(f"req {request_id}: {n}" for request_id, n in step.prefills) or "none"
    text = (
        f"step {step.index}: clock {step.start:.3f} to {step.start + step.duration:.3f}, "
        f"{step.num_batched_tokens} tokens = {len(step.decodes)} decodes + prefill chunks [{chunks}]"
    )
    if step.preempted:
        text += f"; preempted: req {', '.join(step.preempted)}"
    if step.finished:
        text += f"; finished: req {', '.join(step.finished)}"
    return text


def timeline_html(result: ReplayResult, upto: int | None = None, window: int = 60) -> str:
    """The timeline of steps [upto - window + 1, upto] (default: the last `window` steps), rows = requests; the column
    of step `upto` is outlined and captioned. Each cell's class is s-<state> (s-none: not arrived); a run of steps in
    one state before `upto` is one cell spanning them, which keeps a player's many frames small."""
    states = timeline_states(result)
    upto = len(result.steps) - 1 if upto is None else upto
    first = max(0, upto - window + 1)
    head = "".join(
        f'<td style="text-align:left">{k}</td>' if k % 10 == 0 else "<td></td>" for k in range(first, upto + 1)
    )
    rows = [f'<tr class="steps"><td class="label">step</td>{head}</tr>']
    for record, row in zip(result.requests, states):
        runs = [(state, len(list(run))) for state, run in groupby(row[first:upto])]
        cells = "".join(f'<td{f" colspan={n}" if n > 1 else ""} class="s-{state or "none"}"></td>' for state, n in runs)
        cells += f'<td class="s-{row[upto] or "none"} now"></td>'
        rows.append(f'<tr><td class="label">req {html.escape(record.request_id)}</td>{cells}</tr>')
    legend = " ".join(
        f'<span class="s-{state or "none"}" style="display:inline-block;width:10px;height:10px;'
        f'border:1px solid #999"></span> {name}'
        for state, (_, name) in TIMELINE_STATES.items()
    )
    caption = html.escape(schedule_caption(result.steps[upto])) if result.steps else "no steps"
    return (
        f'<div class="timeline">{_TIMELINE_STYLE}<div style="font:12px monospace;margin:2px 0">{caption}</div>'
        f'<table class="tl">{"".join(rows)}</table><div style="font:11px sans-serif">{legend}</div></div>'
    )


def timeline_player(result: ReplayResult, window: int = 60, interval_ms: int = 250) -> widgets.VBox:
    """A Play button and a slider over the steps of a replay: the timeline up to the chosen step."""
    frames = [timeline_html(result, step, window) for step in range(len(result.steps))]
    return player(frames, interval_ms, start=len(frames) - 1, label="step")
