"""GGUF files of the families beyond Llama: Mixtral, Qwen3-MoE and Qwen2-MoE (llama.cpp stores each layer's experts
as one 3-D tensor per projection, the router as ffn_gate_inp) and Gemma 3 (norms stored with its +1 added).

Each test writes a random tiny checkpoint of the family as llama.cpp's converter would (quantize.write_gguf), loads
the file by path, and checks greedy tokens against transformers run on the same weights quantized and dequantized
by the gguf package, independently of the engine's loader."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.moe_layer import FusedExperts
from minivllm.quantization.gguf import write_gguf
from tests.conftest import EMBEDDED, hf_greedy
from tests.test_moe_families import E, build_moe_checkpoint

gguf = pytest.importorskip("gguf")

MAX_NEW = 12
PROMPTS = [[1, 17, 305, 9, 1200, 44], [1, 801, 3, 77]]
FILE = {"vocab_size": 1834, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # EMBEDDED's tokenizer
# whole blocks of 32 weights in every row: each matrix's inputs a multiple of 32
SIZES = {"mixtral": {"intermediate_size": 64},
         "qwen3_moe": {"intermediate_size": 128, "moe_intermediate_size": 64},
         "qwen2_moe": {"intermediate_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 32}}


def round_trip(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t quantized to GGML type `kind` and back, as the file holds it."""
    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(t.detach().float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).copy()).reshape(t.shape)


def as_the_file_holds_it(hf, mlp_type: str, attention_type: str, expert_type: str) -> None:
    """transformers' weights replaced by the file's dequantized ones: attention and MLP matrices in their types
    (write_gguf's rules), routers, norms, the embedding and the head float."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim < 2 or "layers." not in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                continue
            kind = expert_type if ".experts." in name else mlp_type if ".mlp." in name else attention_type
            p.copy_(round_trip(p, kind))


def greedy(path, platform, monkeypatch, **kwargs):
    monkeypatch.setenv("MINIVLLM_PLATFORM", platform)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("platform", ["reference", "cpu"])
@pytest.mark.parametrize("kind,expert_type", [("mixtral", "Q8_0"), ("mixtral", "Q4_0"), ("qwen3_moe", "Q8_0"),
                                              ("qwen3_moe", "Q4_0"), ("qwen2_moe", "Q8_0")])
def test_moe_gguf_file_equals_transformers_on_its_dequantized_weights(tmp_path, kind, expert_type, platform,
                                                                      monkeypatch):
    hf = build_moe_checkpoint(kind, tmp_path / "float", **FILE, **SIZES[kind])
    path = tmp_path / f"{kind}-{expert_type}.gguf"
    write_gguf(path, hf, EMBEDDED, mlp_type="Q8_0", attention_type="Q4_0", expert_type=expert_type)
    as_the_file_holds_it(hf, "Q8_0", "Q4_0", expert_type)
    tokens, llm = greedy(path, platform, monkeypatch)
    cfg = llm.engine.config.model_config
    assert (cfg.architecture, cfg.num_experts) == (hf.config.architectures[0], E)
    assert cfg.moe_layers == (None if kind == "mixtral" else {"qwen3_moe": (True, False, True),
                                                               "qwen2_moe": (False, True, False)}[kind])
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == sum(cfg.moe_layers or [True] * cfg.num_layers)
    for layer in experts:  # held once, stacked: no per-expert copies beside them
        assert layer.gate_up_proj.shape == (E, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert tokens == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_a_mixtral_gguf_is_read_as_mixtral_not_llama(tmp_path):
    """llama.cpp writes a Mixtral as architecture llama with expert_count: without it, a Llama."""
    hf = build_moe_checkpoint("mixtral", tmp_path / "float", **FILE, **SIZES["mixtral"])
    write_gguf(tmp_path / "m.gguf", hf, EMBEDDED)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert {t.name for t in reader.tensors} >= {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight"}
    from minivllm.model.loader import read_model_config

    cfg = read_model_config(tmp_path / "m.gguf")
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("mixtral", E, 2)
    assert cfg.moe_intermediate_size == SIZES["mixtral"]["intermediate_size"]


@pytest.mark.parametrize("platform", ["reference", "cpu"])
def test_gemma3_gguf_file_equals_transformers_on_its_dequantized_weights(tmp_path, platform, monkeypatch):
    """Gemma 3 as llama.cpp holds it: norms with +1 added, every 6th layer global, the local rope base and the
    query scale by llama.cpp's rules, the global base and its linear scaling and the window from the metadata."""
    from tests.test_gemma3 import ROPE, WINDOW, build_gemma3

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(7)]
    hf = build_gemma3(tmp_path / "float", num_hidden_layers=7, layer_types=layer_types, query_pre_attn_scalar=16,
                      intermediate_size=128, **FILE)
    write_gguf(tmp_path / "g.gguf", hf, EMBEDDED, mlp_type="Q8_0", attention_type="Q4_0")
    as_the_file_holds_it(hf, "Q8_0", "Q4_0", "Q8_0")
    tokens, llm = greedy(tmp_path / "g.gguf", platform, monkeypatch)
    cfg = llm.engine.config.model_config
    assert (cfg.architecture, cfg.sliding_window) == ("Gemma3ForCausalLM", WINDOW)
    assert cfg.hf_config.layer_types == layer_types and cfg.hf_config.rope_parameters == ROPE
    assert tokens == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("pattern,local", [(None, [True] * 5 + [False, True]), (3, [True, True, False] * 2 + [True]),
                                           ([True, False] * 3 + [True], [True, False] * 3 + [True])])
def test_gemma3_local_layers_follow_the_files_pattern_or_llama_cpps(tmp_path, pattern, local):
    """No pattern key: every 6th layer global (llama.cpp's rule for Gemma 3); a number: every n-th; one flag a
    layer (newer converters): as listed. The local base is 10000 unless the file gives rope.freq_base_swa."""
    from types import SimpleNamespace

    from minivllm.quantization.gguf import with_gemma3_rules

    writer = gguf.GGUFWriter(str(tmp_path / "h.gguf"), "gemma3")
    writer.add_rope_freq_base(5e5)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
        writer.add_rope_freq_base_swa(2e4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    hf = with_gemma3_rules(SimpleNamespace(num_hidden_layers=7, hidden_size=64, num_attention_heads=4, head_dim=16),
                           gguf.GGUFReader(tmp_path / "h.gguf"))
    assert hf.layer_types == ["sliding_attention" if each else "full_attention" for each in local]
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == (1e4 if pattern is None else 2e4)
    assert hf.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 5e5}
    assert hf.query_pre_attn_scalar == 16
