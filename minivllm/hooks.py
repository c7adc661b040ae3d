"""EngineHooks: the pieces of the engine a learner may replace with their own, as `LLM(hooks=...)`.

The chapters' exercises (minivllm.exercises) have the learner write a real piece of the engine and
run the engine's own correctness checks against it. They plug it in here, never by patching modules:
each field is read once, where the engine builds its part; None (the default): the engine's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineHooks:
    # core/scheduling_policy.py, `SchedulingPolicy.enqueue`: a new or preempted request -> the queue
    enqueue: Callable[[Any, Any, bool], None] | None = None
    # core/scheduler.py, `prefill_chunk`: how many of a waiting request's tokens fit the budget left
    prefill_chunk: Callable[[int, int, bool], int] | None = None
    # core/scheduling_policy.py, `OutputLengthEstimator`: a sequence -> how many output tokens it
    # will have in all, the prediction behind scheduling_policy="sjf"
    predict_output_tokens: Callable[[Any], int] | None = None
    # core/scheduling_policy.py, `SchedulingPolicy.victim`: the running sequences and a waiting one
    # (or None) -> whom to preempt for blocks (None: nobody), in place of the policy's own choice
    preempt_victim: Callable[[list, Any], Any] | None = None
    # core/block_pool.py, `BlockPool`: the GPU block pool's class (allocate / free, ref counts)
    block_pool_cls: type | None = None
    # core/block_hash.py, `hash_block`: the name of a full block, chained to its parent's
    hash_block: Callable[[bytes | None, Any], bytes] | None = None
    # sampling/sampler.py, `apply_top_p`: logits [B, V], top_p [B] -> logits, the tail set to -inf
    top_p: Callable[[Any, Any], Any] | None = None
    # attention/online_softmax.py, `online_softmax_update`: one block's step of decode attention
    online_softmax_update: Callable[..., Any] | None = None
    # sampling/rejection_sampler.py, `verify_sampled`: which drafted tokens a sampling request keeps
    verify_sampled: Callable[..., list[int]] | None = None
    # tokenizer.py, `keep_token`: (token string, or None for an id past the tokenizer's vocabulary;
    # whether it is special; skip_special_tokens) -> whether it goes into the text
    keep_token: Callable[[Any, bool, bool], bool] | None = None
    # quantization/int8.py, `quantize_per_channel`: W [N, K] float -> (q [N, K] int8, scale [N]),
    # used by quantization="int8" as each linear layer loads
    int8_quantize: Callable[[Any], tuple[Any, Any]] | None = None
