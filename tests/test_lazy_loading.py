"""Lazy loading: the decoder layers are read when a step first runs them, and the tokens are those of
the eagerly loaded engine (and of transformers)."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import build_checkpoint, hf_greedy

PROMPTS = [[(3 * i + j) % 200 + 1 for j in range(9 + i)] for i in range(3)]


def layers_on_meta(llm: LLM) -> list[bool]:
    return [all(p.is_meta for p in layer.parameters()) for layer in llm.engine.runner.model.model.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_lazy_engine_gives_the_eager_tokens(checkpoints, kind):
    path, hf = checkpoints[kind]
    lazy = LLM(path, lazy_loading=True, num_kv_blocks=64, block_size=4)
    assert all(layers_on_meta(lazy)), "nothing but embeddings and the head is read at start"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in lazy.generate(PROMPTS, params, use_tqdm=False)]
    assert not any(layers_on_meta(lazy)), "the first step loaded every layer"
    assert all(not layer._forward_pre_hooks for layer in lazy.engine.runner.model.model.layers)
    assert tokens == [hf_greedy(hf, p, 6) for p in PROMPTS]
    eager = LLM(path, num_kv_blocks=64, block_size=4)
    assert tokens == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    held = {n: p for n, p in lazy.engine.runner.model.named_parameters()}
    for name, p in eager.engine.runner.model.named_parameters():
        assert torch.equal(p, held[name]), name


def test_lazy_loading_with_int8_and_a_missing_layer_tensor(tmp_path, checkpoints):
    """Quantized at load, layer by layer; a checkpoint missing a layer's tensor fails on first use,
    naming it."""
    path, hf = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = [LLM(path, lazy_loading=lazy, quantization="int8", num_kv_blocks=64).generate(PROMPTS, params,
                                                                                         use_tqdm=False)
            for lazy in (False, True)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    build_checkpoint("llama", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(broken, lazy_loading=True, num_kv_blocks=64)  # starts: layer 1 is not read yet
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
