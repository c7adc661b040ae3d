"""Notebooks are saved without widget views: a Jupyter server pre-save hook, and the config that installs it.

A widget view in a saved notebook points at a model that lives only in the kernel that drew it. Reopened,
JupyterLab shows "Error displaying widget: model not found" until the cell runs again, and storing the
widget state instead (JupyterLab's saveState) would bring back dead controls whose Step does nothing. So a
saved notebook keeps every other output and replaces each widget view with one line saying to run the cell.

`make install` runs `python -m minivllm.widgets.jupyter`, which writes the server config that enables the
hook for this Python environment (`{sys.prefix}/etc/jupyter/jupyter_server_config.d/minivllm.json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLACEHOLDER = "[a minivllm widget: run the cell again to bring it back]"
HOOK = f"{__name__}.drop_widget_outputs"


def strip_widget_views(nb: dict) -> int:
    """Replace every widget view among the notebook's outputs with a text line; returns how many."""
    n = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data")
            if isinstance(data, dict) and WIDGET_VIEW in data:
                out["data"] = {"text/plain": PLACEHOLDER}
                n += 1
    nb.get("metadata", {}).pop("widgets", None)  # saved widget state, if a front end stored some
    return n


def drop_widget_outputs(model: dict, **kwargs) -> None:
    """ContentsManager.pre_save_hook: strip widget views from a notebook about to be saved."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip_widget_views(model["content"])


def install_config(prefix: str = sys.prefix) -> Path:
    """Enable the hook for every Jupyter server started from this environment."""
    path = Path(prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "minivllm.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ContentsManager": {"pre_save_hook": HOOK}}, indent=2) + "\n")
    return path


if __name__ == "__main__":
    print("wrote", install_config())
