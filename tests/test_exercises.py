"""Every exercise's checker passes the reference solution, reports a stub as "not attempted", and
fails a planted mistake with a message that says what is wrong."""

import hashlib
import importlib.util
import json
from collections import deque
from pathlib import Path

import pytest
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import DEFAULT_MODEL
from minivllm.core.block_pool import BlockPool
from minivllm.exercises import (
    ExerciseFailure,
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    ch10,
    ch11,
    ch12,
    ch13,
    ch14,
)
from minivllm.exercises.common import for_all_workloads, run_workload
from minivllm.hooks import EngineHooks

SOLUTIONS = Path(__file__).resolve().parent.parent / "chapters" / "solutions"


def solution(module: str, name: str):
    spec = importlib.util.spec_from_file_location(module, SOLUTIONS / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, name)


def stub(*args, **kwargs):
    raise NotImplementedError


class StubPool(BlockPool):
    def allocate(self) -> int:
        raise NotImplementedError

    def free(self, block_id: int) -> None:
        raise NotImplementedError


# ---- planted mistakes, the kind a learner makes --------------------------------------------------
def lifo_for_preempted(waiting: deque, request, preempted: bool) -> None:
    waiting.append(request)  # a preempted request queues behind later arrivals


def no_rescale(m, l, acc, scores, v):  # noqa: E741
    m_new = torch.maximum(m, scores.amax(dim=-1))
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(-1), acc + torch.einsum("hn,hnd->hd", p, v)  # forgot exp(m_old - m_new)


class FreesSharedBlocks(BlockPool):
    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_cnt = 0  # drops every reader at once
        self.free_queue[block_id] = None


class NoDoubleFreeCheck(BlockPool):
    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)


def ignores_budget(num_remaining: int, budget: int, enable_chunked_prefill: bool) -> int:
    return num_remaining


def top_p_in_sorted_order(logits, top_p):
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    # forgot to scatter the mask back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def hash_without_parent(parent_hash, token_ids) -> bytes:
    return hashlib.sha256(str(list(token_ids)).encode()).digest()


def resample_from_p(target_probs, draft, draft_probs, generator):
    out = []
    for i, d in enumerate(draft):
        p = target_probs[i]
        q = (draft_probs[i] if draft_probs is not None
             else torch.nn.functional.one_hot(torch.tensor(d), len(p)).to(p))
        if torch.rand((), generator=generator) * q[d] < p[d]:
            out.append(d)
            continue
        # p, not normalise(max(0, p - q))
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))
    return out


def one_scale_per_tensor(weight):
    # per tensor, not per output channel
    scale = (weight.abs().amax() / 127).expand(weight.shape[0])
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def truncates(weight):
    scale = weight.abs().amax(dim=1) / 127
    return (weight / scale[:, None]).trunc().to(torch.int8), scale


def no_zero_row_guard(weight):
    # no clamp: an all-zero row gets scale 0, and q = round(0 / 0) = round(NaN) cast to int8
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def kv_heads_not_replicated(num_heads, num_kv_heads, head_dim, tp_size, rank):
    # rank r takes KV head r even when kv < tp
    q, kv = num_heads // tp_size, max(1, num_kv_heads // tp_size)
    k, v = (num_heads + rank * kv) * head_dim, (num_heads + num_kv_heads + rank * kv) * head_dim
    return [*range(rank * q * head_dim, (rank + 1) * q * head_dim), *range(k, k + kv * head_dim),
            *range(v, v + kv * head_dim)]


def route_smallest(router_logits, top_k, renormalize):  # topk(largest=False)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1, largest=False)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


def route_never_renormalises(router_logits, top_k, renormalize):
    return torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)


