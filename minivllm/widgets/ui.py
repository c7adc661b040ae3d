"""Thin ipywidgets wiring around the pure render functions: buttons and a slider over the steps.

Each widget object keeps its state (the recorded steps and the current position) and re-renders with
the functions in `minivllm.widgets.blocks` / `.journey` / `.speculation` whenever the position
changes. Display it as the last expression of a cell, or with `IPython.display.display(obj)`.

One convention everywhere: positions count from 1, "step k of N", and the slider shows that same k;
the engine's own step number (from 0 since the engine started) is always called "engine step". In
code, `index` is the 0-based position in the recording (`widget.index = i` moves the slider to i +
1). Buttons that cannot do anything (Step at the end of a finished recording, a jump with nothing
ahead) are disabled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import ipywidgets as ipw

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.trace import StepTrace
from minivllm.tokenizer import Tokenizer
from minivllm.widgets.blocks import block_step_html, block_table_figure
from minivllm.widgets.colors import request_colors, request_ids
from minivllm.widgets.figures import figure_png
from minivllm.widgets.journey import empty_html, step_html
from minivllm.widgets.jupyter import hint_html
from minivllm.widgets.speculation import SpecRound, spec_rounds, speculation_html
from minivllm.widgets.tokens import DetokStep, detok_html, detok_steps

if TYPE_CHECKING:
    from matplotlib.figure import Figure

T = TypeVar("T")
# the steppers' figures: small enough that controls, page and figure fit a 900-pixel-high window
FIGURE_DPI = 90


class _Slider(Generic[T]):
    """Reset, Step, a 1-based slider, and a "next ..." button per kind of event in the recording."""

    noun = "step"

    def __init__(self, items: list[T], jumps: Sequence[tuple[str, Callable[[T], bool]]] = (),
                 step_tooltip: str = "next") -> None:
        self.items = items
        self.step_button = ipw.Button(description="Step", tooltip=step_tooltip,
                                      button_style="primary",
                                      layout=ipw.Layout(width="110px"))  # room for "Step (live)"
        self.reset_button = ipw.Button(description="Reset", tooltip=f"back to {self.noun} 1",
                                       layout=ipw.Layout(width="80px"))
        self.slider = ipw.IntSlider(value=1, min=1, max=max(len(items), 1), description=self.noun,
                                    continuous_update=False,
                                    layout=ipw.Layout(width="400px" if len(items) > 100
                                                      else "320px"))
        self.total = ipw.Label()
        self.jumps = {}
        for name, hit in jumps:  # offered only where the recording has such an event
            if any(hit(x) for x in items):
                button = ipw.Button(description=f"next {name}",
                                    tooltip=f"jump to the next {self.noun} with a {name}",
                                    icon="forward", layout=ipw.Layout(width="auto"))
                button.on_click(lambda _, hit=hit: self.jump(hit))
                self.jumps[name] = (button, hit)
        self.step_button.on_click(lambda _: self.step())
        self.reset_button.on_click(lambda _: self.reset())
        self.slider.observe(self._moved, names="value")
        self.controls = ipw.HBox([self.reset_button, self.step_button, self.slider, self.total,
                                  *(b for b, _ in self.jumps.values())],
                                 layout=ipw.Layout(flex_flow="row wrap"))

    @property
    def index(self) -> int:
        """The 0-based position in the recording (the slider shows index + 1)."""
        return self.slider.value - 1

    @index.setter
    def index(self, i: int) -> None:
        self.slider.value = min(max(i, 0), max(len(self.items) - 1, 0)) + 1

    @property
    def current(self) -> T | None:
        return self.items[self.index] if self.items else None

    def jump(self, hit: Callable[[T], bool]) -> None:
        """Move to the next item (after the current one) for which `hit` is true."""
        i = next((j for j in range(self.index + 1, len(self.items)) if hit(self.items[j])), None)
        if i is not None:
            self.index = i

    def _moved(self, change) -> None:
        self.render()

    def reset(self) -> None:
        if self.index == 0:
            self._moved(None)  # the slider stays where it is: redraw as if it had moved
        self.index = 0

    def _update_controls(self, can_step: bool) -> None:
        self.total.value = f"of {len(self.items)}"
        self.slider.disabled = len(self.items) < 2
        self.step_button.disabled = not can_step
        for button, hit in self.jumps.values():
            button.disabled = not any(hit(x) for x in self.items[self.index + 1:])

    def render(self) -> None:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        """The widget, then a "run this cell again" line that shows only once the widget's kernel is
        gone (minivllm.widgets.jupyter says why)."""
        from IPython.display import HTML, display

        display(self.widget)
        display(HTML(hint_html()))


class _StepWidget(_Slider[StepTrace]):
    """The step slider over recorded steps, a line of HTML and (if `show_blocks`) the block tables
    figure. A live engine's recording grows: Step past its end runs one `engine.step()` while the
    engine has unfinished requests."""

    def __init__(self, source: LLMEngine | Sequence[StepTrace], since_step: int, max_blocks: int,
                 show_blocks: bool, jumps: Sequence[tuple[str, Callable[[StepTrace], bool]]]):
        self.engine = source if isinstance(source, LLMEngine) else None
        steps = (list(source) if self.engine is None
                 else [t for t in self.engine.trace if t.step >= since_step])
        super().__init__(steps, jumps, "next recorded step (past the end of a live engine's: run "
                         "one step)")
        self.colors = request_colors(request_ids(self.steps))
        self.show_blocks, self.max_blocks = show_blocks, max_blocks
        self.html = ipw.HTML()
        self.image = ipw.Image(format="png",
                               layout=ipw.Layout(max_width="100%", align_self="flex-start"))
        self.image.layout.display = None if show_blocks else "none"
        self.figure: Figure | None = None
        self.widget = ipw.VBox([self.controls, self.html, self.image])

    @property
    def steps(self) -> list[StepTrace]:
        return self.items

    @property
    def live(self) -> bool:
        """A live engine with work left: Step at the end of the recording runs it."""
        return self.engine is not None and self.engine.has_unfinished_requests()

    def step(self) -> None:
        """Next recorded step; past the recording's end, a live engine with work left runs one."""
        if self.index < len(self.steps) - 1:
            self.index += 1
            return
        if not self.live:
            return
        before = self.engine.num_steps
        self.engine.step()
        fresh = [t for t in self.engine.trace if t.step >= before]
        if not fresh:  # an abort-only step records nothing
            self.render()
            return
        self.steps.extend(fresh)
        self.colors = request_colors(request_ids(self.steps))
        self.slider.max = len(self.steps)
        if self.slider.value == self.slider.max:
            self.render()
        self.slider.value = self.slider.max

    def render(self) -> None:
        at_end = self.index >= len(self.steps) - 1
        self._update_controls(can_step=not at_end or self.live)
        self.step_button.description = "Step (live)" if at_end and self.live else "Step"
        step = self.current
        if step is None:
            self.html.value, self.figure = empty_html(), None
            return
        self.html.value = self._page(step)
        if self.show_blocks:
            self.figure = block_table_figure(step, self.max_blocks, colors=self.colors,
                                             label=f"step {self.index + 1} of {len(self.steps)}")
            self.image.value = figure_png(self.figure, dpi=FIGURE_DPI)

    def _page(self, step: StepTrace) -> str:
        raise NotImplementedError


