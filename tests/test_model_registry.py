"""A model family is one module under minivllm/model/, found by the checkpoint's `architectures`."""

import json

import pytest

from minivllm.model.loader import read_model_config
from minivllm.model.registry import ARCHITECTURES, architecture_of, model_class


def test_each_family_reads_its_own_options(checkpoints):
    """The loader asks the family module what its layers read: Qwen2's q/k/v bias, Qwen3's q/k norm."""
    seen = {kind: read_model_config(path) for kind, (path, _) in checkpoints.items()}
    assert {kind: cfg.architecture for kind, cfg in seen.items()} == {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert [(seen[k].qkv_bias, seen[k].qk_norm) for k in ("llama", "qwen2", "qwen3")] == [
        (False, False), (True, False), (False, True)]
    for name in ARCHITECTURES:
        assert model_class(name).__name__ == name


def test_qwen_window_follows_use_sliding_window(tmp_path):
    """Qwen configs carry a sliding_window that only use_sliding_window turns on; Mistral's is on as given."""
    import transformers as tf

    from tests.conftest import TINY

    for name, config, expected in [
        ("qwen_off", tf.Qwen2Config(**TINY, sliding_window=8, use_sliding_window=False), None),
        ("qwen_on", tf.Qwen2Config(**TINY, sliding_window=8, use_sliding_window=True), 8),
        ("mistral", tf.MistralConfig(**TINY, sliding_window=8), 8),
    ]:
        assert model_class(architecture_of(config)).layer_options(config)["sliding_window"] == expected, name


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["FancyForCausalLM"]}))
    with pytest.raises(ValueError, match="FancyForCausalLM is not supported") as error:
        read_model_config(tmp_path)
    assert all(name in str(error.value) for name in ARCHITECTURES)


def test_a_config_without_architectures_is_read_by_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": 32, "hidden_size": 8,
                                                      "num_attention_heads": 2, "sliding_window": 16}))
    cfg = read_model_config(tmp_path)
    assert (cfg.architecture, cfg.sliding_window) == ("MistralForCausalLM", 16)
