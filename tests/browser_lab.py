"""A JupyterLab server and a headless Chromium driven by Playwright, as a learner would use the chapters.

Used by tests/test_browser.py, and runnable by hand to take screenshots of chapters:
    python tests/browser_lab.py OUTDIR 00_first_generation 07_speculative_decoding ...
Nothing is installed here: Chromium is Debian's (/usr/bin/chromium), Playwright comes from the dev extra.
The chapters are copied to a temporary directory, so saving in JupyterLab never touches the repository.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MINIVLLM_CHROMIUM", "/usr/bin/chromium")
# the machine's network is closed: without the background-networking flags Chromium floods refused connections
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 900}


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ModuleNotFoundError:
        return "playwright is not installed: pip install -e '.[dev]'"
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set MINIVLLM_CHROMIUM)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server over a temporary copy of the chapters (and pyproject.toml, for the jupytext pairing)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "repo"
        (self.root / "chapters").mkdir(parents=True)
        for p in (ROOT / "chapters").glob("[0-9][0-9]_*.*"):
            shutil.copy2(p, self.root / "chapters" / p.name)
        shutil.copy2(ROOT / "pyproject.toml", self.root / "pyproject.toml")
        news = tmp / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        news.parent.mkdir(parents=True)
        news.write_text('{"fetchNews": "false"}')  # no "official Jupyter news?" toast over the notebook
        self.port, self.token = free_port(), os.urandom(12).hex()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "JUPYTER_CONFIG_DIR": str(tmp / "config"),
               "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"), "IPYTHONDIR": str(tmp / "ipython"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root}", "--LabApp.expose_app_in_browser=True",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        # no pre-save hook here: the one `make install` configured for this environment is what is tested
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
            cmd.append("--allow-root")
        self.log = open(tmp / "jupyterlab.log", "w")
        self._env = env
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root)
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.log.flush()
                    tail = (tmp / "jupyterlab.log").read_text()[-2000:]
                    raise RuntimeError(f"JupyterLab did not start:\n{tail}") from None
                time.sleep(0.5)

    def env(self) -> dict:
        """The environment the server runs in (the tests read its configuration through the same)."""
        return self._env

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/chapters/{name}.ipynb?token={self.token}&reset"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@contextmanager
def lab_and_browser():
    """(lab, browser): a JupyterLab server and a launched Chromium; both closed on exit."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="minivllm-browser-") as d:
        tmp = Path(d)
        lab = Lab(tmp)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch_persistent_context(
                    str(tmp / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                    viewport=VIEWPORT)
                try:
                    yield lab, browser
                finally:
                    browser.close()
        finally:
            lab.close()


KERNEL_IDLE = """() => {
  const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!nb || !nb.sessionContext || !nb.content) return false;
  const k = nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""

_RUN_DONE = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const k = nb.sessionContext.session && nb.sessionContext.session.kernel;
  if (!k || k.status !== 'idle') return false;
  const cells = nb.content.widgets.filter(c => c.model.type === 'code');
  return cells.every(c => c.model.executionCount !== null) || cells.some(c => c.model.outputs.toJSON().some(
    o => o.output_type === 'error'));
}"""

_SHUTDOWN = """async () => {
  const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (nb && nb.sessionContext) await nb.sessionContext.shutdown();
}"""

_ERRORS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const out = [];
  nb.content.widgets.forEach((c, i) => { if (c.model.type !== 'code') return;
    c.model.outputs.toJSON().forEach(o => {
      if (o.output_type === 'error') out.push(`cell ${i}: ${o.ename}: ${o.evalue}`); });
  });
  document.querySelectorAll('.jp-OutputArea-output').forEach(e => {
    if (e.textContent.includes('Error displaying widget')) out.push('widget: ' + e.textContent.slice(0, 200)); });
  return out;
}"""


def open_and_run(page, lab: Lab, name: str, timeout_s: float = 240) -> None:
    """Open a chapter in JupyterLab, wait for its kernel, Run All, and wait until every cell has run.
    The kernel of the chapter open before, if any, is shut down first (two CPU cores go a long way less)."""
    if page.url.startswith(lab.url):
        page.evaluate(_SHUTDOWN)
    page.goto(lab.notebook_url(name))
    page.wait_for_function(KERNEL_IDLE, timeout=90_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_timeout(500)
    page.wait_for_function(_RUN_DONE, timeout=timeout_s * 1000, polling=500)
    page.wait_for_timeout(500)


def errors(page) -> list[str]:
    return page.evaluate(_ERRORS)


def widget_views(page):
    """The top-level widget views in the notebook's outputs, in order."""
    return page.locator(".jp-OutputArea-output > .jupyter-widgets.widget-vbox")


def scroll_to_top(page, element) -> None:
    """Scroll the notebook so that `element` starts at the top of its panel. Twice: JupyterLab sizes the
    cells outside the window only once they come near it, so the first scroll can land short."""
    for _ in range(2):
        element.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(300)


def screenshot_widgets(page, outdir: Path, prefix: str) -> None:
    """One viewport screenshot per widget, scrolled so the widget starts at the top of the notebook panel."""
    views = widget_views(page)
    for i in range(views.count()):
        view = views.nth(i)
        scroll_to_top(page, view)
        page.screenshot(path=str(outdir / f"{prefix}-widget{i}.png"))


def main(argv: list[str]) -> None:
    outdir = Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    with lab_and_browser() as (lab, browser):
        page = browser.new_page()
        for name in argv[1:]:
            t0 = time.time()
            open_and_run(page, lab, name)
            print(name, f"{time.time() - t0:.0f}s", "errors:", errors(page), "widgets:", widget_views(page).count())
            screenshot_widgets(page, outdir, name[:2])
            pages = page.locator(".jp-RenderedHTMLCommon .minivllm-page")  # step pages outside a widget
            for i in range(pages.count()):
                pages.nth(i).screenshot(path=str(outdir / f"{name[:2]}-html{i}.png"))
            images = page.locator(".jp-RenderedImage img")
            for i in range(images.count()):
                images.nth(i).screenshot(path=str(outdir / f"{name[:2]}-img{i}.png"))
            page.screenshot(path=str(outdir / f"{name[:2]}-end.png"))


if __name__ == "__main__":
    main(sys.argv[1:])
