"""CUDA-graph decode: padded static-buffer batches give transformers' tokens.

CUDA cannot record on this machine, so DecodeGraphs runs with capture=False: the same buffers, copies,
padding (slot -1, one-token contexts) and fixed split-K counts, executed eagerly. Only the recording and
the replay call themselves are left to the GPU check in bench/. Every engine here names its device and
dtype: on a GPU machine (`make gpu-check`) LLM() would otherwise pick cuda and bf16. The compiled-Triton
case runs on cuda there, in fp32.
"""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.kernels import interpreted
from minivllm.runner.cuda_graphs import DecodeGraphs, capture_sizes
from tests.conftest import hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], list(range(200, 250, 3)), [42] * 9, [9, 8, 7]]


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(4096)[-1] == 512  # larger decode batches run eagerly


def attach_graphs(llm: LLM, sizes: list[int], num_splits: int, runner=None) -> DecodeGraphs:
    """Give the runner (default: the target's) graphs in eager mode, and record the batch size of each step."""
    runner, cfg = runner or llm.engine.runner, llm.engine.config
    graphs = DecodeGraphs(runner.model, runner.kv_cache, sizes, -(-cfg.max_model_len // cfg.block_size),
                          runner.device, lambda size: num_splits, capture=False, groups=runner.kv_groups)
    graphs.calls, run = [], graphs.run

    def counting_run(inputs):
        graphs.calls.append(len(inputs.query_lens))
        return run(inputs)

    graphs.run = counting_run
    runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("backend,num_splits,max_new", [("torch", 1, 16), ("triton", 3, 8)])
def test_padded_decode_batches_match_transformers(checkpoints, backend, num_splits, max_new):
    path, model = checkpoints["qwen3"]
    # compiled Triton (a GPU machine, TRITON_INTERPRET=0) runs on cuda only: there, in fp32 against the CPU oracle
    device = "cuda" if backend == "triton" and not interpreted() else "cpu"
    llm = LLM(path, device=device, dtype="float32", attention_backend=backend, block_size=4,
              num_kv_blocks=60, max_num_batched_tokens=128)
    graphs = attach_graphs(llm, [1, 2, 4], num_splits)
    # one request finishes per step, so decode batches shrink 6, 5 (both eager: above 4), 4, 3 (padded), 2, 1
    params = [SamplingParams(temperature=0, max_tokens=max_new - i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, prompt, sp in zip(outs, PROMPTS, params):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, sp.max_tokens)
    assert graphs.calls == [4, 3, 2, 1], "small decode batches go through the graphs, larger ones do not"
    assert graphs.num_replays == 4 and graphs.last_replay == (1, 1)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preemption_and_prefix_hits_with_graphs(checkpoints):
    """Too few blocks (preemption, recompute) and shared prefixes, with every small decode batch padded."""
    path, model = checkpoints["llama"]
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=32)
    graphs = attach_graphs(llm, [2, 8], num_splits=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 1], [5, 6, 7, 8, 9, 10, 11, 12, 2], list(range(30, 52)), [3, 3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 16) for p in prompts]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and graphs.calls
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_no_graphs_off_cuda(llama_path):
    assert LLM(llama_path, device="cpu", num_kv_blocks=16).engine.runner.graphs is None


def test_speculative_decoding_with_graphs(checkpoints):
    """Verification steps (several tokens per request) run eagerly; plain decode steps in between use graphs."""
    path, model = checkpoints["llama"]
    prompts = [[4, 5, 6, 4, 5, 6, 4, 5, 6], list(range(20, 45)), [7, 7, 7, 7]]  # repeats: n-gram drafts
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64, speculative_model="[ngram]",
              num_speculative_tokens=3)
    graphs = attach_graphs(llm, [1, 2, 4], num_splits=1)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 20) for p in prompts]
    assert graphs.calls, "some steps had no drafts to verify and went through the graphs"
    stats = llm.engine.stats()
    assert stats["spec_num_proposed"] > 0, "and some steps verified drafts"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_draft_model_decodes_through_graphs(checkpoints, tmp_path):
    """The draft model's own decode steps (k - 1 per round) use its runner's graphs; output stays the target's."""
    from tests.conftest import build_checkpoint

    path, model = checkpoints["llama"]
    build_checkpoint("llama", tmp_path / "draft", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=64)
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64, speculative_model=tmp_path / "draft",
              num_speculative_tokens=3)
    graphs = attach_graphs(llm, [1, 2, 4], num_splits=1, runner=llm.engine.runner.proposer.runner)
    prompts = [[3, 4, 5, 6], list(range(30, 47)), [9] * 6]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 16) for p in prompts]
    assert graphs.calls and llm.engine.stats()["spec_num_proposed"] > 0


def test_graph_batch_view_shows_the_real_buffers(checkpoints):
    """widgets.graph_batch_html renders the buffers the last replay read: 3 requests, then 1 padding column."""
    import re

    from minivllm import widgets

    path, _ = checkpoints["llama"]
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=40)
    graphs = attach_graphs(llm, [1, 2, 4], num_splits=1)
    assert "no decode step" in widgets.graph_batch_html(graphs)
    engine = llm.engine
    for i, prompt in enumerate([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))
    engine.step()  # prefill (eager)
    engine.step()  # first decode step: 3 requests, the graph for 4
    assert graphs.last_replay == (3, 4)
    page = widgets.graph_batch_html(graphs)
    assert "3 requests decoding" in page and "batch size 4" in page and page.count("(pad)") == 1
    slots = re.search(r"<th>cache slot</th>(.*?)</tr>", page).group(1)
    assert re.findall(r">(-?\d+)</td>", slots) == [str(s) for s in graphs.slot_mapping[:4].tolist()]
    assert slots.endswith(">-1</td>"), "the padding row stores nothing"
