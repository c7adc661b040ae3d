"""Exercises the engine grades: the learner writes a real piece of the engine, plugs it in with
`EngineHooks` (minivllm.hooks), and a checker runs the engine's own correctness checks against it.

One module per chapter, each with its checker(s): ch01.check_enqueue,
ch02.check_online_softmax_update, ch03.check_block_pool, ch04.check_prefill_chunk, ch05.check_top_p,
ch06.check_hash_block, ch07.check_verify_sampled, ch08.check_block_and_slot,
ch09.check_read_events, ch10.check_keep_token, ch11.check_preempt_victim, ch12.check_int8_quantize,
ch13.check_qkv_rows, ch14.check_route. A checker returns a Report: "passed", "failed" (with what
went wrong, in plain words) or "not attempted" (the stub still raises NotImplementedError).
Reference solutions: chapters/solutions/.
"""

from minivllm.exercises.report import ExerciseFailure, Report

__all__ = ["ExerciseFailure", "Report"]
