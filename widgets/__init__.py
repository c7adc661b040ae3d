"""Widgets for the chapters: pure render functions of recorded engine state, plus thin ipywidgets wiring.

Render functions (no ipywidgets; they return matplotlib Figures, HTML strings or plain data):
    blocks:    pool_cells, block_table_html, block_table_figure   (the block-table viewer)
    journey:   step_html                                           (one step of a prompt's journey)
    timelines: timeline, timeline_figure                           (the batching timeline)
    workloads: run_arrivals, kv_occupancy                          (drive a real engine; measure its trace)
    speculation: spec_rounds, speculation_html                   (speculative decoding, token by token)
    traces:    relabel_requests                                    (rename the requests of a recording)
    graphs:    graph_batch_html                                    (a CUDA-graph decode step's padded buffers)
Widgets (ipywidgets): JourneyStepper, BlockTableViewer, SpeculationStepper.
"""

from widgets.blocks import BlockCell, block_table_figure, block_table_html, pool_cells
from widgets.colors import request_colors, request_ids
from widgets.graphs import graph_batch_html
from widgets.journey import step_html
from widgets.speculation import SpecRound, spec_rounds, speculation_html
from widgets.timelines import Timeline, timeline, timeline_figure
from widgets.traces import relabel_requests
from widgets.ui import BlockTableViewer, JourneyStepper, SpeculationStepper, figure_png
from widgets.workloads import Arrival, Occupancy, Recording, kv_occupancy, new_steps, run_arrivals


def show(fig) -> None:
    """Display a matplotlib Figure as a PNG in any notebook front end (Jupyter, Colab, VS Code)."""
    from IPython.display import Image, display

    display(Image(data=figure_png(fig)))


__all__ = ["Arrival", "BlockCell", "BlockTableViewer", "JourneyStepper", "Occupancy", "Recording", "SpecRound",
           "SpeculationStepper", "Timeline", "block_table_figure", "block_table_html", "figure_png", "graph_batch_html",
           "kv_occupancy", "new_steps", "pool_cells", "relabel_requests", "request_colors", "request_ids",
           "run_arrivals", "show", "spec_rounds", "speculation_html", "step_html", "timeline", "timeline_figure"]
