"""vLLM's v1 logits-processor interface: `LLM(logits_processors=[cls])` with per-request
`extra_args`, used the way vLLM's examples/offline_inference/logits_processor/ scripts use it, plus
the row bookkeeping underneath."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, VllmConfig
from minivllm.sampling.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from minivllm.sampling.persistent_batch import PersistentBatch

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time",
           "The future of AI is"]


class OnlyToken(LogitsProcessor):
    """Requests with extra_args={"only": t} can say nothing but t (a batch-level processor, sparse
    state)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.only: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.only, batch_update,
                             lambda params, _, __: (params.extra_args or {}).get("only"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.only.items():
            keep = logits[row, token].item()
            logits[row] = float("-inf")
            logits[row, token] = keep
        return logits


class NoRepeat(AdapterLogitsProcessor):
    """A per-request function wrapped for the batch: bans the token said last (3-argument form: sees
    the prompt)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban_last(prompt_ids: list[int], output_ids: list[int],
                     row: torch.Tensor) -> torch.Tensor:
            row[(output_ids or prompt_ids)[-1]] = float("-inf")
            return row

        return ban_last

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get("no_repeat")
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"no_repeat must be a bool, got {value!r}")


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain():
    return LLM(num_kv_blocks=64)


def test_batch_processor_changes_only_the_requests_that_ask(plain):
    """vLLM's custom.py pattern: half the batch names a target token and says only that; the rest is
    untouched."""
    llm = LLM(num_kv_blocks=64, logits_processors=[OnlyToken])
    target = plain.get_tokenizer().encode(" also", add_special_tokens=False)[0]
    params = [greedy(extra_args={"only": target}), greedy(), greedy(6, extra_args={"only": 67}),
              greedy(5)]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == [target] * 8
    assert got[2].outputs[0].token_ids == [67] * 6
    assert ref[0].outputs[0].token_ids != [target] * 8, "the plain engine ignores extra_args"
    for i in (1, 3):
        assert got[i].outputs[0].token_ids == ref[i].outputs[0].token_ids


def test_adapter_wraps_a_per_request_function(plain):
    """vLLM's custom_req.py pattern, given as a "module:Class" name; the function sees prompt and
    live outputs."""
    llm = LLM(num_kv_blocks=64, logits_processors=[f"{__name__}:NoRepeat"])
    params = [greedy(12, extra_args={"no_repeat": True}), greedy(12)]
    prompts = ["the the the the", "the the the the"]
    got = llm.generate(prompts, params, use_tqdm=False)
    toks = got[0].outputs[0].token_ids
    prompt_last = llm.get_tokenizer().encode(prompts[0])[-1]
    assert toks[0] != prompt_last and all(a != b for a, b in zip(toks, toks[1:]))
    assert got[1].outputs[0].token_ids == plain.generate(prompts[1], greedy(12),
                                                         use_tqdm=False)[0].outputs[0].token_ids


def test_rows_follow_requests_through_arrivals_finishes_and_chunked_prefill():
    """Mixed lengths finish at different steps and long prompts prefill in chunks, so rows are
    removed, added and moved; each request must still get exactly its own treatment."""
    llm = LLM(num_kv_blocks=96, max_num_batched_tokens=24, logits_processors=[OnlyToken])
    prompts = [f"Prompt number {i} " + "word " * (3 * i) for i in range(8)]
    params = [greedy(2 + 3 * (i % 4), extra_args={"only": 100 + i} if i % 2 else None)
              for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(num_kv_blocks=96, max_num_batched_tokens=24).generate(prompts, params, use_tqdm=False)
    assert (llm.engine.stats()["num_steps"] > max(p.max_tokens
                                                  for p in params)), "prefills took several steps"
    for i, (out, plain_out) in enumerate(zip(outs, ref)):
        toks = out.outputs[0].token_ids
        assert len(toks) == 2 + 3 * (i % 4)
        assert toks == ([100 + i] * len(toks) if i % 2 else plain_out.outputs[0].token_ids)


def test_persistent_batch_keeps_rows_consistent_under_permutations():
    """Drive PersistentBatch directly: every step the processor's per-row tag must match that row's
    logits."""
    seen = []

    class Tagger(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.tags: dict[int, int] = {}

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            if batch_update is not None:
                assert (not set(batch_update.removed) & {a[0]
                                                         for a in batch_update.added}), "a reused row is not removed"
            process_dict_updates(self.tags, batch_update, lambda p, _, __: p.extra_args["tag"])

        def apply(self, logits):
            assert set(self.tags) == set(range(len(logits)))
            for row, tag in self.tags.items():
                assert logits[row, 0].item() == tag
                logits[row, 1] = tag * 10
            seen.append(len(logits))
            return logits

    batch = PersistentBatch(EngineConfig(), torch.device("cpu"), [Tagger])
    live = {}
    gen = torch.Generator().manual_seed(0)
    active: list[str] = []
    for step in range(40):
        for rid in list(active):  # some leave
            if torch.rand(1, generator=gen).item() < 0.25:
                active.remove(rid)
                batch.remove_request(rid)
        for k in range(int(torch.randint(0, 3, (1,), generator=gen))):  # some arrive
            rid = f"r{step}.{k}"
            live[rid] = [1, 2, 3]
            batch.add_request(rid, SamplingParams(extra_args={"tag": len(live)}), live[rid], 3)
            active.append(rid)
        # some skip (prefill chunks)
        sampling = [r for r in active if torch.rand(1, generator=gen).item() < 0.8]
        # any order
        sampling = [sampling[i] for i in torch.randperm(len(sampling), generator=gen).tolist()]
        if not sampling:
            continue
        logits = torch.zeros(len(sampling), 4)
        logits[:, 0] = torch.tensor([float(batch.entries[r].params.extra_args["tag"])
                                     for r in sampling])
        out = batch.apply(sampling, logits)
        assert torch.equal(out[:, 1], logits[:, 0] * 10), "rows come back in the caller's order"
        assert (torch.equal(logits[:, 1],
                            torch.zeros(len(sampling)))), "the caller's tensor is not touched"
        for r in sampling:
            live[r].append(7)
    assert len(seen) > 20 and max(seen) >= 4


def test_output_lists_are_live_references():
    captured = {}

    class Capture(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            for index, _params, prompt, output in (batch_update.added if batch_update else []):
                captured[index] = (prompt, output)

        def apply(self, logits):
            return logits

    llm = LLM(num_kv_blocks=64, logits_processors=[Capture])
    out = llm.generate("Hello there", SamplingParams(temperature=1.0, seed=1, max_tokens=5,
                                                     ignore_eos=True),
                       use_tqdm=False)[0]
    prompt, output = captured[0]
    assert prompt == out.prompt_token_ids
    assert output == out.outputs[0].token_ids[:-1], "the list grew as tokens came (the last is sampled after)"


def test_builder_and_dict_updates_follow_vllm_semantics():
    b = BatchUpdateBuilder()
    assert b.get_and_reset(0) is None
    for i in (3, 1, 2):
        b.removed_append(i)
    assert b.pop_removed() == 1 and b.peek_removed() == 2
    with pytest.raises(RuntimeError):
        b.removed_append(0)
    p = SamplingParams()
    b.added.append((1, p, [1], []))
    b.moved.append((4, 3, MoveDirectionality.UNIDIRECTIONAL))
    update = b.get_and_reset(4)
    assert update.removed == [3, 2] and update.batch_size == 4
    state = {2: "x", 3: "y", 4: "z", 0: "w"}
    update = BatchUpdate(4, [2], [(1, p, None, [])], [(4, 3, MoveDirectionality.UNIDIRECTIONAL),
                                                      (0, 1, MoveDirectionality.SWAP)])
    assert process_dict_updates(state, update, lambda *_: "new")
    assert state == {0: "new", 1: "w", 3: "z"}


def test_bad_processors_and_bad_extra_args_are_value_errors():
    with pytest.raises(ValueError, match="not a subclass of LogitsProcessor"):
        LLM(num_kv_blocks=32, logits_processors=[lambda logits: logits])
    with pytest.raises(ValueError, match="cannot load"):
        LLM(num_kv_blocks=32, logits_processors=["no_such_module:Thing"])
    with pytest.raises(ValueError, match="speculative"):
        LLM(num_kv_blocks=32, logits_processors=[OnlyToken], speculative_model="[ngram]",
            num_speculative_tokens=2)
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=["only", 3])
    llm = LLM(num_kv_blocks=32, logits_processors=[NoRepeat])
    with pytest.raises(ValueError, match="no_repeat must be a bool"):
        llm.generate("hi", greedy(2, extra_args={"no_repeat": "yes"}), use_tqdm=False)
    assert (llm.generate("hi", greedy(2),
                         use_tqdm=False)[0].finished), "the engine is fine afterwards"
