"""One argument table (EngineArgs) behind LLM(**kwargs), the CLI and the server, with vLLM's names
and paths."""

import argparse
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields

import httpx
import pytest

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.__main__ import main
from minivllm.config import DEFAULT_MODEL as EMBEDDED
from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from minivllm.entrypoints.openai.cli_args import make_arg_parser
from minivllm.utils import FlexibleArgumentParser


def test_every_engine_config_knob_is_in_the_table_with_its_default():
    args = {f.name: f for f in fields(EngineArgs)}
    for f in fields(EngineConfig):
        if f.name in ("model_config", "hooks"):
            continue
        assert f.name in args, f"EngineConfig.{f.name} has no EngineArgs field (so no flag, no LLM() keyword)"
        assert args[f.name].default == f.default, f"{f.name}: EngineArgs default {args[f.name].default!r}"


def test_flags_parse_back_into_the_same_engine_config():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(EMBEDDED), "--max_num_seqs", "8", "--dtype", "float",
                              "--no-enable-prefix-caching", "--max-model-len", "1k", "-tp", "1",
                              "--trust-remote-code", "--max-num-batched-tokens", "2K",
                              "--kv-cache-dtype", "auto", "--seed", "7", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.max_num_seqs, config.dtype, config.enable_prefix_caching) == (8, "float", False)
    assert (config.max_model_len, config.max_num_batched_tokens, config.seed) == (1000, 2048, 7)
    assert (config.speculative_model, config.num_speculative_tokens) == ("[ngram]", 3)
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert defaults == EngineArgs(), "a flag's default differs from the field's"


def test_vars_of_parsed_args_go_straight_into_llm():
    """vLLM's basic example: add the engine flags, add sampling flags, pop those,
    LLM(**vars(args))."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("--max-tokens", type=int, default=4)
    args = vars(parser.parse_args(["--num-kv-blocks", "32", "--max-model-len", "128"]))
    max_tokens = args.pop("max_tokens")
    llm = LLM(**args)
    assert llm.engine.config.max_model_len == 128 and llm.engine.kv.pool.num_blocks == 32
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_llm_engine_from_engine_args_runs_the_step_loop():
    """vLLM's llm_engine_example: EngineArgs from the command line, then add_request / step by
    hand."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(description="engine loop"))
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(["--num-kv-blocks", "64"])))
    pending = [("To be or not", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
               ("Once upon", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3,
                                            ignore_eos=True, seed=1))]
    finished, next_id = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(str(next_id), *pending.pop(0))
            next_id += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"0": 5, "1": 3}
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(EngineArgs(), stat_loggers={"x": object()})


def test_async_engine_args_add_their_own_flags():
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--enable-log-requests",
                                                            "--max-num-seqs", "4"]))
    assert isinstance(args, AsyncEngineArgs) and args.enable_log_requests and args.max_num_seqs == 4


def test_unsupported_values_and_flags_are_named():
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        LLM(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8_e4m3fnuz").create_engine_config()
    with pytest.raises(ValueError, match="'lora_modules'"):
        EngineArgs(lora_modules=["a=b"])
    with pytest.raises(ValueError, match="max_num_seqs must be int"):
        EngineArgs(max_num_seqs="8")
    for bad in ([], {"x": 1}):  # once a bare TypeError (unhashable type)
        with pytest.raises(ValueError, match="hf_overrides"):
            LLM(hf_overrides={"rope": bad})
    assert EngineArgs(hf_overrides={}, mm_processor_kwargs={},
                      trust_remote_code=True).create_engine_config()


def test_cli_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(EMBEDDED), "--enable-eplb", "--lora-modules", "x=y"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--enable-eplb" in err and "--lora-modules" in err
    # refused before the model loads
    assert main(["serve", str(EMBEDDED), "--pipeline-parallel-size", "2"]) == 2
    assert "pipeline_parallel_size=2" in capsys.readouterr().err
    # fp8 KV works; computing its scales does not
    assert main(["generate", "Hi", "--calculate-kv-scales"]) == 2
    assert "calculate_kv_scales=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "a-model", "--model", "another-model"])
    assert "two models" in capsys.readouterr().err


def test_server_flags_are_the_engine_table_plus_the_front_end():
    parser = make_arg_parser(FlexibleArgumentParser())
    engine = {f.name for f in fields(AsyncEngineArgs)}
    front_end = {"help", "host", "port", "api_key", "chat_template", "allowed_origins", "log_level",
                 "log_format",
                 "shutdown_timeout", "max_request_bytes", "max_n", "max_tokens_times_n"}
    dests = {a.dest for a in parser._actions}
    assert dests - engine == front_end
    args = parser.parse_args(["--allowed-origins", '["http://a", "http://b"]', "--max-num-seqs",
                              "3"])
    assert args.allowed_origins == ["http://a", "http://b"] and args.max_num_seqs == 3
    assert (parser.parse_args(["--allowed-origins",
                               "http://a,http://b"]).allowed_origins == ["http://a", "http://b"])


def test_served_model_name_is_the_model_as_given():
    rel = "minivllm/data/models/minivllm-tiny"
    assert EngineConfig(model=str(EMBEDDED)).resolve().served_model_name == str(EMBEDDED)
    assert EngineConfig(model=EMBEDDED.parents[3] / rel).resolve().served_model_name.endswith(rel)
    # the embedded default, unnamed
    assert EngineConfig().resolve().served_model_name == "minivllm-tiny"
    assert EngineConfig(model=str(EMBEDDED),
                        served_model_name="mine").resolve().served_model_name == "mine"
    assert EngineArgs(served_model_name=["mine"]).served_model_name == "mine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_api_server_module_with_vllm_flags(tmp_path):
    """The material's server command: vLLM's module path and flags; a client naming the model as
    given."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor "
                        "%}[assistant]")
    port, model = _free_port(), str(EMBEDDED)
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.entrypoints.openai.api_server", "--model", model, "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.5",
         "--tensor-parallel-size", "1", "--enable-prefix-caching", "--seed", "0", "--chat-template",
         str(template), "--trust-remote-code",
         "--enforce-eager", "--swap-space", "1", "--max-num-seqs", "8", "--num-kv-blocks", "64",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, port)
        url = f"http://127.0.0.1:{port}/v1"
        assert [m["id"] for m in httpx.get(url + "/models").json()["data"]] == [model]
        r = httpx.post(url + "/completions", json={"model": model, "prompt": "Hello",
                                                   "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        messages = [{"role": "user", "content": "Hi there"}]
        r = httpx.post(url + "/chat/completions", json={"model": model, "messages": messages,
                                                        "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        from transformers import AutoTokenizer

        rendered = "[user] Hi there\n[assistant]"  # what --chat-template makes of the conversation
        expected = (len(AutoTokenizer.from_pretrained(model)(rendered,
                                                             add_special_tokens=False).input_ids))
        assert r.json()["usage"]["prompt_tokens"] == expected
    finally:
        _stop(proc)


def test_serve_with_positional_model_and_served_model_name():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", str(EMBEDDED), "--port",
                             str(port), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, port)
        assert ([m["id"]
                 for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]] == ["tiny"])
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": str(EMBEDDED), "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 404, "with --served-model-name only that name is served"
    finally:
        _stop(proc)


def test_human_readable_ints_and_json_flags_fail_clearly():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="no decimals"):
        parser.parse_args(["--max-model-len", "1.5K"])
    with pytest.raises(argparse.ArgumentError, match="not valid JSON"):
        parser.parse_args(["--speculative-config", "{model: x}"])
