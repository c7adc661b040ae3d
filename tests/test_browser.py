"""The chapters as a learner meets them: JupyterLab 4 in headless Chromium at 1400x900, Run All, click the widgets.

Checks what the page shows, not what the Python objects hold: no error outputs, the widget views rendered,
a Step click changes the block figure (the image bytes), the steppers open where the prose says, a widget's
controls and its figure fit the window together, and a saved notebook reopens without widget errors while
its paired .py stays byte for byte what the repository holds. On failure a screenshot is written under
`browser-artifacts/` (git-ignored) and its path is in the message.

Nothing is installed at test time: Chromium is Debian's (/usr/bin/chromium, `make install` apt-installs it
where it can) and Playwright's Python API comes from the dev extra. Where either is missing, the tests skip.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from browser_lab import (
    KERNEL_IDLE,
    ROOT,
    VIEWPORT,
    errors,
    lab_and_browser,
    missing,
    open_and_run,
    scroll_to_top,
    widget_views,
)

from minivllm.widgets.jupyter import HINT_CLASS, WIDGET_VIEW

pytestmark = pytest.mark.browser
if (why := missing()) is not None:
    pytest.skip(f"browser tests skipped: {why}", allow_module_level=True)

ARTIFACTS = ROOT / "browser-artifacts"
_IMAGE_HASH = """async img => {
  if (!img.src) return '';
  const buf = await (await fetch(img.src)).arrayBuffer();
  const digest = await crypto.subtle.digest('SHA-256', buf);
  return Array.from(new Uint8Array(digest)).map(b => b.toString(16).padStart(2, '0')).join('');
}"""


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def page():
    status = git_status()
    with lab_and_browser() as (lab, browser):
        pg = browser.new_page()
        pg.lab = lab
        yield pg
    assert git_status() == status, "running the chapters in JupyterLab changed files in the repository"


@contextmanager
def artefacts(page, name: str):
    """On failure: a screenshot of the window, its path added to the failure message."""
    try:
        yield
    except BaseException as e:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        try:
            page.screenshot(path=str(path))
        except Exception:  # noqa: BLE001 (the screenshot is a courtesy; the failure is what matters)
            path = Path("(no screenshot could be taken)")
        raise AssertionError(f"{e}\nscreenshot: {path}") from e


def run_chapter(page, name: str) -> None:
    t0 = time.time()
    open_and_run(page, page.lab, name)
    page.chapter_seconds = getattr(page, "chapter_seconds", {}) | {name: round(time.time() - t0)}
    assert errors(page) == [], f"{name}: error outputs after Run All"


def image_hash(view) -> str:
    return view.locator("img").first.evaluate(_IMAGE_HASH)


def header(view) -> str:
    """The page's heading (its first line), read from the DOM: JupyterLab does not render cells far outside
    the window, so their inner text would read empty."""
    return view.locator(".minivllm-page").first.evaluate(
        "e => { const c = e.cloneNode(true); c.querySelectorAll('style').forEach(s => s.remove());"
        " return (c.querySelector('h4') || c).textContent.trim(); }")


def slider_value(view) -> int:
    return int(view.locator(".widget-readout").first.inner_text())


def button(view, name: str):
    """A button by its label; the jump buttons' icon glyph counts as part of their accessible name."""
    return view.get_by_role("button", name=re.compile(rf"^\W*{re.escape(name)}$"))


def wait_until(fn, what: str, timeout: float = 20.0):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def view_state(view) -> tuple[str, str, str]:
    """What the widget shows: its page's first line, all its text, and its figure's bytes (hashed)."""
    return header(view), view.inner_text(), image_hash(view) if view.locator("img").count() else ""


def click_and_wait(page, view, name: str) -> tuple[str, str]:
    """Click a button; returns (header, image hash) once the view has changed and then held still for a
    moment (the kernel's updates to the page, the figure and the slider arrive one by one)."""
    before = view_state(view)
    button(view, name).click()
    wait_until(lambda: view_state(view) != before, f"{name!r} to change the view")
    # the kernel sends the page first and the figure after it: on a busy machine seconds apart
    wait_until(lambda: page.evaluate(KERNEL_IDLE), "the kernel to finish handling the click", timeout=60)
    now = view_state(view)
    while True:
        time.sleep(0.4)
        later = view_state(view)
        if later == now:
            break
        now = later
    assert errors(page) == []
    return now[0], now[2]


