"""Figures out to the notebook: a matplotlib Figure as PNG bytes, or shown in any front end."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def figure_png(fig: Figure, dpi: int = 90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def show(fig: Figure) -> None:
    """Display a matplotlib Figure as a PNG in any notebook front end (Jupyter, Colab, VS Code)."""
    from IPython.display import Image, display

    display(Image(data=figure_png(fig)))
