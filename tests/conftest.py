"""Shared fixtures: tiny random checkpoints written by transformers itself, so tests need no network.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time:
Triton kernels then run on CPU tensors through the interpreter. MINIVLLM_CPU_DTYPE=float32 makes dtype="auto"
mean float32 on CPU for the whole run (servers and notebook kernels started by tests inherit it): equality with
transformers is exact only there. bf16, the default on CPUs with native bf16, is checked in test_cpu_bf16.py.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MINIVLLM_CPU_DTYPE", "float32")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


class CompetingJob:
    """The chapters run beside a competing CPU job (issue 36): a learner's laptop or a shared Colab machine
    is rarely idle, and every sentence a chapter derives from a measurement must stay true when a core is
    busy. From the first notebook cell pytest runs until the session ends, one process spins on the
    machine's last core (pinned there). A plugin, not a chapters/conftest.py: a second conftest module
    would shadow this one for the tests that import from it."""

    SPIN = "import os; os.sched_setaffinity(0, {%d})\nwhile True:\n    pass"

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def pytest_runtest_setup(self, item) -> None:
        if self.process is None and item.path.suffix == ".ipynb":
            core = max(os.sched_getaffinity(0))
            self.process = subprocess.Popen([sys.executable, "-c", self.SPIN % core])

    def pytest_unconfigure(self, config) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def pytest_configure(config):
    from head_start import HeadStart

    config.pluginmanager.register(CompetingJob(), "competing-cpu-job")
    config.pluginmanager.register(HeadStart(), "head-start")

TINY = dict(vocab_size=251, hidden_size=64, intermediate_size=136, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
            eos_token_id=None, pad_token_id=0)
EMBEDDED = Path(__file__).resolve().parent.parent / "minivllm" / "data" / "models" / "minivllm-tiny"


def build_checkpoint(kind: str, path: Path, **overrides):
    """Save a random-initialised tiny model of one family; returns the transformers model (eval mode)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = {**TINY, **overrides}
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{"tie_word_embeddings": False, **cfg}))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{"tie_word_embeddings": True, **cfg}))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{"head_dim": 24, "tie_word_embeddings": False, **cfg}))
    else:
        raise ValueError(kind)
    model.save_pretrained(path)
    return model.eval()


def build_noisy_copy(target, path: Path, kind: str = "llama", scale: float = 0.15, seed: int = 3):
    """The target with noise added to its output head: a draft whose proposals the target partly accepts."""
    torch.manual_seed(seed)
    noisy = build_checkpoint(kind, path)
    noisy.load_state_dict(target.state_dict())
    with torch.no_grad():
        noisy.lm_head.weight.add_(scale * torch.randn_like(noisy.lm_head.weight))
    noisy.save_pretrained(path)
    return noisy


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """{kind: (path, hf_model)} for llama, qwen2 and qwen3."""
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: (root / kind, build_checkpoint(kind, root / kind)) for kind in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_path(checkpoints) -> Path:
    return checkpoints["llama"][0]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()
