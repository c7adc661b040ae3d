"""The chapters' widgets, driven by a real engine: click the buttons, move the sliders, read what
they draw."""

import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minivllm import LLM, SamplingParams, widgets  # noqa: E402
from minivllm.widgets import colors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TOY = [(0, 10), (1, 5), (3, 15), (5, 3), (6, 7)]  # the material's (arrival step, tokens) schedule


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def recorded(llama_path):
    """Three requests through a small engine: block 4, 24 blocks, budget 16 (so the long prompt is
    chunked)."""
    llm = LLM(llama_path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    eng = llm.engine
    for rid, prompt, n in (("long", list(range(1, 22)), 6), ("mid", [5, 6, 7, 8, 9], 4),
                           ("short", [3, 4], 9)):
        eng.add_request(rid, prompt, greedy(n))
    while eng.has_unfinished_requests():
        eng.step()
    return eng, list(eng.trace)


# Run in a fresh interpreter where ipywidgets and IPython cannot be imported (and, for the HTML and
# data views, matplotlib neither): the render functions must work there on a real engine's trace. A
# finder at the front of sys.meta_path refuses the blocked packages, so any import of them, however
# indirect, fails.
PURE_SCRIPT = r"""
import sys

BLOCKED = {"ipywidgets", "IPython", "matplotlib"}


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Refuse())

import minivllm.widgets as w
from minivllm import LLM, SamplingParams
from minivllm.widgets import (
    blocks,
    colors,
    graphs,
    journey,
    speculation,
    timelines,
    traces,
    workloads,
)

greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
llm = LLM(sys.argv[1], block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, speculative_model="[ngram]",
          num_speculative_tokens=3)
rec = w.run_arrivals(llm.engine, [w.Arrival("a", 0, [1, 2, 3, 1, 2, 3, 1, 2], greedy),
                                  w.Arrival("b", 1, list(range(5, 26)), greedy)], "continuous")
steps = rec.steps
assert rec.finished.keys() == {"a", "b"} and len(steps) >= 3
assert any(e.kind == "prefill" for e in steps[0].scheduled)
assert "prefill" in w.step_html(steps[0], 0, len(steps)) and "a" in w.block_table_html(steps[0], 4)
assert len(w.pool_cells(steps[0])) == 24 and w.request_ids(steps) == ["a", "b"]
assert w.timeline(steps, rec.clock, rec.arrivals).request_ids == ["a", "b"]
assert w.kv_occupancy(steps, 4)[0].blocks == 24 - steps[0].num_free_blocks
rounds = w.spec_rounds(steps, "a")
assert sum(len(r.new_token_ids) for r in rounds) == 6 and llm.engine.stats()["spec_num_proposed"] > 0
assert "minivllm-spec" in w.speculation_html(rounds[-1])
assert w.request_ids(w.relabel_requests(steps, {"a": "alice"})) == ["alice", "b"]
assert "no decode step" in w.graph_batch_html(type("NoReplay", (), {"last_replay": None})())
try:
    w.JourneyStepper
except ModuleNotFoundError as e:
    assert e.name == "ipywidgets" and "minivllm[notebook]" in str(e), e
else:
    raise AssertionError("the ipywidgets wiring imported without ipywidgets")

# matplotlib is allowed from here on, ipywidgets and IPython still are not: the figures draw
BLOCKED.discard("matplotlib")
fig = w.block_table_figure(steps[-1], max_blocks=24)
assert len(fig.axes[1].patches) == 24 and w.figure_png(fig)[:4] == b"\x89PNG"
assert len(w.timeline_figure(w.timeline(steps)).axes[0].patches) > 0
assert not [m for m in sys.modules if m.split(".")[0] in ("ipywidgets", "IPython")]
print("pure ok")
"""


def test_render_functions_work_without_ipywidgets(llama_path):
    env = ({**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                   "")])})
    done = subprocess.run([sys.executable, "-c", PURE_SCRIPT, str(llama_path)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "pure ok" in done.stdout, done.stderr[-3000:]


def test_palette_is_matplotlibs_tab20_and_tab20b():
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    palette = [to_hex(c) for name in ("tab20", "tab20b") for c in colormaps[name].colors]
    assert list(colors.PALETTE) == palette[1::2] + palette[0::2]


def test_step_html_names_the_batch_queues_and_blocks(recorded):
    _, steps = recorded
    first = steps[0]
    # budget 16: the 21-token prompt takes the whole first step; the others wait, first come first
    # served
    assert [(e.request_id, e.kind, e.num_tokens)
            for e in first.scheduled] == [("long", "prefill", 16)]
    assert first.waiting == ["mid", "short"] and first.allocated["long"] == [0, 1, 2, 3]
    page = widgets.step_html(first, 0, len(steps))
    assert f"step 1 of {len(steps)} (engine step 0)" in page and "prefill 16 tokens" in page
    assert "<b>long</b> [0, 1, 2, 3]" in page  # blocks allocated
    assert "mid, short" in page  # the waiting queue, in order
    # a chunk that does not reach the prompt's end samples nothing
    assert "none yet (prefill chunk)" in page
    last = steps[-1]
    page = widgets.step_html(last)
    for rid, why in last.finished.items():
        assert f"<b>{rid}</b> ({why})" in page
    for rid, freed in last.freed.items():
        assert f"<b>{rid}</b> {freed}" in page


def test_journey_stepper_buttons_and_slider(recorded):
    _, steps = recorded
    stepper = widgets.JourneyStepper(steps, show_blocks=True, max_blocks=24)
    assert stepper.index == 0 and stepper.slider.value == 1 and stepper.slider.max == len(steps)
    assert (f"step 1 of {len(steps)} (engine step 0)" in stepper.html.value
            and stepper.image.value[:4] == b"\x89PNG")
    assert f"step 1 of {len(steps)}" in stepper.figure.axes[0].get_title()
    stepper.step_button.click()
    assert (stepper.index == 1
            and f"step 2 of {len(steps)} (engine step {steps[1].step})" in stepper.html.value)
    # step 1: the rest of the long prompt (5 tokens) plus the two short prompts, 16 tokens in all
    assert [(e.request_id, e.num_tokens) for e in steps[1].scheduled] == [("long", 5), ("mid", 5),
                                                                          ("short", 2)]
    for rid, blocks_ in steps[1].allocated.items():
        assert f"<b>{rid}</b> {blocks_}" in stepper.html.value
    k = next(i for i, t in enumerate(steps) if t.finished)
    stepper.index = k
    assert stepper.slider.value == k + 1
    assert all(f"<b>{rid}</b> ({why})" in stepper.html.value for rid,
               why in steps[k].finished.items())
    free_patches = [p for p in stepper.figure.axes[1].patches if p.get_linestyle() == "--"]
    assert len(free_patches) == steps[k].num_free_blocks
    stepper.slider.value = stepper.slider.max
    assert stepper.step_button.disabled  # a finished recording with no engine: nothing to step to
    stepper.step_button.click()
    assert stepper.index == len(steps) - 1
    stepper.reset_button.click()
    assert (stepper.index == 0 and "step 1 of" in stepper.html.value
            and not stepper.step_button.disabled)


def test_live_stepper_runs_the_engine_at_the_end_of_the_recording(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=16)
    eng = llm.engine
    # an earlier run in the trace
    llm.generate({"prompt_token_ids": [9, 9, 9]}, greedy(2), use_tqdm=False)
    start = eng.num_steps
    eng.add_request("a", [1, 2, 3, 4, 5, 6], greedy(3))
    eng.add_request("b", [7, 8], greedy(2))
    stepper = widgets.JourneyStepper(eng, max_blocks=16, since_step=start)
    assert stepper.steps == [] and "no steps recorded yet" in stepper.html.value
    stepper.step_button.click()
    assert eng.num_steps == start + 1 and stepper.index == 0 and stepper.steps[0].step == start
    got = stepper.steps[0].allocated
    assert len(got["a"]) == 2 and len(got["b"]) == 1 and not set(got["a"]) & set(got["b"])
    assert "prefill 8 tokens" in stepper.html.value and f"<b>a</b> {got['a']}" in stepper.html.value
    while eng.has_unfinished_requests():
        stepper.step_button.click()
    assert stepper.index == len(stepper.steps) - 1 == eng.num_steps - 1 - start
    assert stepper.step_button.disabled, "the engine is idle: Step has nothing left to run"
    last = stepper.current
    assert last.finished == {"a": "length"} and "<b>a</b> (length)" in stepper.html.value
    assert sum(c.is_free for c in widgets.pool_cells(last)) == 16 == last.num_total_blocks
    stepper.reset_button.click()
    stepper.step_button.click()
    assert (stepper.index == 1
            and eng.num_steps == start + len(stepper.steps)), "replaying does not step the engine"


def test_block_table_viewer_draws_the_pool(recorded):
    eng, steps = recorded
    viewer = widgets.BlockTableViewer(steps, block_size=4)
    for k in (0, 1, 3):
        viewer.index = k
        step = steps[k]
        assert f"step {k + 1} of {len(steps)} (engine step {step.step})" in viewer.html.value
        cells = widgets.pool_cells(step)
        assert len(cells) == 24 and sum(c.is_free for c in cells) == step.num_free_blocks
        page = widgets.block_table_html(step, 4)
        for rid, table in step.block_tables.items():
            assert all(cells[b].owners == [rid] for b in table)
            row = page.split(f"<th>{rid}</th>")[1].split("</tr>")[0]
            assert [int(x.split(">")[-1]) for x in row.split("</td>")[:-1]] == table
        pool_ax = viewer.figure.axes[1]
        assert len(pool_ax.patches) == 24
        assert sum(p.get_linestyle() == "--" for p in pool_ax.patches) == step.num_free_blocks
        assert f"{step.num_free_blocks} of 24 free" in pool_ax.get_title()


def test_shared_prefix_blocks_are_drawn_shared(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=64)
    eng = llm.engine
    system = list(range(10, 27))  # 17 tokens: 4 full blocks, then one more token
    # fills the prefix cache
    llm.generate({"prompt_token_ids": system + [1]}, greedy(1), use_tqdm=False)
    for i, q in enumerate(([1, 2, 3], [4, 5], [6])):
        eng.add_request(f"q{i}", system + q, greedy(3))
    eng.step()
    step = eng.trace[-1]
    shared = [c for c in widgets.pool_cells(step) if c.is_shared]
    assert [c.block_id for c in shared] == step.block_tables["q0"][:4]
    assert all(c.owners == ["q0", "q1", "q2"] and c.ref_cnt == step.shared_blocks[c.block_id] == 3
               for c in shared)
    page = widgets.block_table_html(step, 4)
    assert page.count("(x3 shared)") == 12
    fig = widgets.block_table_figure(step, max_blocks=40)
    assert sum(p.get_hatch() == "//" for p in fig.axes[1].patches) == 4
    assert sum(p.get_hatch() == "//" for p in fig.axes[0].patches) == 12
    assert "4 shared" in fig.axes[1].get_title()
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert [x for x in labels if "\n" in x] == [f"{c.block_id}\nx3"
                                                for c in shared], "id over ref count"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.trace[-1].num_free_blocks == 40 and not eng.trace[-1].shared_blocks


def test_big_pool_draws_a_window_and_says_so(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=500)
    llm.generate({"prompt_token_ids": list(range(1, 30))}, greedy(2), use_tqdm=False)
    step = llm.engine.trace[0]
    fig = widgets.block_table_figure(step, max_blocks=64)
    assert len(fig.axes[1].patches) == 64
    assert "+436 more not drawn, 0 of them in use" in fig.axes[1].get_title()


def toy(prefix):
    return [widgets.Arrival(f"{prefix}{i}", arrival, [1 + i, 2 + i, 3 + i], greedy(n))
            for i, (arrival, n) in enumerate(TOY)]


def test_static_versus_continuous_timeline(llama_path):
    eng = LLM(llama_path, block_size=4, num_kv_blocks=64).engine
    cont = widgets.run_arrivals(eng, toy("c"), "continuous")
    stat = widgets.run_arrivals(eng, toy("s"), "static", batch_size=2)
    # continuous: each request starts the tick it arrives and takes exactly `tokens` steps
    assert cont.finished == {f"c{i}": a + n - 1 for i, (a, n) in enumerate(TOY)}
    # static, pairs: (0,1) start at 1 when both are there; (2,3) after 0 ends at 10; 4 alone after 3
    # ends
    assert stat.finished == {"s0": 10, "s1": 5, "s2": 25, "s3": 13, "s4": 32}
    assert stat.admitted == {"s0": 1, "s1": 1, "s2": 11, "s3": 11, "s4": 26}
    assert [len(o.outputs[0].token_ids) for o in cont.outputs.values()] == [5, 3, 10, 7, 15]
    tl_c = widgets.timeline(cont.steps, cont.clock, cont.arrivals)
    tl_s = widgets.timeline(stat.steps, stat.clock, stat.arrivals)
    assert tl_c.request_ids == ["c0", "c1", "c2", "c3", "c4"] and tl_c.last_x == 17
    assert (tl_c.count("waiting") == 0 and tl_c.count("prefill") == 5
            and tl_c.count("decode") == 40 - 5)
    assert (tl_s.row("s4")[6:26] == ["waiting"] * 20
            and tl_s.row("s4")[26:] == ["prefill"] + ["decode"] * 6)
    assert tl_s.row("s0")[:2] == ["waiting", "prefill"]
    assert tl_s.count("waiting") == 1 + 8 + 6 + 20
    assert sum(stat.latency(r) for r in stat.finished) > sum(cont.latency(r) for r in cont.finished)
    fig = widgets.timeline_figure(tl_s, "static", xlabel="tick")
    assert isinstance(fig, Figure) and fig.axes[0].get_xlabel() == "tick"
    assert len(fig.axes[0].patches) == len(tl_s.cells)


def test_timeline_shows_chunks_and_preemption(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=9, max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": list(range(1, 13))},
                         {"prompt_token_ids": list(range(20, 30))}],
                        greedy(10), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    steps = list(llm.engine.trace)
    tl = widgets.timeline(steps)
    assert tl.row("0")[:2] == ["prefill", "prefill"]  # 12 prompt tokens in chunks of 8 + 4
    preempted = [t.step for t in steps if t.preempted]
    assert preempted, "9 blocks of 4 cannot hold both 22- and 20-token sequences"
    for x in preempted:
        assert all(tl.cells[rid, x] == "preempted" for rid in steps[x].preempted)
    assert tl.count("preempted") == llm.engine.stats()["num_preemptions"]


def test_kv_occupancy_counts_slots_and_tokens(recorded):
    eng, steps = recorded
    occ = widgets.kv_occupancy(steps, 4)
    assert (occ[0].blocks, occ[0].slots, occ[0].tokens) == (4, 16, 16)
    assert (occ[1].slots, occ[1].tokens) == (6 * 4 + 2 * 4 + 4, 21 + 5 + 2)
    for o, t in zip(occ, steps):
        assert o.blocks == t.num_total_blocks - t.num_free_blocks
        # only each table's last block is partial
        assert 0 <= o.slots - o.tokens < 4 * max(o.num_requests, 1)
    assert occ[-1].num_requests == 0 and occ[-1].paged_waste == 0.0
    assert occ[1].static_waste(eng.config.max_model_len) == 1 - 28 / (3 * eng.config.max_model_len)


def test_saved_notebooks_keep_no_widget_views():
    from minivllm.widgets.jupyter import PLACEHOLDER, WIDGET_VIEW, drop_widget_outputs, hint_html

    view = {"output_type": "display_data", "metadata": {},
            "data": {"text/plain": "VBox(...)",
                     WIDGET_VIEW: {"model_id": "abc", "version_major": 2}}}
    hint = {"output_type": "display_data", "metadata": {},
            "data": {"text/html": hint_html(), "text/plain": "x"}}
    text = {"output_type": "stream", "name": "stdout", "text": "hello\n"}
    nb = {"cells": [{"cell_type": "code", "outputs": [view, text]},
                    {"cell_type": "markdown", "source": "x"},
                    {"cell_type": "code", "outputs": [text, view, hint]}],
          "metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {}}}}
    drop_widget_outputs({"type": "notebook", "content": nb}, path="x.ipynb")
    assert nb["cells"][0]["outputs"] == [{**view, "data": {"text/plain": PLACEHOLDER}}, text]
    assert (nb["cells"][2]["outputs"] == [text,
                                          hint]), "a view followed by its hint gives way to the hint"
    assert "widgets" not in nb["metadata"]


def test_a_saved_progress_bar_is_not_called_a_widget_to_rerun():
    """tqdm's notebook bars are widget views too; what stands in for one names it and keeps its text."""
    from minivllm.widgets.jupyter import PLACEHOLDER, PROGRESS_NOTE, WIDGET_VIEW, drop_widget_outputs

    def bar(text):
        return {"output_type": "display_data", "metadata": {},
                "data": {"text/plain": text, WIDGET_VIEW: {"model_id": "t", "version_major": 2}}}

    known = "Processed prompts: 100%|##########| 4/4 [00:00<00:00, 155.63it/s]"
    unknown = "Fetching: 3it [00:00, 137.13it/s]"
    nb = {"cells": [{"cell_type": "code", "outputs": [bar(known), bar(unknown), bar("VBox(children=(...))")]}]}
    drop_widget_outputs({"type": "notebook", "content": nb}, path="x.ipynb")
    texts = [o["data"]["text/plain"] for o in nb["cells"][0]["outputs"]]
    assert texts == [known + PROGRESS_NOTE, unknown + PROGRESS_NOTE, PLACEHOLDER]
    assert all(WIDGET_VIEW not in o["data"] for o in nb["cells"][0]["outputs"])


def test_the_chapters_widgets_display_a_hint_after_the_view(recorded):
    from IPython.core.interactiveshell import InteractiveShell

    from minivllm.widgets.jupyter import HINT_CLASS, WIDGET_VIEW

    shell = InteractiveShell.instance()
    shown = []
    shell.display_pub.publish = lambda data, metadata=None, **kw: shown.append(data)
    try:
        from IPython.display import display

        display(widgets.JourneyStepper(recorded[0]))
    finally:
        InteractiveShell.clear_instance()
    assert len(shown) == 2 and WIDGET_VIEW in shown[0] and HINT_CLASS in shown[1]["text/html"]


def test_the_install_enables_the_save_hook_in_jupyter_server(tmp_path):
    """What `make install` writes is what Jupyter Server reads: `jupyter server --show-config` lists
    the hook by a path that imports (run as `python -m`, the module's own name would be
    `__main__`)."""
    from traitlets.utils.importstring import import_item

    from minivllm.widgets import jupyter

    old = tmp_path / "etc" / "jupyter" / "jupyter_server_config.d" / "minivllm.json"
    old.parent.mkdir(parents=True)
    old.write_text('{"ContentsManager": {"pre_save_hook": "__main__.drop_widget_outputs"}}')
    (tmp_path / "etc" / "jupyter" / "jupyter_server_config.json").write_text('{"ServerApp": '
                                                                             '{"port": 8999}}')
    # as `make install` runs it (`python -m`, so the module is `__main__`), with a temporary prefix
    run_as_main = (f"import runpy, sys; sys.prefix = {str(tmp_path)!r}; "
                   f"runpy.run_module('minivllm.widgets.jupyter', run_name='__main__', "
                   f"alter_sys=True)")
    subprocess.run([sys.executable, "-c", run_as_main], check=True, capture_output=True,
                   cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    path = tmp_path / "etc" / "jupyter" / "jupyter_server_config.json"
    assert (not old.exists()
            and '"port": 8999' in path.read_text()), "the stale file goes, other settings stay"
    env = {**os.environ, "JUPYTER_CONFIG_PATH": str(path.parent),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "user")}
    shown = subprocess.run([sys.executable, "-m", "jupyter_server", "--show-config"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    assert f"ContentsManager\n  .pre_save_hook = '{jupyter.HOOK}'" in shown, shown
    assert import_item(jupyter.HOOK) is jupyter.drop_widget_outputs


def test_a_long_timeline_wraps_onto_rows_that_fit_the_window(llama_path):
    llm = LLM(llama_path, num_kv_blocks=64)
    start = llm.engine.num_steps
    llm.generate([[1, 2, 3], [4, 5]], greedy(100), use_tqdm=False)
    tl = widgets.timeline(widgets.new_steps(llm.engine, start))
    assert tl.last_x >= 99
    fig = widgets.timeline_figure(tl, "long")
    rows = -(-(tl.last_x + 1) // widgets.timelines.ROW_STEPS)
    assert len(fig.axes) == rows and fig.get_figwidth() <= 10
    drawn = sum(len(ax.patches) for ax in fig.axes)
    assert drawn == len(tl.cells), "every cell drawn once, in its row"


def test_kernel_walk_figure_draws_each_programs_blocks_and_running_max():
    """Two slices of request 0 (the second restarts its max), one of request 1, and kv head 1 left
    out: one panel per request, a label per tile, one line per query head and slice."""
    tile = widgets.TileRead
    walk = {(0, 0, 0): [tile((4, 5), (1.0, 0.5)), tile((6, 7), (2.0, 0.5))],
            (0, 0, 1): [tile((9,), (0.3, 1.5))], (1, 0, 0): [tile((2,), (3.0, 3.0))],
            (0, 1, 0): [tile((4, 5), (8.0, 8.0))]}
    fig = widgets.kernel_walk_figure(walk, kv_head=0)
    axes = fig.get_axes()
    assert len(axes) == 2
    labels = [t.get_text() for t in axes[0].texts]
    assert labels[:2] == ["blocks 4,5", "blocks 6,7"] and "blocks 9" in labels and "split 1" in labels
    lines = axes[0].get_lines()
    assert len(lines) == 4  # 2 query heads x 2 slices
    assert list(lines[0].get_ydata()) == [1.0, 2.0] and list(lines[2].get_ydata()) == [0.3]
    assert axes[0].get_xlim() == (0, 3) and 8.0 not in [y for ln in lines for y in ln.get_ydata()]


def test_detokenizer_stepper_holds_back_a_split_character(llama_path):
    """The tokens view over the embedded tokenizer: ☕'s three byte tokens are drawn as its UTF-8
    bytes, the detokenizer steps emit nothing at the first two, and the buttons move the view."""
    from minivllm.tokenizer import Tokenizer

    tok = Tokenizer(Path(__file__).resolve().parent.parent / "minivllm" / "data" / "models" / "minivllm-tiny")
    ids = tok.encode("tea ☕ now")
    table = widgets.pieces_html(tok, ids)
    assert "e2" in table and "98" in table and "95" in table and table.count("#ff9896") == 3 * 3  # 3 tokens x 3 rows
    stepper = widgets.DetokenizerStepper(tok, ids, num_prompt_tokens=1)
    assert "".join(s.emitted for s in stepper.items) == "tea ☕ now"
    assert [s.emitted for s in stepper.items].count("") == 2, "two of ☕'s three bytes emit nothing"
    assert "token 1 of" in stepper.html.value and stepper.reset_button is not None
    stepper.jumps["held-back step"][0].click()
    assert stepper.current.emitted == "" and "emitted <b>nothing</b>" in stepper.html.value
    first_held = stepper.index
    stepper.step_button.click()
    stepper.step_button.click()
    assert stepper.current.emitted == "☕" and stepper.current.read_offset == first_held + 1
    stepper.slider.value = stepper.slider.max
    assert stepper.step_button.disabled and "text so far: <code>&#x27;tea ☕ now&#x27;" in stepper.html.value
    stepper.reset_button.click()
    assert stepper.index == 0