def position(text: str, noun: str = "step") -> int:
    m = re.search(rf"\b{noun} (\d+) of (\d+)", text)
    assert m, f"no '{noun} k of N' in {text!r}"
    return int(m.group(1))


def assert_fits(page, view, name: str) -> None:
    """The widget scrolled to the top of the notebook: its controls and its last row are both in the window."""
    scroll_to_top(page, view)
    box = view.bounding_box()
    controls = view.locator(".widget-hbox").first.bounding_box()
    assert controls["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"], (
        f"{name}: the widget runs from y={box['y']:.0f} to y={box['y'] + box['height']:.0f}, "
        f"past the {VIEWPORT['height']}-pixel window")


def test_chapter_00_steppers_step_and_the_live_one_runs_the_engine(page):
    with artefacts(page, "00_first_generation"):
        run_chapter(page, "00_first_generation")
        views = widget_views(page)
        assert views.count() == 2, "the journey stepper and the live stepper"
        replay, live = views.nth(0), views.nth(1)
        assert_fits(page, replay, "journey stepper")
        assert position(header(replay)) == 1 == slider_value(replay)
        figure = image_hash(replay)
        head, after = click_and_wait(page, replay, "Step")
        assert position(head) == 2 == slider_value(replay), "Step moves one step; the slider says the same"
        assert after != figure, "a Step click redraws the block figure"
        click_and_wait(page, replay, "Reset")
        assert position(header(replay)) == 1

        scroll_to_top(page, live)
        assert position(header(live)) == 3 and button(live, "Step (live)").is_enabled(), \
            "after Run All the live stepper has work left for Step"
        n = 3
        while button(live, "Step (live)").count() and button(live, "Step (live)").is_enabled():
            head, _ = click_and_wait(page, live, "Step (live)")
            n += 1
            assert position(head) == n and f"of {n}" in head, "each live Step runs and shows one more engine step"
            assert n < 20, "the live requests never finished"
        assert "finished" in live.inner_text() and button(live, "Step").is_disabled(), \
            "the engine is idle: Step is greyed out"


def test_chapter_03_block_viewer_steps_and_jumps(page):
    with artefacts(page, "03_paged_blocks"):
        run_chapter(page, "03_paged_blocks")
        views = widget_views(page)
        assert views.count() == 1
        viewer = views.nth(0)
        assert_fits(page, viewer, "block-table viewer")
        assert position(header(viewer)) == 21 == slider_value(viewer), "the viewer opens where the code put it"
        _, before = header(viewer), image_hash(viewer)
        head, after = click_and_wait(page, viewer, "Step")
        assert after != before, "a Step click redraws the block figure"
        head, _ = click_and_wait(page, viewer, "next block change")
        assert "allocated" in head or "freed" in head, head
        for name in ("Reset",):
            click_and_wait(page, viewer, name)
        assert position(header(viewer)) == 1


def test_chapter_07_speculation_stepper_opens_on_the_example(page):
    with artefacts(page, "07_speculative_decoding"):
        run_chapter(page, "07_speculative_decoding")
        views = widget_views(page)
        assert views.count() == 1
        spec = views.nth(0)
        assert_fits(page, spec, "speculation stepper")
        text = spec.inner_text()
        k = position(header(spec), "round")
        assert k == slider_value(spec), "the slider shows the round the page names"
        assert "disagreement at draft" in text and "rejected" in text, "it opens on the example: a rejection"
        head, _ = click_and_wait(page, spec, "Step")
        assert position(head, "round") == k + 1 and "revealed 0 of" in spec.inner_text()
        click_and_wait(page, spec, "Step")
        assert "revealed 1 of" in spec.inner_text() or "accepted" in spec.inner_text()
        click_and_wait(page, spec, "Show round")
        if button(spec, "next rejection").is_enabled():
            head, _ = click_and_wait(page, spec, "next rejection")
            assert position(head, "round") > k + 1
        click_and_wait(page, spec, "Reset")
        assert position(header(spec), "round") == 1 == slider_value(spec)


