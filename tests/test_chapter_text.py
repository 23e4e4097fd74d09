"""What the chapters say, read from the committed notebooks: no residue, no measured figure in prose that no output
shows, and an index whose table maps every chapter to its guide sections and its real running time.

Three checks, each run per chapter so that a failure names the chapter:

- residue: progress bars in any output, unformatted placeholders (`{MIN_TILE}`) in markdown, stray notes such as
  "(not §7)", and talk of the machine or of earlier runs ("this machine", "an earlier run", ...);
- figures: in markdown, a number with a unit of time or speed (ms, µs, tok/s) or a speed-up ratio ("7.5x") must be
  printed by some code cell above it, unless the chapter's exemption list says why it need not be (a figure from the
  guide or the paper, or one computed from constants that cannot change between machines);
- times: chapter 00's time column equals each chapter's recorded running time, the sum of its code cells' execution
  times (nbconvert's `iopub.execute_input` to `shell.execute_reply`), rounded to whole seconds;
- sections: a chapter's numbered sections ("## 3. ...") count 1, 2, 3, ... in order, so that "section 3" means one.
"""

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))
INDEX = CHAPTERS / "00_index.ipynb"


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


def output_text(cell: dict) -> str:
    """Everything a code cell shows as text: streams (stdout and stderr), text/plain, HTML with its tags removed,
    tracebacks."""
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append(text(output["text"]))
        data = output.get("data", {})
        if "text/plain" in data:
            parts.append(text(data["text/plain"]))
        if "text/html" in data:
            parts.append(re.sub(r"<[^>]+>", " ", text(data["text/html"])))
        if "traceback" in output:
            parts.append("\n".join(output["traceback"]))
    return "\n".join(parts)


def chapter_id(path: Path) -> str:
    return path.stem


# residue --------------------------------------------------------------------------------------------------------------
PROGRESS_BAR = re.compile(r"\d+%\||it/s\]|s/it\]|[█▏▎▍▌▋▊▉]")  # tqdm: " 45%|████▌ | 9/20 [00:01<00:01, 8.2it/s]"
PLACEHOLDER = re.compile(r"\{[A-Z][A-Z0-9_]+\}")  # an f-string's field left unformatted
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)  # LaTeX may hold {AB}-like groups
STRAY_NOTE = re.compile(r"\(not §\s*\d+\)")
PHRASES = (
    "this machine",
    "when the book is tested",
    "an earlier run",
    "when this chapter was executed",
    "when the book was executed",
)


def residue(path: Path) -> list[str]:
    found = []
    for number, cell in enumerate(cells(path)):
        where = f"cell {number} ({cell['cell_type']})"
        if cell["cell_type"] == "markdown":
            prose = text(cell["source"])
            found += [f"{where}: placeholder {m}" for m in PLACEHOLDER.findall(MATH.sub(" ", prose))]
            found += [f"{where}: stray note {m}" for m in STRAY_NOTE.findall(prose)]
            found += [f"{where}: {p!r}" for p in PHRASES if p in prose.lower()]
        elif cell["cell_type"] == "code":
            shown = output_text(cell)
            found += [f"{where} output: progress bar {m!r}" for m in sorted(set(PROGRESS_BAR.findall(shown)))]
            found += [f"{where} output: {p!r}" for p in PHRASES if p in shown.lower()]
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=chapter_id)
def test_no_residue(notebook):
    assert residue(notebook) == []


def test_residue_is_found():
    """The patterns catch what they are for, and leave ordinary prose, tables and formulas alone."""
    assert PROGRESS_BAR.search(" 45%|████▌     | 9/20 [00:01<00:01,  8.20it/s]")
    assert PROGRESS_BAR.search("Loading weights: 100%|##########| 272/272 [00:00<00:00, 3021.12it/s]")
    assert not PROGRESS_BAR.search("naive-max 21.5% | paged-16 98.3 %")
    assert PLACEHOLDER.findall(MATH.sub(" ", "tl.dot wants tiles of at least {MIN_TILE}")) == ["{MIN_TILE}"]
    assert PLACEHOLDER.findall(MATH.sub(" ", r"$\frac{QK^T}{\sqrt{D}}$ and $$W_{AB}$$")) == []
    assert STRAY_NOTE.findall("the kernel reads it once (not §7)") == ["(not §7)"]


# measured figures in prose --------------------------------------------------------------------------------------------
NUMBER = r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?"
TIMED = re.compile(NUMBER + r"\s?(ms|µs|us|tok/s)(?![\w/])")  # 37 ms, 5.0 µs, 1,234 tok/s
RATIO = re.compile(NUMBER + r"[x×](?!\w)")  # 7.5x, 4×: a speed-up, not "2 × layers"
QUOTED = re.compile(r"\"[^\"\n]*\"|“[^”]*”")  # quotations (of the guide) are not our figures

# Figures a chapter may state without printing them, each with the reason. Keys are (chapter, figure as written).
EXEMPT = {
    ("01_kv_cache", "4.8 µs"): "the guide's §7 figure, named and corrected in the boxed note",
    ("02_fragmentation", "10×"): "the upper end of the guide's §1 range, 5-10x, named in the boxed note",
    ("02_fragmentation", "5×"): "the guide's §8 claim for the paper, quoted and corrected in the boxed note",
    ("02_fragmentation", "24×"): "the vLLM launch post's headline, which the guide's §8 quotes, in the boxed note",
    ("02_fragmentation", "4×"): "the upper end of the paper's 2-4x over FasterTransformer and Orca, in the boxed note",
    ("02_fragmentation", "3.5×"): "the vLLM launch post's figure over TGI, in the boxed note",
    ("08_chunked_prefill_goodput", "42 ms"): "config B's p99 TPOT in the guide's §13 table, checked in the boxed note",
    ("08_chunked_prefill_goodput", "9,500 tok/s"): "config B's throughput in the guide's §13 table",
    ("11_multi_lora", "12x"): "Punica's published speed-up, quoted beside S-LoRA's in the claims table",
}


