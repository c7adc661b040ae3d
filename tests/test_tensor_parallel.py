"""Tensor parallelism (minivllm/distributed/): 2 ranks on CPU over gloo, checked against transformers in fp32.

Each LLM(tensor_parallel_size=2) spawns a worker process (seconds of start-up on a loaded 2-core machine), so
the tests are few and each checks several things on one engine.
"""

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import build_checkpoint, hf_greedy

from minivllm import LLM, SamplingParams
from minivllm.distributed.workers import WorkerError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 3, 40, 2], list(range(20, 60)), [7] * 30]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.workers.procs]


def assert_gone(pids: list[int]) -> None:
    """No worker process left: reaped by us (so not a zombie either) and not among our live children."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minivllm-tp")]


def test_llama_tp2_equals_transformers_with_chunked_prefill_and_preemption(checkpoints):
    path, hf = checkpoints["llama"]  # vocab 251: the last rank's vocab shard is padded
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    kwargs = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
    one = LLM(str(path), **kwargs)
    ref_greedy, ref_seeded = (one.generate(inputs, sp, use_tqdm=False) for sp in (greedy, seeded))
    with LLM(str(path), tensor_parallel_size=2, **kwargs) as llm:
        pids = worker_pids(llm)
        assert len(pids) == 1
        outs = llm.generate(inputs, greedy, use_tqdm=False)
        assert llm.engine.stats()["num_preemptions"] > 0, "the workload should preempt"
        for prompt, out, ref in zip(PROMPTS, outs, ref_greedy):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
            for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
                assert got.keys() == want.keys()
                assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
        # every rank samples from the same gathered logits with the same seeded generators
        seeded_outs = llm.generate(inputs, seeded, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in seeded_outs] == [o.outputs[0].token_ids for o in ref_seeded]
    assert_gone(pids)


def test_qwen2_tp2_replicated_kv_heads_tied_embeddings_ngram_drafts_and_a_killed_worker(tmp_path):
    hf = build_checkpoint("qwen2", tmp_path / "q", num_key_value_heads=1)  # 1 KV head on 2 ranks: replicated
    llm = LLM(str(tmp_path / "q"), tensor_parallel_size=2, dtype="float32", num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # every rank drafts the same
    pids = worker_pids(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert llm.engine.stats()["spec_num_proposed"] > 0
    assert llm.engine.runner.kv_cache.shape[-2] == 1, "each rank caches its own (here: the one) KV head"
    llm.engine.check_health()
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    while time.monotonic() - start < 10 and not llm.engine.runner.workers.procs[0].exitcode:
        time.sleep(0.05)
    with pytest.raises(WorkerError, match="rank 1"):  # what the server's /health reports, even while idle
        llm.engine.check_health()
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerError):  # and it stays an error
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=4), use_tqdm=False)
    del llm
    gc.collect()
    assert_gone(pids)


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts(checkpoints):
    path, _ = checkpoints["llama"]  # 4 heads, 2 KV heads, intermediate 136
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads \(4\)"):
        LLM(str(path), tensor_parallel_size=3, dtype="float32")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(path), tensor_parallel_size=0)
    assert multiprocessing.active_children() == before


TORCHRUN_SCRIPT = """
import json, sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", num_kv_blocks=64)  # rank 1 never returns
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
print("RANK0", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.shutdown()
"""


def test_torchrun_env_rendezvous_on_localhost(checkpoints, tmp_path):
    """The multi-node path (README): torchrun starts every rank, the same script on each, env:// rendezvous."""
    path, hf = checkpoints["llama"]
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    prompts = PROMPTS[:2]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(path), json.dumps(prompts)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RANK0 "))
    assert json.loads(line.split(" ", 1)[1]) == [hf_greedy(hf, p, 6) for p in prompts]
