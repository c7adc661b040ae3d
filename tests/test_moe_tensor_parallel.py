"""A mixture of experts over 2 gloo ranks on CPU: tensor parallel (every expert's intermediate dimension split, vLLM's
default) and expert parallel (whole experts per rank, 9 experts on 2 ranks: 5 and 4) give tp=1's greedy tokens."""

from dataclasses import replace

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.distributed.parallel import check_divisible
from minivllm.model.loader import read_model_config
from minivllm.model.moe_layer import FusedExperts
from tests.conftest import hf_greedy
from tests.test_moe_families import E, build_moe_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 3, 40, 2], list(range(20, 60)), [7] * 30]


def experts_of(llm: LLM) -> FusedExperts:
    return next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_tensor_and_expert_parallel_equal_one_rank(tmp_path, kind):
    """Chunked prefill, preemption and n-gram drafts on 2 ranks; greedy tokens equal to tp=1 (itself equal to
    transformers), logprobs within 1e-4."""
    hf = build_moe_checkpoint(kind, tmp_path / kind)
    path = str(tmp_path / kind)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    kwargs = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    ref = LLM(path, **kwargs).generate(inputs, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ref] == [hf_greedy(hf, p, 10) for p in PROMPTS]
    for expert_parallel in (False, True):
        with LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kwargs) as llm:
            experts = experts_of(llm)  # rank 0's
            if expert_parallel:  # whole experts: rank 0 holds 5 of 9, at full width
                assert experts.experts == range(0, 5) and experts.gate_up_proj.shape[:2] == (5, 80)
            else:  # every expert, half of each one's intermediate dimension
                assert experts.experts == range(E) and experts.gate_up_proj.shape[:2] == (E, 40)
            llm.engine.runner.traffic.reset()
            outs = llm.generate(inputs, greedy, use_tqdm=False)
            assert llm.engine.stats()["num_preemptions"] > 0, "the workload should preempt"
            assert llm.engine.runner.traffic.all_reduce_calls > 0
            for out, want in zip(outs, ref):
                assert out.outputs[0].token_ids == want.outputs[0].token_ids, expert_parallel
                for got, exp in zip(out.outputs[0].logprobs, want.outputs[0].logprobs):
                    assert got.keys() == exp.keys()
                    assert all(abs(got[t].logprob - exp[t].logprob) < 1e-4 for t in got)


def test_what_does_not_split_is_refused_by_name(tmp_path):
    build_moe_checkpoint("mixtral", tmp_path / "m")
    cfg = read_model_config(tmp_path / "m")  # 9 experts, each 40 wide
    check_divisible(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's experts' "
                                         r"intermediate size \(41\)"):
        check_divisible(replace(cfg, moe_intermediate_size=41), 2)
    check_divisible(replace(cfg, moe_intermediate_size=41, expert_parallel=True), 2)  # whole experts: any width
    with pytest.raises(ValueError, match="only 1 experts per layer, fewer than the ranks"):
        check_divisible(replace(cfg, num_experts=1, expert_parallel=True), 2)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_int8_experts_on_two_ranks_equal_one_rank(tmp_path, expert_parallel):
    """Int8 experts quantize each rank's share at load with one process's scales: split down rows (tensor
    parallel) take the max |w| over the ranks, whole experts (expert parallel) their own."""
    build_moe_checkpoint("mixtral", tmp_path / "m")
    kwargs = dict(dtype="float32", quantization="int8", num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path / "m"), **kwargs).generate(inputs, greedy, use_tqdm=False)]
    with LLM(str(tmp_path / "m"), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kwargs) as llm:
        assert experts_of(llm).down_proj.dtype == torch.int8
        got = [o.outputs[0].token_ids for o in llm.generate(inputs, greedy, use_tqdm=False)]
    assert got == want
