"""Blocks leave with the window: a long request on a model whose every layer slides holds about
window / block_size blocks, where full attention holds its whole context (issue 38's measurement)."""

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams

PROMPT, OUTPUT, BLOCK, WINDOW, CHUNK = 4000, 96, 16, 256, 256


def most_blocks_held(path, num_kv_blocks: int = 300, engine_out: list | None = None) -> tuple[int, int]:
    """(the most blocks in use after any step, blocks freed as the window passed) for one 4k-token request."""
    engine = LLMEngine(EngineConfig(path, block_size=BLOCK, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=CHUNK,
                                    enable_prefix_caching=False))
    if engine_out is not None:
        engine_out.append(engine)
    held, frees = [], []

    def observe(eng, record):  # the step's record carries its block events: what the trace draws
        held.append(eng.kv.pool.num_blocks - eng.kv.num_free_blocks)
        frees.extend(e for e in record.kv_events if e.kind == "free" and eng.has_unfinished_requests())

    engine.add_step_observer(observe)
    engine.add_request("long", list(range(3, 3 + PROMPT)), SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    return max(held), len(frees)


@pytest.fixture(scope="module")
def mistrals(tmp_path_factory):
    import torch
    import transformers as tf

    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("window_blocks")
    torch.manual_seed(0)
    cfg = {**TINY, "vocab_size": 4200, "max_position_embeddings": PROMPT + OUTPUT}
    windowed = tf.MistralForCausalLM(tf.MistralConfig(**cfg, sliding_window=WINDOW))
    windowed.save_pretrained(root / "windowed")
    full = tf.MistralForCausalLM(tf.MistralConfig(**cfg, sliding_window=None))
    full.load_state_dict(windowed.state_dict())
    full.save_pretrained(root / "full")
    return root


def test_a_long_request_holds_about_a_window_of_blocks(mistrals):
    windowed, freed = most_blocks_held(mistrals / "windowed")
    full, freed_early = most_blocks_held(mistrals / "full")
    print(f"\n4096-token request, block_size {BLOCK}, window {WINDOW}, chunks of {CHUNK}: "
          f"full attention holds {full} blocks, the windowed model at most {windowed} ({freed} freed as it slid)")
    assert freed_early == 0 and freed > 0
    assert full == (PROMPT + OUTPUT) // BLOCK
    # the window's blocks, the step's chunk, and the partly passed block at each end
    assert windowed <= (WINDOW + CHUNK) // BLOCK + 2


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory):
    """One tiny Gemma 3's weights three ways: 3 local + 1 global layers (the hybrid), every layer local, every
    layer global."""
    import torch
    import transformers as tf

    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("gemma_blocks")
    torch.manual_seed(0)
    cfg = {**TINY, "vocab_size": 4200, "max_position_embeddings": PROMPT + OUTPUT, "head_dim": 16,
           "num_hidden_layers": 4, "sliding_window": WINDOW}
    kinds = {"hybrid": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
             "local": ["sliding_attention"] * 4, "global": ["full_attention"] * 4}
    first = None
    for name, types in kinds.items():
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**cfg, layer_types=types))
        if first is None:
            first = model.state_dict()
        model.load_state_dict(first)
        model.save_pretrained(root / name)
    return root


def test_gemma3_blocks_per_attention_kind(gemmas):
    """A hybrid's sliding layers hold about a window, its global layer the whole context: each group of layers has
    its own table (core/kv_groups.py), and a block holds one group's layers, so KV bytes are what to compare."""
    held, nbytes = {}, {}
    for name in ("hybrid", "local", "global"):
        engines = []
        held[name] = most_blocks_held(gemmas / name, 300 * (4 if name == "hybrid" else 1), engines)
        nbytes[name] = held[name][0] * engines[0].runner.bytes_per_block
        groups = engines[0].kv.groups
        assert groups.num_groups == (4 if name == "hybrid" else 1)
    print(f"\nGemma 3, 4096-token request, block_size {BLOCK}, window {WINDOW}: most KV bytes held (blocks, freed as "
          "it slid): " + ", ".join(f"{name} {nbytes[name] / 2**20:.2f} MiB ({most}, {freed})"
                                   for name, (most, freed) in held.items()))
    full = (PROMPT + OUTPUT) // BLOCK
    assert held["global"] == (full, 0)
    assert held["local"][1] > 0 and held["local"][0] <= (WINDOW + CHUNK) // BLOCK + 2
    # the global layer's group holds every block, each of the three local groups about a window's
    assert held["hybrid"][1] > 0 and held["hybrid"][0] <= full + 3 * ((WINDOW + CHUNK) // BLOCK + 2)
    assert nbytes["hybrid"] < 0.45 * nbytes["global"]