def figures(prose: str) -> list[tuple[str, str]]:
    """(figure as written, its number without thousands separators) for every timed figure and ratio in prose."""
    prose = QUOTED.sub(" ", MATH.sub(" ", prose))
    found = []
    for pattern in (TIMED, RATIO):
        for m in pattern.finditer(prose):
            number = m.group(1).replace(",", "") + (m.group(2) or "")
            found.append((m.group(0), number))
    return found


def shown_numbers(output: str) -> set[str]:
    """Every number an output prints, without thousands separators."""
    return {a.replace(",", "") + (b or "") for a, b in re.findall(NUMBER, output)}


def unprinted_figures(path: Path) -> list[str]:
    chapter, shown, missing = path.stem, set(), []
    for number, cell in enumerate(cells(path)):
        if cell["cell_type"] == "code":
            shown |= shown_numbers(output_text(cell))
        elif cell["cell_type"] == "markdown":
            for figure, value in figures(text(cell["source"])):
                if value not in shown and (chapter, figure) not in EXEMPT:
                    missing.append(f"cell {number}: {figure!r}")
    return missing


@pytest.mark.parametrize("notebook", [nb for nb in NOTEBOOKS if nb != INDEX], ids=chapter_id)
def test_measured_figures_in_prose_are_printed_above(notebook):
    assert unprinted_figures(notebook) == []


def test_figures_are_found():
    prose = 'TTFT drops from 812 ms to 95.5 ms (8.5x), 1,234 tok/s; the guide says "4.8 µs"; 2 × layers × 4 B'
    assert figures(prose) == [("812 ms", "812"), ("95.5 ms", "95.5"), ("1,234 tok/s", "1234"), ("8.5x", "8.5")]
    assert {"812", "95.5", "1234", "8.5"} <= shown_numbers("cold 812 ms, hit 95.5 ms: 8.5x; 1,234 tok/s")
    assert "5" not in shown_numbers("5.0 µs") and "5.0" in shown_numbers("5.0 µs")


def test_exemptions_are_still_needed():
    """An exemption whose figure the chapter no longer states is stale: remove it."""
    for (chapter, figure), why in EXEMPT.items():
        path = CHAPTERS / f"{chapter}.ipynb"
        prose = [f for cell in cells(path) if cell["cell_type"] == "markdown" for f, _ in figures(text(cell["source"]))]
        assert figure in prose, f"{chapter}: {figure!r} is exempt ({why}) but no longer in its prose"


# the index ------------------------------------------------------------------------------------------------------------
def index_rows() -> dict[str, dict[str, str]]:
    """Chapter number -> {column name: cell text} from the table of chapter 00."""
    lines = [
        line
        for cell in cells(INDEX)
        if cell["cell_type"] == "markdown"
        for line in text(cell["source"]).splitlines()
        if line.startswith("|")
    ]
    header = [h.strip() for h in lines[0].strip().strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        values = [v.strip() for v in line.strip().strip("|").split(" | ")]
        assert len(values) == len(header), f"the index row {line[:40]!r} has {len(values)} of {len(header)} columns"
        rows[values[0]] = dict(zip(header, values))
    return rows


def running_time_s(path: Path) -> float:
    """The sum of a notebook's code cells' execution times, as nbconvert records them in each cell's metadata."""
    total = 0.0
    for number, cell in enumerate(cells(path)):
        if cell["cell_type"] != "code":
            continue
        timing = cell.get("metadata", {}).get("execution")
        assert timing, f"{path.name} cell {number} has no recorded execution time: execute it with nbconvert"
        start = datetime.fromisoformat(timing["iopub.execute_input"])
        end = datetime.fromisoformat(timing["shell.execute_reply"])
        total += (end - start).total_seconds()
    return total


CHAPTER_NOTEBOOKS = [nb for nb in NOTEBOOKS if nb != INDEX]


def test_index_lists_every_chapter_with_its_guide_sections():
    rows = index_rows()
    assert sorted(rows) == [nb.stem[:2] for nb in CHAPTER_NOTEBOOKS]
    for number, row in rows.items():
        assert re.fullmatch(r"§\d+(-§\d+)?(, §\d+(-§\d+)?)*", row["guide §"]), (number, row["guide §"])
        assert f"({number}_" in row["chapter"], (number, row["chapter"])


@pytest.mark.parametrize("notebook", CHAPTER_NOTEBOOKS, ids=chapter_id)
def test_index_time_is_the_chapters_recorded_running_time(notebook):
    """Fails until the chapters are executed on an idle machine and their times copied into chapter 00's table."""
    row = index_rows()[notebook.stem[:2]]
    assert row["time"] == f"{round(running_time_s(notebook))} s"


def section_numbers(path: Path) -> list[int]:
    return [
        int(match.group(1))
        for cell in cells(path)
        if cell["cell_type"] == "markdown"
        for match in re.finditer(r"^## (\d+)\. ", text(cell["source"]), flags=re.MULTILINE)
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=chapter_id)
def test_sections_are_numbered_in_order(notebook):
    numbers = section_numbers(notebook)
    assert numbers == list(range(1, len(numbers) + 1)), numbers
