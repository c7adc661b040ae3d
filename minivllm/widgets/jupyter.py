"""When a widget's kernel is gone, say "run this cell again": a save hook, a hint, their install.

A widget view points at a model that lives only in the kernel that drew it. Two things end that
kernel's models while the view stays in the notebook:

- **the notebook is saved and reopened**: JupyterLab would show "Error displaying widget: model not
  found" (and storing the widget state instead, JupyterLab's saveState, would bring back dead
  controls whose Step does nothing). A Jupyter server pre-save hook, `drop_widget_outputs`, saves
  the notebook without widget views: each gives way to the hint shown after it, or to a line of
  text where there is none (a tqdm progress bar, a widget view too, keeps its last line of text,
  marked as needing no rerun).
- **the kernel restarts**: JupyterLab keeps the views, greyed out behind broken-link icons
  (`jupyter-widgets-disconnected`), and their buttons do nothing. So the chapters' widgets
  (`minivllm.widgets.ui`) display a second output after the view, `hint_html()`: a line asking to
  run the cell again, which a CSS rule hides while a connected widget view precedes it.

`make install` runs `python -m minivllm.widgets.jupyter`, which enables the hook for every Jupyter
server started from this Python environment: it sets `ContentsManager.pre_save_hook` in
`{sys.prefix}/etc/jupyter/jupyter_server_config.json`. (Not in `jupyter_server_config.d/`: Jupyter
Server reads that directory only for the extensions it enables, never for other settings.)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLACEHOLDER = "[a minivllm widget: run the cell again to bring it back]"
# a tqdm progress bar (`llm.generate`'s, or a download's) is a widget view too; its text is its
# final state, so it stays, said to need no rerun
PROGRESS_NOTE = "  [a progress bar, finished when saved: nothing to rerun]"
TQDM_TEXT = re.compile(r"\d+%\||\d+it \[|[?\d.]+(it/s|s/it)\]")
# the import path Jupyter Server resolves; written out: run as `python -m`, this is `__main__`
HOOK = "minivllm.widgets.jupyter.drop_widget_outputs"
HINT_CLASS = "minivllm-rerun-hint"
HINT_TEXT = "This widget's kernel has stopped: run this cell again to bring the widget back."


def hint_html() -> str:
    """The "run this cell again" line shown after a widget view: hidden while the view before it is
    alive, visible once the kernel restarts (marking views disconnected) or the notebook reopens."""
    live = ".jp-OutputArea-output > .jupyter-widgets:not(.jupyter-widgets-disconnected)"
    return (f"<style>.jp-OutputArea-child:has({live}) + .jp-OutputArea-child .{HINT_CLASS} "
            f"{{display: none;}}</style><div class='{HINT_CLASS}' style='color: #8a6d3b; "
            f"font-style: italic'>{HINT_TEXT}</div>")


def _is_hint(output: dict) -> bool:
    data = output.get("data")
    return isinstance(data, dict) and HINT_CLASS in str(data.get("text/html", ""))


def _stand_in(data: dict) -> str:
    """The text a widget view without a hint leaves behind: a progress bar's own last line, said to
    need no rerun; for anything else, the placeholder asking to run the cell again."""
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else str(text)
    if TQDM_TEXT.search(text):
        return text.rstrip() + PROGRESS_NOTE
    return PLACEHOLDER


def strip_widget_views(nb: dict) -> int:
    """Drop every widget view among the notebook's outputs (a line of text stands in for one that
    has no hint after it: a progress bar's last state, or a request to rerun); returns how many."""
    n = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        kept, outputs = [], cell.get("outputs", [])
        for i, out in enumerate(outputs):
            data = out.get("data")
            if isinstance(data, dict) and WIDGET_VIEW in data:
                n += 1
                if i + 1 < len(outputs) and _is_hint(outputs[i + 1]):
                    continue
                out = {**out, "data": {"text/plain": _stand_in(data)}}
            kept.append(out)
        if outputs:
            cell["outputs"] = kept
    nb.get("metadata", {}).pop("widgets", None)  # saved widget state, if a front end stored some
    return n


def drop_widget_outputs(model: dict, **kwargs) -> None:
    """ContentsManager.pre_save_hook: strip widget views from a notebook about to be saved."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip_widget_views(model["content"])


def install_config(prefix: str = sys.prefix) -> Path:
    """Enable the hook for every Jupyter server started from this environment; other settings in the
    file are kept. Removes the file earlier versions wrote where Jupyter Server never read it."""
    etc = Path(prefix) / "etc" / "jupyter"
    path = etc / "jupyter_server_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.setdefault("ContentsManager", {})["pre_save_hook"] = HOOK
    etc.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    (etc / "jupyter_server_config.d" / "minivllm.json").unlink(missing_ok=True)
    return path


if __name__ == "__main__":
    print("wrote", install_config())
