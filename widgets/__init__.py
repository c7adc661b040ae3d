"""Widgets for the chapters: pure render functions of recorded engine state, plus thin ipywidgets wiring.

Render functions (no ipywidgets; they return matplotlib Figures, HTML strings or plain data):
    blocks:    pool_cells, block_table_html, block_table_figure   (the block-table viewer)
    journey:   step_html                                           (one step of a prompt's journey)
    timelines: timeline, timeline_figure                           (the batching timeline)
    workloads: run_arrivals, kv_occupancy                          (drive a real engine; measure its trace)
Widgets (ipywidgets): JourneyStepper, BlockTableViewer.
"""

from widgets.blocks import BlockCell, block_table_figure, block_table_html, pool_cells
from widgets.colors import request_colors, request_ids
from widgets.journey import step_html
from widgets.timelines import Timeline, timeline, timeline_figure
from widgets.ui import BlockTableViewer, JourneyStepper, figure_png
from widgets.workloads import Arrival, Occupancy, Recording, kv_occupancy, new_steps, run_arrivals


def show(fig) -> None:
    """Display a matplotlib Figure as a PNG in any notebook front end (Jupyter, Colab, VS Code)."""
    from IPython.display import Image, display

    display(Image(data=figure_png(fig)))


__all__ = ["Arrival", "BlockCell", "BlockTableViewer", "JourneyStepper", "Occupancy", "Recording", "Timeline",
           "block_table_figure", "block_table_html", "figure_png", "kv_occupancy", "new_steps", "pool_cells",
           "request_colors", "request_ids", "run_arrivals", "show", "step_html", "timeline", "timeline_figure"]