class JourneyStepper(_StepWidget):
    """Step through a recording: the batch, the queues, blocks in and out, and (optionally) the
    block pool. `source` is a list of StepTrace (a finished recording) or an LLMEngine: its trace
    from `since_step` on, then Step calls `engine.step()` while requests are unfinished."""

    def __init__(self, source: LLMEngine | Sequence[StepTrace], tokenizer=None,
                 show_blocks: bool = True, max_blocks: int = 64, since_step: int = 0) -> None:
        super().__init__(source, since_step, max_blocks, show_blocks,
                         [("preemption", lambda t: bool(t.preempted)),
                          ("prefix hit", lambda t: bool(t.cache_hits))])
        self.tokenizer = tokenizer if tokenizer is not None else getattr(self.engine, "tokenizer",
                                                                         None)
        self.render()

    def _page(self, step: StepTrace) -> str:
        return step_html(step, self.index, len(self.steps), self.tokenizer, self.colors)


class BlockTableViewer(_StepWidget):
    """Each request's logical blocks -> the physical pool at the slider's step; a line above the
    figure says which blocks the step allocated or freed (most decode steps: none)."""

    def __init__(self, source: LLMEngine | Sequence[StepTrace], block_size: int | None = None,
                 max_blocks: int = 64, since_step: int = 0) -> None:
        super().__init__(source, since_step, max_blocks, True, [
            ("block change", lambda t: bool(t.allocated or t.freed or t.cache_hits)),
            ("preemption", lambda t: bool(t.preempted))])
        self.block_size = block_size or (self.engine.config.block_size if self.engine else None)
        self.render()

    def _page(self, step: StepTrace) -> str:
        return block_step_html(step, self.index, len(self.steps), self.block_size)


