"""Thin ipywidgets wiring around the pure render functions: buttons and a slider over recorded steps.

Each widget object keeps its state (the recorded steps and the current position) and re-renders with the
functions in `minivllm.widgets.blocks` / `.journey` / `.speculation` whenever the position changes. Display
it as the last expression of a cell, or with `IPython.display.display(obj)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import ipywidgets as ipw

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import StepTrace
from minivllm.widgets.blocks import block_table_figure, block_table_html
from minivllm.widgets.colors import request_colors, request_ids
from minivllm.widgets.figures import figure_png
from minivllm.widgets.journey import empty_html, step_html
from minivllm.widgets.speculation import SpecRound, spec_rounds, speculation_html

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class _StepWidget:
    """A slider over recorded steps with Reset and Step buttons; subclasses say what to draw."""

    def __init__(self, source: LLMEngine | Sequence[StepTrace], since_step: int = 0) -> None:
        self.engine = source if isinstance(source, LLMEngine) else None
        if self.engine is not None:
            self.steps = [t for t in self.engine.trace if t.step >= since_step]
        else:
            self.steps = list(source)
        self.colors = request_colors(request_ids(self.steps))
        self.step_button = ipw.Button(description="Step", tooltip="next recorded step (or run one live step)")
        self.reset_button = ipw.Button(description="Reset", tooltip="back to the first recorded step")
        self.slider = ipw.IntSlider(value=0, min=0, max=max(len(self.steps) - 1, 0), description="step",
                                    continuous_update=False)
        self.step_button.on_click(lambda _: self.step())
        self.reset_button.on_click(lambda _: self.reset())
        self.slider.observe(lambda change: self.render(), names="value")
        self.controls = ipw.HBox([self.reset_button, self.step_button, self.slider])

    @property
    def index(self) -> int:
        return self.slider.value

    @property
    def current(self) -> StepTrace | None:
        return self.steps[self.index] if self.steps else None

    def step(self) -> None:
        """Next recorded step; at the end of the recording, a live engine with work left runs one more."""
        if self.index < len(self.steps) - 1:
            self.slider.value = self.index + 1
            return
        if self.engine is None or not self.engine.has_unfinished_requests():
            return
        before = self.engine.num_steps
        self.engine.step()
        fresh = [t for t in self.engine.trace if t.step >= before]
        if not fresh:  # an abort-only step records nothing
            return
        self.steps += fresh
        self.colors = request_colors(request_ids(self.steps))
        self.slider.max = len(self.steps) - 1
        if self.slider.value == self.slider.max:
            self.render()
        self.slider.value = self.slider.max

    def reset(self) -> None:
        if self.slider.value == 0:
            self.render()
        self.slider.value = 0

    def render(self) -> None:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


class JourneyStepper(_StepWidget):
    """Step through a recording: the batch, the queues, blocks in and out, and (optionally) the block pool.

    `source` is a list of StepTrace (a finished recording) or an LLMEngine: its trace from `since_step` on,
    and when the recording runs out, Step calls `engine.step()` while requests are unfinished.
    """

    def __init__(self, source: LLMEngine | Sequence[StepTrace], tokenizer=None, show_blocks: bool = True,
                 max_blocks: int = 64, since_step: int = 0) -> None:
        super().__init__(source, since_step)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(self.engine, "tokenizer", None)
        self.show_blocks, self.max_blocks = show_blocks, max_blocks
        self.html = ipw.HTML()
        self.image = ipw.Image(format="png")
        self.image.layout.display = None if show_blocks else "none"
        self.figure: Figure | None = None
        self.widget = ipw.VBox([self.controls, self.html, self.image])
        self.render()

    def render(self) -> None:
        step = self.current
        if step is None:
            self.html.value, self.figure = empty_html(), None
            return
        self.html.value = step_html(step, self.index, len(self.steps), self.tokenizer, self.colors)
        if self.show_blocks:
            self.figure = block_table_figure(step, self.max_blocks, colors=self.colors)
            self.image.value = figure_png(self.figure)


class BlockTableViewer(_StepWidget):
    """Each request's logical blocks -> the physical pool, at the step the slider points to."""

    def __init__(self, source: LLMEngine | Sequence[StepTrace], block_size: int | None = None,
                 max_blocks: int = 64, since_step: int = 0) -> None:
        super().__init__(source, since_step)
        self.block_size = block_size or (self.engine.config.block_size if self.engine else None)
        self.max_blocks = max_blocks
        self.html = ipw.HTML()
        self.image = ipw.Image(format="png")
        self.figure: Figure | None = None
        self.widget = ipw.VBox([self.controls, self.image, self.html])
        self.render()

    def render(self) -> None:
        step = self.current
        if step is None:
            self.html.value, self.figure = empty_html(), None
            return
        self.figure = block_table_figure(step, self.max_blocks, colors=self.colors)
        self.image.value = figure_png(self.figure)
        self.html.value = block_table_html(step, self.block_size, self.colors)


