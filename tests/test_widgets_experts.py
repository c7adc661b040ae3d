"""Chapter 14's mixture-of-experts views: pure functions of the router's recorded choices, checked on known
loads and on a real engine run of the embedded MoE."""

import html

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minivllm import LLM, SamplingParams, widgets  # noqa: E402
from minivllm.config import DEFAULT_MOE_MODEL  # noqa: E402
from minivllm.model.moe_layer import MoeFeedForward, expert_load  # noqa: E402
from minivllm.widgets.experts import expert_color  # noqa: E402


def test_imbalance_is_the_busiest_expert_over_the_mean():
    assert widgets.imbalance([3, 3, 3, 3]) == 1.0
    assert widgets.imbalance([8, 0, 0, 0]) == 4.0  # E / k's worst case for E=8, k=2 is 4 as well
    assert widgets.imbalance([6, 2, 0, 0]) == 3.0
    assert widgets.imbalance([0, 0, 0]) == 0.0  # a layer that saw no token


def test_bytes_read_count_each_touched_expert_once_per_layer():
    load = [(5, 0, 1, 0), (0, 0, 0, 6)]  # two layers, four experts
    assert widgets.experts_touched(load) == [2, 1]
    assert widgets.expert_bytes_read(load, 100) == 300  # 3 experts read, however many tokens each


def test_traffic_from_the_shapes():
    tp, ep, a2a = widgets.moe_traffic(tokens=64, hidden_size=2048, top_k=8, ranks=8, itemsize=2)
    rows = 64 * 2048 * 2
    assert tp.tensor_bytes == ep.tensor_bytes == rows  # one [tokens, hidden] all-reduce either way
    assert tp.wire_bytes == rows * 2 * 7 // 8  # ring all-reduce: 2 (N - 1) / N of it from each rank
    mine = 64 // 8 * 8 * 2048 * 2  # this rank's 8 tokens, 8 rows each
    assert a2a.tensor_bytes == 2 * mine and a2a.wire_bytes == 2 * mine * 7 // 8  # dispatch + combine
    alone = widgets.moe_traffic(tokens=16, hidden_size=128, top_k=2, ranks=1, itemsize=4)
    assert all(t.wire_bytes == 0 for t in alone)  # one rank sends nothing
    table = widgets.traffic_html({"batch 64, 8 ranks": [tp, ep, a2a]})
    assert table.count("<tr>") == 4 and f"{rows:,}" in table


def test_router_choices_html_colours_each_expert_and_escapes_tokens():
    page = widgets.router_choices_html(["<s>", " cat"], [[[0, 3], [3, 1]], [[2, 0], [1, 2]]],
                                       weights=[[[0.7, 0.3], [0.6, 0.4]], [[0.5, 0.5], [0.9, 0.1]]])
    assert html.escape(repr("<s>")) in page and "<s>" not in page.replace(html.escape(repr("<s>")), "")
    for expert in (0, 1, 2, 3):
        assert expert_color(expert) in page
    assert page.count("<tr>") == 3 and "layer 1" in page and "0.90" in page


def test_load_figure_has_a_heat_map_and_an_imbalance_line_per_layer():
    loads = [[(10, 2, 0, 4), (4, 4, 4, 4)], [(1, 1, 0, 0), (0, 2, 0, 0)]]
    fig = widgets.expert_load_figure(loads, title="toy")
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    imbalance_line = fig.axes[3].lines[0]
    assert list(imbalance_line.get_ydata()) == [1.0, 4.0]  # layer 1: even, then one expert took both
    with pytest.raises(ValueError, match="trace_steps"):
        widgets.expert_load_figure([])


def test_the_engine_recording_the_chapter_draws():
    """The chapter's wiring on the embedded MoE: every step's load per layer adds up to its tokens x k."""
    llm = LLM(DEFAULT_MOE_MODEL, device="cpu", dtype="float32")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, MoeFeedForward)]
    assert len(layers) == 2 and (layers[0].num_experts, layers[0].top_k) == (8, 2)
    for layer in layers:
        layer.record_choices(llm.engine.config.max_num_batched_tokens)
    steps = []
    llm.engine.add_step_observer(lambda engine, record: steps.append(
        (sum(s.num_new_tokens for s in record.scheduler_output.scheduled),
         expert_load(model, sum(s.num_new_tokens for s in record.scheduler_output.scheduled)))))
    llm.generate(["Hi, my name is", "Hello there", "Once upon a time"], SamplingParams(temperature=0, max_tokens=6),
                 use_tqdm=False)
    assert len(steps) == 6 and steps[0][0] > 3 and all(tokens == 3 for tokens, _ in steps[1:])
    for tokens, load in steps:
        assert [sum(layer) for layer in load] == [2 * tokens] * 2
        assert all(1 <= touched <= min(8, 2 * tokens) for touched in widgets.experts_touched(load))
    fig = widgets.expert_load_figure([load for _, load in steps])
    assert len(fig.axes) == 4
