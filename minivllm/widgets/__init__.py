"""Widgets for the chapters: pure render functions of recorded engine state, plus thin ipywidgets
wiring.

The render functions (imported below, one view per module) need no ipywidgets: they return
matplotlib Figures, HTML strings or plain data, and import matplotlib only where a figure is drawn.
The widgets (ipywidgets, the `notebook` extra: JourneyStepper, BlockTableViewer, SpeculationStepper)
live in `ui`, imported on first use of one of those names, so `import minivllm.widgets` needs no
ipywidgets.
"""

from minivllm.widgets.blocks import BlockCell, block_table_figure, block_table_html, pool_cells
from minivllm.widgets.colors import request_colors, request_ids
from minivllm.widgets.experts import (
    MoeTraffic,
    expert_bytes_read,
    expert_load_figure,
    experts_touched,
    imbalance,
    moe_traffic,
    router_choices_html,
    traffic_html,
)
from minivllm.widgets.figures import figure_png, show
from minivllm.widgets.graphs import graph_batch_html
from minivllm.widgets.journey import step_html
from minivllm.widgets.kernel_walk import TileRead, decode_walk, kernel_walk_figure
from minivllm.widgets.kv_groups import group_tables, group_tables_figure
from minivllm.widgets.memory import ForkRow, fork_html, fork_rows, swap_totals
from minivllm.widgets.speculation import SpecRound, spec_rounds, speculation_html
from minivllm.widgets.step_time import host_share, step_time_breakdown, step_time_figure
from minivllm.widgets.timelines import Timeline, timeline, timeline_figure
from minivllm.widgets.tokens import DetokStep, detok_html, detok_steps, pieces_html, token_bytes
from minivllm.widgets.traces import relabel_requests
from minivllm.widgets.workloads import (
    Arrival,
    Occupancy,
    Recording,
    kv_occupancy,
    new_steps,
    run_arrivals,
)

_UI = ("BlockTableViewer", "DetokenizerStepper", "JourneyStepper", "SpeculationStepper")


def __getattr__(name: str):
    """The ipywidgets classes, imported from `ui` the first time one is asked for."""
    if name in _UI:
        try:
            from minivllm.widgets import ui
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"minivllm.widgets.{name} needs {e.name}: pip install "
                                      f"'minivllm[notebook]'", name=e.name) from e
        return getattr(ui, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Arrival", "BlockCell", "BlockTableViewer", "DetokStep", "DetokenizerStepper", "ForkRow",
           "JourneyStepper", "MoeTraffic", "Occupancy", "Recording", "SpecRound",
           "SpeculationStepper", "TileRead", "Timeline", "block_table_figure", "block_table_html",
           "decode_walk", "detok_html", "detok_steps", "expert_bytes_read", "expert_load_figure",
           "experts_touched", "figure_png", "fork_html", "fork_rows", "graph_batch_html",
           "group_tables", "group_tables_figure", "host_share", "imbalance", "kernel_walk_figure",
           "kv_occupancy", "moe_traffic", "new_steps", "pieces_html", "pool_cells",
           "relabel_requests", "request_colors", "request_ids", "router_choices_html",
           "run_arrivals", "show", "spec_rounds", "speculation_html", "step_html",
           "step_time_breakdown", "step_time_figure", "swap_totals", "timeline", "timeline_figure",
           "token_bytes", "traffic_html"]