def test_the_installed_configuration_enables_the_save_hook(page):
    """The server above runs with no hook flag of its own: the hook comes from the configuration `make install`
    wrote for this environment, which `jupyter server --show-config` reads back under the server's environment."""
    from minivllm.widgets.jupyter import HOOK

    shown = subprocess.run([sys.executable, "-m", "jupyter_server", "--show-config"], env=page.lab.env(),
                           cwd=page.lab.root, capture_output=True, text=True, timeout=120).stdout
    assert f".pre_save_hook = '{HOOK}'" in shown, (
        f"Jupyter Server has no minivllm pre-save hook configured; run `make install`:\n{shown}")


def test_a_restarted_kernel_leaves_a_hint_where_its_widgets_were(page):
    """After a kernel restart JupyterLab blanks widget views; the line after each says to run the cell again."""
    name = "07_speculative_decoding"  # the chapter the tests above left open
    with artefacts(page, "restarted-kernel"):
        if name not in page.url:
            run_chapter(page, name)
        hints = page.locator(f".{HINT_CLASS}")
        assert hints.count() >= 1 and not any(hints.nth(i).is_visible() for i in range(hints.count())), \
            "while the widget lives its hint is hidden"
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
        wait_until(lambda: any(hints.nth(i).is_visible() for i in range(hints.count())),
                   "the hint to appear after the restart")
        assert "run this cell again" in hints.first.inner_text()
        assert "Error displaying widget" not in page.text_content(".jp-Notebook")


def test_a_saved_chapter_reopens_without_widget_errors_and_keeps_its_source(page):
    """Saving goes through the jupytext pairing: the .py must not change (its kernelspec already reads as
    JupyterLab writes it), and the notebook keeps no widget views to fail on when it is reopened: the hint
    after each says to run the cell again."""
    name = "07_speculative_decoding"
    with artefacts(page, "saved-and-reopened"):
        if name not in page.url:
            run_chapter(page, name)
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        saved = page.lab.root / "chapters" / f"{name}.ipynb"
        wait_until(lambda: HINT_CLASS in saved.read_text() and WIDGET_VIEW not in saved.read_text(),
                   "the save, without widget views, to reach the disk")
        assert (page.lab.root / "chapters" / f"{name}.py").read_bytes() == \
            (ROOT / "chapters" / f"{name}.py").read_bytes(), "JupyterLab's save rewrote the paired .py"
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        page.reload()
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.wait_for_timeout(3000)
        assert "Error displaying widget" not in page.text_content(".jp-Notebook")
        hints = page.locator(f".{HINT_CLASS}")
        scroll_to_top(page, hints.first)
        assert hints.first.is_visible() and "run this cell again" in hints.first.inner_text()


def test_chapter_01_detokenizer_stepper_holds_back_the_split_character(page):
    """The tokens view in chapter 01: its jump lands on a step that emits nothing, Step moves on, and
    the saved notebook reopens without widget errors."""
    name = "01_tokenization_and_queue"
    with artefacts(page, name):
        run_chapter(page, name)
        views = widget_views(page)
        # textContent: JupyterLab leaves cells far outside the window unrendered (inner text empty)
        coffee = next(views.nth(i) for i in range(views.count())
                      if "prefix_offset" in views.nth(i).evaluate("e => e.textContent"))
        assert_fits(page, coffee, "detokenizer stepper")
        assert position(header(coffee), "token") == 1 == slider_value(coffee)
        head, _ = click_and_wait(page, coffee, "next held-back step")
        assert "emitted nothing" in coffee.inner_text(), coffee.inner_text()
        held = position(head, "token")
        head, _ = click_and_wait(page, coffee, "Step")
        assert position(head, "token") == held + 1 == slider_value(coffee)
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        saved = page.lab.root / "chapters" / f"{name}.ipynb"
        wait_until(lambda: HINT_CLASS in saved.read_text() and WIDGET_VIEW not in saved.read_text(),
                   "the save, without widget views, to reach the disk")
        page.reload()
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.wait_for_timeout(3000)
        assert "Error displaying widget" not in page.text_content(".jp-Notebook")
