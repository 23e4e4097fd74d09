"""The static edition (book/build.py): a page per chapter, no error output, every link resolves, nothing loads from
outside the site. Opened in Chromium by tests/test_browser.py."""

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from book.build import build, chapter_notebooks, page_name


class Page(HTMLParser):
    """What a page links to and loads, its element ids, and the outputs it shows as errors."""

    def __init__(self, path: Path):
        super().__init__()
        self.links: list[str] = []  # <a href>: where a reader may go
        self.loads: list[str] = []  # src= and <link href>: what the browser fetches on its own
        self.ids: set[str] = set()
        self.error_outputs = 0
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        elif tag == "link" and attrs.get("href"):
            self.loads.append(attrs["href"])
        if attrs.get("src"):
            self.loads.append(attrs["src"])
        if attrs.get("data-mime-type") == "application/vnd.jupyter.stderr":  # tracebacks and stderr alike
            self.error_outputs += 1


def broken(page: Path, parsed: Page) -> list[str]:
    """The links and loads of a page that do not resolve inside the site, and anything it loads from the network."""
    problems = []
    for url in parsed.links + parsed.loads:
        parts = urlsplit(url)
        if parts.scheme in ("http", "https"):
            if url in parsed.loads:
                problems.append(f"loads {url} from the network")
        elif parts.scheme in ("", "file") and not url.startswith(("data:", "mailto:")):
            target = page if not parts.path else page.parent / unquote(parts.path)
            if not target.exists():
                problems.append(f"{url}: no such file")
            elif parts.fragment and target == page and not {parts.fragment, unquote(parts.fragment)} & parsed.ids:
                problems.append(f"{url}: no such anchor")
    return problems


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("book")
    build(out)
    return out


def test_every_chapter_has_a_page_and_the_index_links_them_all(site):
    notebooks = chapter_notebooks()
    assert notebooks[0].name == "00_index.ipynb"
    for notebook in notebooks:
        assert (site / page_name(notebook)).exists(), notebook.name
    index = Page(site / "index.html")
    assert {page_name(n) for n in notebooks[1:]} <= set(index.links)


@pytest.mark.parametrize("notebook", chapter_notebooks(), ids=lambda path: path.stem)
def test_a_page_shows_no_error_and_its_links_resolve(site, notebook):
    page = site / page_name(notebook)
    parsed = Page(page)
    assert parsed.error_outputs == 0
    assert broken(page, parsed) == []


def test_the_checks_see_an_error_and_a_broken_link(tmp_path):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# Chapter 1 · A broken one\n\nSee [the next](02_missing.ipynb)."),
            nbformat.v4.new_code_cell(
                "1 / 0",
                outputs=[
                    nbformat.v4.new_output(
                        "error", ename="ZeroDivisionError", evalue="division by zero", traceback=["ZeroDivisionError"]
                    )
                ],
            ),
        ]
    )
    nbformat.write(notebook, chapters / "01_broken.ipynb")
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Contents")]), chapters / "00_index.ipynb"
    )
    index, page = build(tmp_path / "out", chapters=chapters)
    assert broken(index, Page(index)) == []
    parsed = Page(page)
    assert parsed.error_outputs == 1
    assert broken(page, parsed) == ["02_missing.html: no such file"]
