"""What the chapters' pictures share: HTML tables, the colour palette, and the frame player.

Every widget of the book is a player over frames rendered in advance: the frames travel with the notebook, so a
slider moves through them in the browser itself, with or without a running kernel (and in the static edition).
"""

import html

import ipywidgets as widgets


def html_table(rows: list[dict], columns: list[str] | None = None, formats: dict | None = None) -> str:
    """An HTML table of dict rows; formats maps a column to a format spec ('.1%') or a function."""
    columns = columns or list(rows[0])
    formats = formats or {}

    def cell(column, value):
        spec = formats.get(column)
        text = spec(value) if callable(spec) else format(value, spec) if spec else str(value)
        align = "left" if column == columns[0] else "right"  # labels left, figures right
        return f"<td style='text-align:{align}'>{html.escape(text)}</td>"

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cell(c, row[c]) for c in columns) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7"]


def player(frames: list[str], interval_ms: int = 700, start: int = 0, label: str = "frame") -> widgets.VBox:
    """A Play button and a slider over HTML frames. Every frame is a child of a Stack whose selected index is linked
    to the slider in the browser (jslink), so moving the slider needs no kernel: the saved notebook and the static
    edition keep every frame browsable."""
    last = len(frames) - 1
    play = widgets.Play(min=0, max=last, value=start, interval=interval_ms, description="play")
    slider = widgets.IntSlider(min=0, max=last, value=start, description=label)
    view = widgets.Stack([widgets.HTML(frame) for frame in frames], selected_index=start)
    widgets.jslink((play, "value"), (slider, "value"))
    widgets.jslink((slider, "value"), (view, "selected_index"))
    return widgets.VBox([widgets.HBox([play, slider]), view])