def route_softmax_over_the_k(router_logits, top_k, renormalize):  # Mixtral's form, also where it is wrong
    logits, ids = router_logits.float().topk(top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids


def route_logits_as_weights(router_logits, top_k, renormalize):
    return router_logits.float().topk(top_k, dim=-1)


def route_wrong_only_in_the_engine(router_logits, top_k, renormalize):
    """Right on the synthetic cases; in the engine's forward (inference tensors) token 0's weights are
    swapped, as a slip would: only the engine check can catch it, and it must name the layer and token."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if router_logits.is_inference():
        weights = weights.clone()
        weights[0] = weights[0].flip(0)
    return weights, ids


def logical_as_physical(block_table, positions, block_size):
    return positions // block_size, positions % block_size  # forgot to look the block up


def table_clamped(block_table, positions, block_size):
    # right for the first three blocks only (all the known-answer table has)
    return block_table[(positions // block_size).clamp(max=2)], positions % block_size


def no_buffer(chunks):
    for chunk in chunks:  # each network chunk taken as whole events
        for event in chunk.split(b"\n\n"):
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                yield json.loads(event[6:])


def decodes_each_chunk(chunks):
    buffer = ""
    for chunk in chunks:
        buffer += chunk.decode()  # a chunk may end inside a character
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            if event == "data: [DONE]":
                return
            yield json.loads(event[6:])


def parses_done(chunks):
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield json.loads(event[6:])  # [DONE] too


def keeps_padded_ids(token, is_special, skip_special_tokens):
    return not (is_special and skip_special_tokens)  # None (a padded id) passes


def drops_special_always(token, is_special, skip_special_tokens):
    return token is not None and not is_special


def newest_running(running, outranked_by):
    return running[-1] if outranked_by is None and running else None  # fcfs, not priority


def ignores_outranked_by(running, outranked_by):
    return max(running, key=lambda seq: seq.priority_key) if running else None


FAST = {"max_examples": 2}  # after the 3 hard workloads every property check tries first
EXERCISES = {  # name: (checker, its fast arguments, solution module, solution name, stub)
    "ch01": (ch01.check_enqueue, FAST, "ch01_enqueue", "my_enqueue", stub),
    "ch02": (ch02.check_online_softmax_update, {}, "ch02_online_softmax",
             "my_online_softmax_update", stub),
    "ch03": (ch03.check_block_pool, FAST, "ch03_block_pool", "MyBlockPool", StubPool),
    "ch04": (ch04.check_prefill_chunk, FAST, "ch04_prefill_chunk", "my_prefill_chunk", stub),
    "ch05": (ch05.check_top_p, {"draws": 8000}, "ch05_top_p", "my_top_p", stub),
    "ch06": (ch06.check_hash_block, {}, "ch06_hash_block", "my_hash_block", stub),
    "ch07": (ch07.check_verify_sampled, {"trials": 3000}, "ch07_verify_sampled",
             "my_verify_sampled", stub),
    "ch08": (ch08.check_block_and_slot, {}, "ch08_block_and_slot", "my_block_and_slot", stub),
    "ch09": (ch09.check_read_events, {}, "ch09_read_events", "my_read_events", stub),
    "ch10": (ch10.check_keep_token, {}, "ch10_keep_token", "my_keep_token", stub),
    "ch11": (ch11.check_preempt_victim, {}, "ch11_preempt_victim", "my_preempt_victim", stub),
    "ch12": (ch12.check_int8_quantize, {}, "ch12_int8_quantize", "my_quantize", stub),
    "ch13": (ch13.check_qkv_rows, {"max_ranks": 4}, "ch13_qkv_rows", "my_qkv_rows", stub),
    "ch14": (ch14.check_route, {"max_tokens": 4}, "ch14_route", "my_route", stub),
}
MISTAKES = [  # (exercise, planted mistake, words the verdict must contain)
    ("ch01", lifo_for_preempted, "goes back to the head"),
    ("ch02", no_rescale, "exp(m_old - m_new)"),
    ("ch03", FreesSharedBlocks, "stay out of the free queue"),
    ("ch03", NoDoubleFreeCheck, "did not raise RuntimeError"),
    ("ch04", ignores_budget, "should be 20"),
    ("ch05", top_p_in_sorted_order, "your filter kept tokens"),
    ("ch06", hash_without_parent, "depend on the parent"),
    ("ch07", resample_from_p, "normalise(max(0, p - q))"),
    ("ch08", logical_as_physical, "whose physical block is table[p // block_size]"),
    ("ch08", table_clamped, "the kernel read block"),
    ("ch09", no_buffer, "which may arrive in a later chunk"),
    ("ch09", decodes_each_chunk, "'é' is two bytes"),
    ("ch09", parses_done, "which is no JSON"),
    ("ch10", keeps_padded_ids, "padded embedding rows), your rule said True"),
    ("ch10", drops_special_always, "skip_special_tokens=False, your rule said False"),
    ("ch11", newest_running, "your rule picked 'd', the priority policy picks 'c'"),
    ("ch11", ignores_outranked_by, "your rule picked 'c', the priority policy picks None"),
    ("ch12", one_scale_per_tensor, "max|w| / 127 per row"),
    ("ch12", truncates, "round(w / scale)"),
    ("ch12", no_zero_row_guard, "tiny positive scale"),
    ("ch13", kv_heads_not_replicated, "replicated on tp_size / num_kv_heads ranks"),
    ("ch14", route_smallest, "Yours are the k *smallest*"),
    ("ch14", route_never_renormalises, "each token's k weights sum to 1; yours sum to"),
    ("ch14", route_softmax_over_the_k, "or took the softmax over the k chosen logits only"),
    ("ch14", route_logits_as_weights, "Those are the raw logits"),
    ("ch14", route_wrong_only_in_the_engine, "MoE layer 0 (9 tokens), token 0: with your routing"),
]


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_checker_passes_the_reference_solution(name):
    check, fast, module, attr, _ = EXERCISES[name]
    report = check(solution(module, attr), **fast)
    assert report.passed, str(report)
    assert "PASSED" in str(report)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_checker_reports_a_stub_as_not_attempted(name):
    check, fast, _, _, unwritten = EXERCISES[name]
    report = check(unwritten, **fast)
    assert report.status == "not attempted", str(report)
    assert "NotImplementedError" in report.message


@pytest.mark.parametrize("name, mistake, words", MISTAKES,
                         ids=[f"{n}-{m.__name__}" for n, m, _ in MISTAKES])
def test_checker_fails_a_planted_mistake_and_says_why(name, mistake, words):
    check, fast, *_ = EXERCISES[name]
    report = check(mistake, **fast)
    assert report.status == "failed", str(report)
    assert words in report.message, str(report)


def test_a_crash_in_the_learners_code_is_reported_not_raised():
    report = ch04.check_prefill_chunk(lambda num_remaining, budget, chunked: num_remaining / 0)
    assert report.status == "failed" and "ZeroDivisionError" in report.message


def test_engine_level_checks_name_the_step_the_block_and_the_requests():
    """A mistake only the engine finds (touch does not count the second reader of a prefix-cache
    hit): the step observer names the step, the block and the requests holding it."""
    class ForgetsToCount(BlockPool):
        def touch(self, block_id: int) -> None:
            if self.blocks[block_id].ref_cnt == 0:
                del self.free_queue[block_id]
            self.blocks[block_id].ref_cnt = 1

    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, hooks=EngineHooks(block_pool_cls=ForgetsToCount),
                                    block_size=2, num_kv_blocks=32, trace_steps=0))
    engine.add_step_observer(ch03.check_pool_invariants)
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("0", list(range(3, 10)), params)
    engine.step()
    engine.add_request("1", list(range(3, 10)), params)
    with pytest.raises(ExerciseFailure, match=r"after step 1, block \d+ has ref_cnt 1 but 2 "
                       r"request\(s\) hold it \('0', '1'\); in that step it was shared "
                       r"\(prefix-cache hit\) with request '1'"):
        engine.step()


@pytest.mark.parametrize("exercise, hooks, observer, words", [
    ("ch01", EngineHooks(enqueue=lifo_for_preempted), ch01.ArrivalOrder,
     "which arrived before it, was preempted"),
    ("ch04", EngineHooks(prefill_chunk=ignores_budget), lambda w: ch04.check_budget,
     "tokens, but the budget"),
])
def test_property_checks_find_a_workload_and_describe_it(exercise, hooks, observer, words):
    """Past the checks on the function alone, hypothesis finds a workload where the engine goes
    wrong, and the verdict says what happened and on which workload."""
    with pytest.raises(ExerciseFailure, match="the workload: .* blocks of") as failure:
        for_all_workloads(hooks, lambda w: run_workload(hooks, w, observer(w)), max_examples=30)
    assert words in str(failure.value), str(failure.value)
