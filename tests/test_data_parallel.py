"""data_parallel_size=N: N engines over one mapped copy of the weights (engine/data_parallel.py)."""

import os
import signal
import time

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.engine.data_parallel import DataParallelError, deal
from minivllm.engine.llm_engine import LLMEngine
from minivllm.hooks import EngineHooks

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [4, 5], [11, 12, 13, 14, 15], [20, 21, 22]]  # odd: uneven shares


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_WEIGHT_CACHE_DIR", str(tmp_path))  # spawned engines inherit it
    return tmp_path


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_deal_is_round_robin():
    assert deal(5, 2) == [[0, 2, 4], [1, 3]] and deal(1, 3) == [[0], [], []]


def test_dp2_equals_dp1_and_reuses_the_cache(llama_path, cache_dir):
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=32) as llm:
        want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not list(cache_dir.glob("*.weights"))  # one engine: no cache
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=32, data_parallel_size=2) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in got] == PROMPTS  # input order
        assert _tokens(got) == _tokens(want)
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == _tokens(want)[:1]
        pids = [p.pid for p in llm._data_parallel.processes.procs]
    files = list(cache_dir.glob("*.weights"))
    assert len(files) == 1  # written once, by whichever engine came first
    mtime = files[0].stat().st_mtime_ns
    assert not any(_alive(pid) for pid in pids)  # none outlives shutdown
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=32, data_parallel_size=2) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(want)
    assert list(cache_dir.glob("*.weights")) == files and files[0].stat().st_mtime_ns == mtime


def test_killed_engine_fails_generate_within_seconds(llama_path, cache_dir):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=64, data_parallel_size=2) as llm:
        pid, steps = llm._data_parallel.processes.procs[0].pid, []

        def kill_engine_1_mid_generate(engine, record) -> None:  # engine 0's third step: both busy
            steps.append(record)
            if len(steps) == 3:
                os.kill(pid, signal.SIGKILL)

        llm.engine.add_step_observer(kill_engine_1_mid_generate)
        start = time.perf_counter()
        with pytest.raises(DataParallelError, match=r"engine 1 .*SIGKILL"):
            llm.generate([[1, 2, 3]] * 8, long, use_tqdm=False)
        assert time.perf_counter() - start < 15
        with pytest.raises(DataParallelError):  # the LLM stays stopped, it does not hang
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_engine_error_carries_its_traceback(llama_path, cache_dir):
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=32, data_parallel_size=2) as llm:
        pid = llm._data_parallel.processes.procs[0].pid
        llm._data_parallel.processes.send(1, "not a batch")  # the engine's run() raises TypeError
        with pytest.raises(DataParallelError, match=r"(?s)engine 1 raised:.*Traceback.*TypeError"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not _alive(pid)


def test_a_refused_prompt_is_a_value_error_and_the_engines_go_on(llama_path, cache_dir):
    with LLM(str(llama_path), dtype="float32", num_kv_blocks=32, data_parallel_size=2,
             max_model_len=64) as llm:
        with pytest.raises(ValueError):
            llm.generate([[1, 2], list(range(1, 100))], GREEDY, use_tqdm=False)  # engine 1's is too long
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)
        # as a Ctrl-C leaves it: engine 1 still owes a batch; the next call drops it, then deals its own
        dp = llm._data_parallel
        dp.processes.send(1, (["stale"], [[5, 6]], [GREEDY], [0]))
        dp._owed.add(1)
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == PROMPTS[:2] and not dp._owed


def test_refusals(llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model=str(llama_path), data_parallel_size=2, tensor_parallel_size=2,
                   device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="hooks"):
        EngineArgs(model=str(llama_path), data_parallel_size=2,
                   hooks=EngineHooks(top_p=lambda *a: None)).create_engine_config()
    with pytest.raises(ValueError, match="positive"):
        EngineArgs(model=str(llama_path), data_parallel_size=0).create_engine_config()
    config = EngineArgs(model=str(llama_path), data_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="minivllm serve"):  # an LLMEngine is one engine
        LLMEngine(config)


def test_cli_flag():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["-dp", "2"])).data_parallel_size == 2
    assert EngineArgs.from_cli_args(parser.parse_args(["--data-parallel-size", "3"])).data_parallel_size == 3
