"""Tensor parallelism (minivllm/distributed/): 2 ranks on CPU over gloo, checked against transformers in fp32.

Each LLM(tensor_parallel_size=2) spawns a worker process (seconds of start-up on a loaded 2-core machine), so
the tests are few, each checks several things on one engine, and one engine on the embedded model serves
several tests (module scope). After every test no worker process is left but that engine's.
"""

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import build_checkpoint, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.config import DEFAULT_MODEL
from minivllm.executor.workers import WorkerError
from minivllm.exercises.common import transformers_mismatch
from minivllm.sampling_params import StructuredOutputsParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 3, 40, 2], list(range(20, 60)), [7] * 30]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.workers.procs]


def assert_gone(pids: list[int]) -> None:
    """No worker process left: reaped by us (so not a zombie either) and not among our live children."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minivllm-tp")]


@pytest.fixture(scope="module")
def kept() -> set[int]:
    """Pids of the module's shared engine's workers: the only ones allowed to outlive a test."""
    return set()


def live_children() -> set[int]:
    """Our descendants still running, but multiprocessing's resource tracker (it lives as long as we do)."""
    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                alive.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_orphan_processes(kept):
    """After every test: no process it started (a worker, a torchrun) is alive but the shared engine's."""
    before = live_children()
    yield
    gc.collect()
    deadline = time.monotonic() + 10  # a killed process may take a moment to be reaped
    while True:
        left = live_children() - before - kept
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def embedded_tp2(kept):
    """The embedded model on 2 ranks, with n-gram drafts, prefix caching and few blocks (so preemption)."""
    llm = LLM(DEFAULT_MODEL, tensor_parallel_size=2, dtype="float32", block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    pids = worker_pids(llm)
    kept.update(pids)
    yield llm
    llm.shutdown()
    kept.difference_update(pids)
    assert_gone(pids)


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
    # a replicated KV head: both ranks' caches hold the same numbers (up to the last bits: each rank sizes its
    # own CPU threads to the load, and a matmul's summation order follows the thread count)
    sums = [torch.tensor(s["kv_block_sums"]) for s in llm.engine.runner.rank_states()]
    assert sums[0].abs().sum() > 0 and torch.allclose(sums[0], sums[1], rtol=1e-5, atol=1e-5)
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


def test_more_cuda_ranks_than_gpus_is_refused_at_start_up(checkpoints, monkeypatch):
    """Each CUDA rank takes its own GPU: too few is a ValueError naming both counts, not a worker's crash."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs .* it has 1"):
        LLM(str(checkpoints["llama"][0]), tensor_parallel_size=2, device="cuda")
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


def test_qwen3_tp2_equals_transformers_with_prefix_caching_chunks_and_preemption(checkpoints):
    path, hf = checkpoints["qwen3"]  # q/k norms, head_dim 24 (not hidden / heads)
    shared = list(range(30, 54))  # six blocks every prompt shares: the second round hits the prefix cache
    prompts = [shared + [5, 6, 7], shared + [8], shared + list(range(60, 75)), [9, 9, 3]]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    kwargs = dict(dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=12, max_num_seqs=4,
                  enable_prefix_caching=True)
    ref = LLM(str(path), **kwargs).generate(inputs, greedy, use_tqdm=False)
    with LLM(str(path), tensor_parallel_size=2, **kwargs) as llm:
        for _ in range(2):
            outs = llm.generate(inputs, greedy, use_tqdm=False)
            for prompt, out, want in zip(prompts, outs, ref):
                assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)
                for got, exp in zip(out.outputs[0].logprobs, want.outputs[0].logprobs):
                    assert all(abs(got[t].logprob - exp[t].logprob) < 1e-4 for t in got)
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


TP3 = dict(hidden_size=96, intermediate_size=144, num_attention_heads=6)  # vocab 251: padded to 3 x 84 rows


@pytest.mark.parametrize("kind, kv_heads", [("llama", 3), ("qwen2", 1), ("qwen3", 3)])
def test_three_ranks_equal_transformers(tmp_path, kind, kv_heads):
    """tp=3: 2 heads per rank; Qwen2's one KV head is replicated on all three ranks. Chunked prefill (16 tokens a
    step) and 16 blocks of 4 for 28 blocks' worth of requests: preemption."""
    hf = build_checkpoint(kind, tmp_path / kind, num_key_value_heads=kv_heads, **TP3)
    with LLM(str(tmp_path / kind), tensor_parallel_size=3, dtype="float32", block_size=4, num_kv_blocks=16,
             max_num_batched_tokens=16) as llm:
        assert len(worker_pids(llm)) == 2
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in PROMPTS]
        assert llm.engine.runner.kv_cache.shape[-2] == max(1, kv_heads // 3)
        assert llm.engine.stats()["num_preemptions"] > 0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}}