class SpeculationStepper:
    """Speculative decoding, one request, token by token: a slider over the rounds (steps that gave it tokens)
    and a Step button that reveals the target's verdict on one more token; past the last one, the next round.

    `source` is a list of StepTrace (a recording of an engine with a drafter) or an LLMEngine (its trace);
    `request_id` picks the request (default: the first one in the recording); `prompt_token_ids` (e.g. a
    RequestOutput's) puts its prompt in front of the context line.
    """

    def __init__(self, source: LLMEngine | Sequence[StepTrace], request_id: str | None = None, tokenizer=None,
                 prompt_token_ids: Sequence[int] = (), since_step: int = 0) -> None:
        engine = source if isinstance(source, LLMEngine) else None
        steps = [t for t in engine.trace if t.step >= since_step] if engine is not None else list(source)
        self.request_id = request_id if request_id is not None else next(iter(request_ids(steps)), "")
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.prompt_token_ids = list(prompt_token_ids)
        self.rounds = spec_rounds(steps, self.request_id)
        self.revealed = 0
        self.html = ipw.HTML()
        self.step_button = ipw.Button(description="Step", tooltip="the target's verdict on the next token")
        self.reset_button = ipw.Button(description="Reset", tooltip="back to the first round")
        self.show_all_button = ipw.Button(description="Show round", tooltip="every verdict of this round at once")
        self.slider = ipw.IntSlider(value=0, min=0, max=max(len(self.rounds) - 1, 0), description="round",
                                    continuous_update=False)
        self.step_button.on_click(lambda _: self.step())
        self.reset_button.on_click(lambda _: self.reset())
        self.show_all_button.on_click(lambda _: self.show_round())
        self.slider.observe(self._moved, names="value")
        self.widget = ipw.VBox([ipw.HBox([self.reset_button, self.step_button, self.show_all_button, self.slider]),
                                self.html])
        self.render()

    @property
    def index(self) -> int:
        return self.slider.value

    @property
    def current(self) -> SpecRound | None:
        return self.rounds[self.index] if self.rounds else None

    def _moved(self, change) -> None:
        self.revealed = 0  # a new round starts with its drafts proposed and nothing judged yet
        self.render()

    def step(self) -> None:
        """Reveal one more appended token; once a round is fully revealed, go on to the next round."""
        rnd = self.current
        if rnd is None:
            return
        if self.revealed < rnd.num_reveals:
            self.revealed += 1
            self.render()
        elif self.index < len(self.rounds) - 1:
            self.slider.value = self.index + 1  # resets `revealed` and renders

    def show_round(self) -> None:
        if self.current is not None:
            self.revealed = self.current.num_reveals
            self.render()

    def reset(self) -> None:
        if self.slider.value == 0:
            self.revealed = 0
            self.render()
        self.slider.value = 0

    def render(self) -> None:
        rnd = self.current
        if rnd is None:
            self.html.value = empty_html(f"no tokens recorded for request {self.request_id!r}")
            return
        self.html.value = speculation_html(rnd, self.tokenizer, self.revealed, self.index, len(self.rounds),
                                           self.prompt_token_ids)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