class SpeculationStepper(_Slider[SpecRound]):
    """Speculative decoding, one request, token by token: a slider over the rounds (steps that gave
    it tokens) and a Step button that reveals the target's verdict on one more token, then the next
    round.

    `source` is a list of StepTrace (a recording of an engine with a drafter) or an LLMEngine (its
    trace); `request_id` picks the request (default: the first one in the recording);
    `prompt_token_ids` (e.g. a RequestOutput's) puts its prompt in front of the context line.
    """

    noun = "round"

    def __init__(self, source: LLMEngine | Sequence[StepTrace], request_id: str | None = None,
                 tokenizer=None, prompt_token_ids: Sequence[int] = (), since_step: int = 0) -> None:
        engine = source if isinstance(source, LLMEngine) else None
        steps = (list(source) if engine is None
                 else [t for t in engine.trace if t.step >= since_step])
        self.request_id = next(iter(request_ids(steps)), "") if request_id is None else request_id
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.prompt_token_ids = list(prompt_token_ids)
        self.revealed = 0
        super().__init__(spec_rounds(steps, self.request_id),
                         [("rejection", lambda r: r.outcome == "correction")],
                         "the target's verdict on the next token")
        self.html = ipw.HTML()
        self.show_all_button = ipw.Button(description="Show round",
                                          tooltip="every verdict of this round at once",
                                          layout=ipw.Layout(width="100px"))
        self.show_all_button.on_click(lambda _: self.show_round())
        self.controls.children = (*self.controls.children[:2], self.show_all_button,
                                  *self.controls.children[2:])
        self.widget = ipw.VBox([self.controls, self.html])
        self.render()

    @property
    def rounds(self) -> list[SpecRound]:
        return self.items

    def _moved(self, change) -> None:
        self.revealed = 0  # a new round starts with its drafts proposed and nothing judged yet
        self.render()

    def step(self) -> None:
        """Reveal one more appended token; once a round is fully revealed, go on to the next one."""
        rnd = self.current
        if rnd is None:
            return
        if self.revealed < rnd.num_reveals:
            self.revealed += 1
            self.render()
        elif self.index < len(self.rounds) - 1:
            self.index += 1  # resets `revealed` and renders

    def show_round(self) -> None:
        if self.current is not None:
            self.revealed = self.current.num_reveals
            self.render()

    def render(self) -> None:
        rnd = self.current
        done = rnd is None or (self.revealed >= rnd.num_reveals
                               and self.index >= len(self.rounds) - 1)
        self._update_controls(can_step=not done)
        if rnd is None:
            self.html.value = empty_html(f"no tokens recorded for request {self.request_id!r}")
            return
        self.show_all_button.disabled = self.revealed >= rnd.num_reveals
        self.html.value = speculation_html(rnd, self.tokenizer, self.revealed, self.index,
                                           len(self.rounds), self.prompt_token_ids)


class DetokenizerStepper(_Slider[DetokStep]):
    """The engine's incremental detokenizer over `all_token_ids` (prompt then output), one output
    token per slider position: the window it decoded, its offsets and the text it emitted."""

    noun = "token"

    def __init__(self, tokenizer: Tokenizer, all_token_ids: Sequence[int],
                 num_prompt_tokens: int) -> None:
        self.tokenizer, self.all_token_ids = tokenizer, list(all_token_ids)
        super().__init__(detok_steps(tokenizer, self.all_token_ids, num_prompt_tokens),
                         [("held-back step", lambda s: not s.emitted)], "the next output token")
        self.html = ipw.HTML()
        self.widget = ipw.VBox([self.controls, self.html])
        self.render()

    def step(self) -> None:
        self.index += 1

    def render(self) -> None:
        self.html.value = (detok_html(self.tokenizer, self.all_token_ids, self.items, self.index)
                           if self.items else empty_html("no output tokens"))
        self._update_controls(self.index < len(self.items) - 1)
