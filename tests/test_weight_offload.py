"""cpu_offload_gb (vLLM's): on a CPU it does nothing and says so; the streaming mechanism itself (host
copies in before a layer's forward, out after) gives the same tokens."""

import gc
import logging

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.runner.weight_offload import StreamedLayer

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(10 + i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_cpu_offload_is_a_no_op_that_says_so_on_a_cpu(llama_path, caplog):
    plain = tokens(LLM(llama_path, device="cpu", num_kv_blocks=64))
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(llama_path, device="cpu", num_kv_blocks=64, cpu_offload_gb=2)
    assert "does nothing on cpu" in caplog.text
    assert tokens(llm) == plain
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        EngineConfig(llama_path, cpu_offload_gb=-1)


def test_streamed_layers_give_the_same_tokens_and_hand_the_memory_back(llama_path):
    llm = LLM(llama_path, device="cpu", num_kv_blocks=64)
    plain = tokens(llm)
    layers = list(llm.engine.runner.model.model.layers)
    streamed = [StreamedLayer(layer, torch.device("cpu")) for layer in layers]
    seen = []
    layers[0].register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).data_ptr()))
    assert tokens(llm) == plain
    for stream in streamed:  # between forwards each tensor is its host copy
        assert all(t.data_ptr() == host.data_ptr() for t, host in stream.pairs)
    assert seen and all(ptr != streamed[0].pairs[0][1].data_ptr() for ptr in seen), "copied in"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cpu_offload_gb streams weights onto a GPU")
def test_cpu_offload_on_a_gpu_gives_the_same_tokens_and_frees_gpu_memory(llama_path):
    """Run by `make gpu-check`: the offloaded layers' weights leave the GPU, the tokens do not change."""
    plain = LLM(llama_path, device="cuda", dtype="float32", num_kv_blocks=64)
    expected, held = tokens(plain), torch.cuda.memory_allocated()
    plain.shutdown()
    del plain
    gc.collect()
    offloaded = LLM(llama_path, device="cuda", dtype="float32", num_kv_blocks=64, cpu_offload_gb=1)
    assert offloaded.engine.runner.graphs is None, "streamed layers run eagerly"
    assert torch.cuda.memory_allocated() < held
    assert tokens(offloaded) == expected
