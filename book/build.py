"""The static edition: every executed chapter rendered to one HTML page, readable without a kernel or a network.

`make book` (or `python -m book.build [--out build/book]`) renders chapters/00_index.ipynb as index.html and every
other chapter as NN_name.html with nbconvert's lab template, exactly as executed: plots are embedded images, and the
widgets come back from the state saved in each notebook, their players' frames included, so sliders move without a
kernel. The scripts a page loads (require.js, the Jupyter widgets HTML manager, MathJax) are copied next to the
pages from their npm packages, fetched once with `npm pack` into build/vendor, so viewing the book reaches nothing
outside its own folder.
"""

import argparse
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
VENDOR = ROOT / "build" / "vendor"

# npm package -> copies (folder inside the package, files in it as globs, the folder of the site they go to). The
# widget manager looks for its fonts next to the modules it defines, @jupyter-widgets/html-manager/dist and
# @jupyter-widgets/ (relative to the page), so they go to both.
FONTS = ["*.woff2", "*.woff", "*.ttf", "*.eot", "*.svg"]
ASSETS = {
    "requirejs@2.3.8": [(".", ["require.js"], "_static/requirejs")],
    "@jupyter-widgets/html-manager@1.0.15": [
        ("dist", ["embed-amd.js"] + FONTS, "@jupyter-widgets/html-manager/dist"),
        ("dist", FONTS, "@jupyter-widgets"),
    ],
    "mathjax@2.7.9": [
        (
            ".",
            [
                "MathJax.js",
                "config/TeX-AMS_CHTML-full.js",
                "config/Safe.js",
                "extensions/**/*.js",
                "jax/element/**/*.js",
                "jax/input/TeX/**/*.js",
                "jax/output/CommonHTML/**/*.js",
                "fonts/HTML-CSS/TeX/woff/**/*.woff",
            ],
            "_static/mathjax",
        )
    ],
}
STATIC_URLS = {  # what the pages ask nbconvert's template to load, relative to the page
    "require_js_url": "_static/requirejs/require.js",
    "widget_renderer_url": "@jupyter-widgets/html-manager/dist/embed-amd.js",
    "mathjax_url": "_static/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe",
    "mermaid_js_url": "",  # no chapter draws a diagram: load nothing
    "mermaid_layout_elk_js_url": "",
}


def page_name(notebook: Path) -> str:
    """00_index.ipynb -> index.html, NN_name.ipynb -> NN_name.html."""
    return "index.html" if notebook.stem.startswith("00_") else f"{notebook.stem}.html"


def chapter_notebooks(chapters: Path = CHAPTERS) -> list[Path]:
    return sorted(chapters.glob("[0-9][0-9]_*.ipynb"))


def title_of(notebook) -> str:
    """The text of the first level-1 heading of a notebook."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError("a chapter opens with a '# title' heading")


def fetch_assets(out: Path, vendor: Path = VENDOR) -> None:
    """Copy the scripts and fonts the pages load from their npm packages into out/ (packs cached in vendor/)."""
    vendor.mkdir(parents=True, exist_ok=True)
    for spec, copies in ASSETS.items():
        name, version = spec.rsplit("@", 1)
        pack = vendor / f"{name.lstrip('@').replace('/', '-')}-{version}.tgz"
        if not pack.exists():
            subprocess.run(["npm", "pack", "--silent", spec], cwd=vendor, check=True, stdout=subprocess.DEVNULL)
        unpacked = vendor / pack.stem
        if not unpacked.exists():
            with tarfile.open(pack) as archive:
                archive.extractall(unpacked, filter="data")
        for base, patterns, folder in copies:
            inside = unpacked / "package" / base
            for source in (path for pattern in patterns for path in inside.glob(pattern)):
                target = out / folder / source.relative_to(inside)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)


def link_pages(page: str) -> str:
    """Links between notebooks become links between pages."""
    page = re.sub(r'href="00_\w+\.ipynb', 'href="index.html', page)
    return re.sub(r'href="(\d\d_\w+)\.ipynb', r'href="\1.html', page)


def navigation(notebooks: list[Path], k: int) -> str:
    """Contents, previous and next: a bar at the top and the bottom of every page."""
    links = ['<a href="index.html">contents</a>']
    if k > 0:
        links.append(f'<a rel="prev" href="{page_name(notebooks[k - 1])}">previous</a>')
    if k + 1 < len(notebooks):
        links.append(f'<a rel="next" href="{page_name(notebooks[k + 1])}">next</a>')
    return f'<nav class="book-nav" style="margin:1em 0;font:14px sans-serif">{" · ".join(links)}</nav>'


def build(out: Path, chapters: Path = CHAPTERS, vendor: Path = VENDOR) -> list[Path]:
    """Render every chapter into out/, with the assets under out/_static; returns the pages written."""
    out.mkdir(parents=True, exist_ok=True)
    fetch_assets(out, vendor)
    exporter = HTMLExporter(template_name="lab", **STATIC_URLS)
    notebooks = chapter_notebooks(chapters)
    pages = []
    for k, path in enumerate(notebooks):
        notebook = nbformat.read(path, as_version=4)
        notebook.metadata["title"] = title_of(notebook)
        body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": path.stem}})
        nav = navigation(notebooks, k)
        body = link_pages(body).replace("<main>", f"<main>{nav}", 1).replace("</main>", f"{nav}</main>", 1)
        page = out / page_name(path)
        page.write_text(body, encoding="utf-8")
        pages.append(page)
    return pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book", help="folder for the site")
    args = parser.parse_args()
    for page in build(args.out):
        print(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page)


if __name__ == "__main__":
    main()
