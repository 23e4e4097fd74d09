"""The chapters' pictures, checked without a browser: the pure functions behind them, and that the wrappers build."""

import ast
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

import paged
from paged.analysis.fragmentation import EXTERNAL, FREE, INTERNAL, LIVE, RESERVED, compare, simulate
from paged.analysis.traces import sharegpt_trace
from paged.geometry import LLAMA3_70B_PARAMS, KVGeometry
from paged.viz import (
    cell_fractions,
    decode_intensity_series,
    html_table,
    memory_map_html,
    memory_map_widget,
    plot_block_size_sweep,
    plot_breakdown,
    plot_decode_intensity,
    plot_request_bytes,
    plot_utilisation_over_time,
    request_bytes_series,
    summary_table_html,
)


def test_cell_fractions_and_memory_map():
    states = np.array([LIVE, LIVE, RESERVED, INTERNAL, FREE, FREE, EXTERNAL, EXTERNAL], dtype=np.int8)
    fractions = cell_fractions(states, 4)
    assert fractions.tolist() == [[0, 0.5, 0.25, 0.25, 0], [0.5, 0, 0, 0, 0.5]]
    page = memory_map_html(states, slots_per_cell=2, columns=2, title="tiny")
    assert page.count("<div style='background:") == 4 and "tiny" in page and "live 2, reserved 1, internal 1" in page
    with pytest.raises(ValueError, match="slots_per_cell"):
        cell_fractions(states, 3)


def test_memory_map_widget_scrubs_through_time():
    results = [simulate(sharegpt_trace(30), scheme, 4096, layout_every=10) for scheme in ("oracle", 16)]
    widget = memory_map_widget(results)
    (scheme, step), view = widget.children[0].children, widget.children[1]
    first = view.value
    step.value = 40
    assert view.value != first and "step 40" in view.value
    scheme.value = "paged-16"
    assert "paged-16" in view.value
    with pytest.raises(ValueError, match="layout_every"):
        memory_map_widget([simulate(sharegpt_trace(5), 16, 4096)])


def test_chapter_01_series_and_plots():
    geometry = KVGeometry.llama3_70b()
    assert request_bytes_series({"70B": geometry}, [2048])["70B"].tolist() == [640 * 2**20]
    intensity = decode_intensity_series(geometry, LLAMA3_70B_PARAMS, [1, 10**6], [2048])[2048]
    assert intensity[0] < 2 and intensity[1] < 295  # memory-bound at any batch size
    plot_request_bytes({"70B": geometry})
    plot_decode_intensity(geometry, LLAMA3_70B_PARAMS)


def test_chapter_02_tables_and_plots():
    summaries = [r.summary() for r in compare(sharegpt_trace(40), 4096, block_sizes=(16, 64))]
    page = summary_table_html(summaries)
    assert page.count("<tr>") == 1 + len(summaries) and "naive-pow2" in page and "%" in page
    plot_utilisation_over_time(compare(sharegpt_trace(40), 4096, block_sizes=(16,)))
    plot_breakdown(summaries)
    plot_block_size_sweep({"sharegpt": summaries})
    assert (
        html_table([{"a": 0.5}], formats={"a": ".0%"})
        == "<table><thead><tr><th>a</th></tr></thead><tbody><tr><td style='text-align:left'>50%</td></tr></tbody></table>"
    )


def test_nothing_in_paged_imports_the_pictures():
    """paged.viz sits on top of the engine: no other module of the package may import it."""
    package = Path(paged.__file__).parent
    for path in package.rglob("*.py"):
        if package / "viz" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name == "paged.viz" or name.startswith("paged.viz.") for name in names), path