def test_structured_output_and_ngram_drafts_under_tp2(embedded_tp2):
    """Grammar masks and drafts are rank 0's scheduling decisions, broadcast with the step: the greedy text
    equals one rank's, the output parses, and the embedded model's tokens are transformers' choices."""
    one = LLM(DEFAULT_MODEL, dtype="float32", num_kv_blocks=48, block_size=4)
    prompts = ["Tom said:", "Once upon a time there was a dog. Once upon a time"]
    for spec in ({"json": SCHEMA}, {"regex": r"( [a-z]+){3}\."}, {"choice": ["yes", "no"]}):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**spec))
        outs = [o.outputs[0] for o in embedded_tp2.generate(prompts, params, use_tqdm=False)]
        assert [o.text for o in outs] == [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
        if "json" in spec:  # (what max_tokens cuts short is a valid start)
            assert all(o.finish_reason == "length" or set(json.loads(o.text)) == {"name", "age"} for o in outs)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = embedded_tp2.generate(prompts, plain, use_tqdm=False)
    assert transformers_mismatch([o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]) is None
    assert embedded_tp2.engine.stats()["spec_num_accepted"] > 0


def agree(llm: LLM) -> None:
    """Every rank knows the same sequences, with the same tokens and block tables, as rank 0."""
    states = llm.engine.runner.rank_states()
    assert all(s["sequences"] == states[0]["sequences"] for s in states[1:])
    assert {s["num_blocks"] for s in states} == {llm.engine.stats()["num_total_blocks"]}


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.lists(st.integers(3, 6), min_size=1, max_size=28), st.integers(1, 12),
                          st.sampled_from([0.0, 1.0])), min_size=1, max_size=5))
def test_property_ranks_agree_every_step_and_no_block_leaks(embedded_tp2, workload):
    """Random small workloads (a 4-token alphabet: shared prefixes; 48 blocks of 4: preemption), driven step by
    step: after each step every rank holds rank 0's sequences, tokens and block tables (the last step's finished
    ones are forgotten with the next step); at the end every block is free."""
    engine = embedded_tp2.engine
    for i, (prompt, max_tokens, temperature) in enumerate(workload):
        engine.add_request(f"w{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        agree(embedded_tp2)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_script_without_the_main_guard_is_told_the_fix(tmp_path):
    """A plain script that builds LLM(tensor_parallel_size=2) at its top level: the spawned worker re-runs
    it and dies at start; the error names the script and the missing guard in one line."""
    script = tmp_path / "unguarded.py"
    script.write_text("from minivllm import LLM\nLLM(tensor_parallel_size=2)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert f'{script} has no `if __name__ == "__main__":` guard' in run.stderr.splitlines()[-1]


def test_qwen2_sliding_window_tp2_equals_transformers(tmp_path):
    """Each rank attends its heads within each layer's window (Qwen2: layers from max_window_layers slide)."""
    hf = build_checkpoint("qwen2", tmp_path / "w", sliding_window=5, use_sliding_window=True, max_window_layers=1)
    prompts = [list(range(7, 40)), [100, 3], list(range(200, 250, 3))]
    with LLM(str(tmp_path / "w"), tensor_parallel_size=2, dtype="float32", block_size=4, num_kv_blocks=48,
             max_num_batched_tokens=9) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
