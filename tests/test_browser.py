"""The book in a real browser: a chapter run top to bottom in JupyterLab, and the static edition opened from disk.

Chromium is Debian's (/usr/bin/chromium), driven by playwright; nothing downloads a browser. JupyterLab listens on
127.0.0.1 only, on a copy of the chapter, so the committed notebook is never rewritten. Screenshots go to
build/screenshots/. Run with `make test-browser` (`pytest -m browser tests/test_browser.py`).
"""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from book.build import build, chapter_notebooks, page_name

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHAPTER = "03_block_tables.ipynb"  # two pool players over block tables, and the real model


@pytest.fixture(scope="module")
def browser():
    """A fresh Chromium profile, headless; every page it opens records the URLs it requests."""
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium chromium-driver")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS, viewport={"width": 1280, "height": 900}
        )
        yield context
        context.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1, serving a copy of the chapter; yields (url of the notebook, root folder)."""
    root = tmp_path_factory.mktemp("lab") / "chapters"
    shutil.copytree(ROOT / "chapters", root)  # the chapter with its exercises' check and solutions
    settings = root / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')  # every cell in the DOM
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        JUPYTER_RUNTIME_DIR=str(root / ".runtime"),
        JUPYTER_CONFIG_DIR=str(root / ".config"),
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--ServerApp.root_dir={root}",
            f"--IdentityProvider.token={token}",
            "--LabApp.expose_app_in_browser=True",
            "--allow-root",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            f"--LabApp.user_settings_dir={root / '.settings'}",
            f"--LabApp.workspaces_dir={root / '.workspaces'}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("JupyterLab did not start on 127.0.0.1")
            time.sleep(0.5)
    yield f"{base}/lab/tree/{CHAPTER}?token={token}", root
    server.terminate()
    server.wait(timeout=30)


NOTEBOOK_STATE = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.content || !panel.sessionContext.session) return null;
    const cells = [];
    for (const cell of panel.content.model.cells) {
        if (cell.type !== 'code') continue;
        cells.push({count: cell.executionCount,
                    errors: cell.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename)});
    }
    return {kernel: panel.sessionContext.session.kernel.status, cells: cells};
}"""


def slider_and_view(player):
    """The slider's readout and the text of the frame on show, for a player's output area."""
    return player.locator(".widget-readout").inner_text(), player.locator(".widget-html:visible").inner_text()


def test_a_chapter_runs_in_jupyterlab_and_its_players_respond(browser, lab):
    url, _ = lab
    page = browser.new_page()
    page.goto(url)
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
        "&& window.jupyterapp.shell.currentWidget.sessionContext.session "
        "&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
        timeout=120_000,
    )
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(
        f"() => {{ const s = ({NOTEBOOK_STATE})(); return s && s.kernel === 'idle' && "
        "(s.cells.every(c => c.count !== null) || s.cells.some(c => c.errors.length)); }",
        timeout=300_000,
        polling=1000,
    )  # done, or stopped at an error
    state = page.evaluate(NOTEBOOK_STATE)
    page.screenshot(path=str(SHOTS / "lab_chapter_run.png"))
    assert [c["errors"] for c in state["cells"] if c["errors"]] == []
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0

    players = page.locator(".jp-OutputArea-output:has(.widget-slider)")
    assert players.count() == 2  # both pool players rendered as widgets
    player = players.first
    player.scroll_into_view_if_needed()
    before = slider_and_view(player)
    assert before[0] == "0" and "an empty pool" in before[1]
    player.locator(".noUi-handle").focus()
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("(el) => el.querySelector('.widget-readout').innerText === '5'", arg=player.element_handle())
    after = slider_and_view(player)
    player.screenshot(path=str(SHOTS / "lab_player_frame_5.png"))
    assert after[0] == "5" and after[1] != before[1] and "block tables" in after[1]
    page.close()


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    build(out)
    return out


def test_the_static_edition_renders_offline(browser, book):
    for notebook in chapter_notebooks():
        page = browser.new_page()
        requested = []
        page.on("request", lambda request: requested.append(request.url))
        page.goto((book / page_name(notebook)).as_uri())
        page.wait_for_load_state("load")
        if "application/vnd.jupyter.widget-view+json" in notebook.read_text():  # it shows a widget
            page.wait_for_selector(".jupyter-widgets .widget-html, .jupyter-widgets .widget-slider", timeout=30_000)
        page.wait_for_timeout(500)
        page.screenshot(path=str(SHOTS / f"book_{notebook.stem}.png"))
        assert [url for url in requested if not url.startswith("file://")] == [], notebook.name
        assert page.locator("[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
        page.close()


def test_static_players_move_without_a_kernel(browser, book):
    page = browser.new_page()
    page.goto((book / page_name(ROOT / "chapters" / CHAPTER)).as_uri())
    player = page.locator(".jupyter-widgets:has(.widget-slider)").first
    player.wait_for(timeout=30_000)
    player.scroll_into_view_if_needed()
    before = slider_and_view(player)
    player.locator(".noUi-handle").focus()
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("(el) => el.querySelector('.widget-readout').innerText === '5'", arg=player.element_handle())
    after = slider_and_view(player)
    player.screenshot(path=str(SHOTS / "book_player_frame_5.png"))
    assert before[0] == "0" and after[0] == "5" and after[1] != before[1]
    page.close()
