"""The Triton kernels against the torch reference backend, on CPU through Triton's interpreter.

Shapes are small (the interpreter runs programs one at a time) but deliberately awkward: contexts that
are not multiples of the block size, a head_dim that is not a power of two, GQA, split-K with empty
slices, tiles that straddle blocks, shuffled physical blocks, padding slots.
"""

import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.attention.metadata import AttentionMetadata  # noqa: E402
from minivllm.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    paged_attention_ref,
    paged_decode_ref,
)
from minivllm.attention.torch_backend import store_kv as store_kv_ref  # noqa: E402
from minivllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from minivllm.kernels import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from minivllm.kernels.activation import silu_and_mul  # noqa: E402
from minivllm.kernels.norm import rms_norm  # noqa: E402
from minivllm.kernels.rotary import apply_rotary  # noqa: E402
from minivllm.model.llama import RMSNorm  # noqa: E402
from minivllm.model.rotary import RotaryEmbedding  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def make_batch(query_lens, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, spare_blocks=3):
    """Random caches and a metadata whose requests own shuffled physical blocks (the table padded with 0)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for n, q_len, s in zip(need, query_lens, seq_lens, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table + [0] * (max(need) - n))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - q_len, s)]
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=starts,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return k_cache, v_cache, meta, gen


def as_fp32(*tensors):
    return [t.float() for t in tensors]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(block_size, head_dim, dtype):
    k_cache, v_cache, meta, gen = make_batch([5, 1, 9], [5, 20, 40], block_size, 3, head_dim, dtype)
    num_tokens = meta.slot_mapping.shape[0]
    # K and V as the model makes them: views into one fused projection (row stride > heads * head_dim)
    fused = torch.randn(num_tokens, 8, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 2:5], fused[:, 5:8]
    slots = meta.slot_mapping.clone()
    slots[[1, 7]] = -1  # padding rows store nothing
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, want_k, want_v, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    written = want_k.flatten(0, 1)[meta.slot_mapping[[0, 2]]]
    assert torch.equal(written, key[[0, 2]])  # and the reference really wrote something


# (block_size, num_kv_heads, group, head_dim, dtype, seq_lens, num_splits, block_n)
DECODE_CASES = [
    (8, 2, 1, 24, torch.float32, [1, 7, 33, 100], 1, 16),
    (8, 1, 4, 24, torch.float16, [9, 64, 3], 4, 16),  # more slices than tiles: some slices are empty
    (16, 2, 2, 32, torch.float32, [17, 50, 129], 3, 32),
    (16, 1, 2, 64, torch.float16, [16, 31, 90], 1, 64),  # one tile spans several blocks
    (32, 2, 4, 32, torch.float32, [40, 95, 2], 2, 16),  # tiles smaller than a block
    (32, 1, 1, 64, torch.float16, [33, 77], 5, 16),
    (8, 2, 4, 64, torch.float32, [120, 5], None, 64),  # automatic choice (1 on CPU)
    (16, 3, 2, 24, torch.float16, [70, 1, 44], 2, 32),  # kv heads and head_dim not powers of two
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"bs{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{str(c[4])[6:]}-s{c[6]}")
def test_paged_decode(case):
    block_size, kv_heads, group, head_dim, dtype, seq_lens, num_splits, block_n = case
    k_cache, v_cache, meta, gen = make_batch([1] * len(seq_lens), seq_lens, block_size, kv_heads, head_dim,
                                             dtype)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                 max_seq_len=meta.max_seq_len, num_splits=num_splits, block_n=block_n)
    want = paged_decode_ref(*as_fp32(q, k_cache, v_cache), meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


# (block_size, num_kv_heads, group, head_dim, dtype, query_lens, seq_lens, block_m, block_n)
PREFILL_CASES = [
    (8, 2, 1, 24, torch.float32, [13, 1, 6], [13, 30, 6], None, 16),  # fresh prompts and a decode row
    (8, 1, 4, 32, torch.float16, [5, 20], [27, 20], 16, 16),  # a cached prefix; two query tiles
    (16, 2, 2, 64, torch.float32, [1, 1, 40], [17, 1, 57], 16, 32),  # mixed batch, q_len 1 at position 0
    (16, 1, 2, 24, torch.float16, [33, 3], [33, 50], None, 64),
    (32, 2, 4, 32, torch.float32, [7, 21, 1], [40, 21, 65], 16, 16),
    (32, 1, 1, 64, torch.float16, [4, 12], [4, 75], None, 32),  # speculative-style short query, long ctx
    (8, 3, 2, 24, torch.float32, [9, 2, 1, 15], [9, 18, 3, 31], 16, 16),
    # query heads of a kv head packed into a tile's rows: a group of 7 (Qwen2-0.5B's 14/2) leaves rows unused,
    # a group of 32 (multi-query) needs a 32-row tile even for one query
    (16, 2, 7, 32, torch.float32, [11, 1, 5], [11, 20, 37], None, 16),
    (8, 1, 32, 24, torch.float16, [3, 1], [19, 9], None, 16),
]


@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"bs{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{str(c[4])[6:]}")
def test_paged_prefill(case):
    block_size, kv_heads, group, head_dim, dtype, query_lens, seq_lens, block_m, block_n = case
    k_cache, v_cache, meta, gen = make_batch(query_lens, seq_lens, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  scale, meta.max_query_len, block_m=block_m, block_n=block_n)
    want = paged_attention_ref(*as_fp32(q, k_cache, v_cache), meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("window", [1, 7, 16, 33])  # one key; inside a tile; a whole tile; across tiles
@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], DECODE_CASES[4], DECODE_CASES[7]],
                         ids=lambda c: f"bs{c[0]}-kv{c[1]}-g{c[2]}-s{c[6]}")
def test_paged_decode_sliding_window(case, window):
    """The keys before seq_len - window are skipped (whole tiles) or masked; split-K slices cover the rest."""
    block_size, kv_heads, group, head_dim, dtype, seq_lens, num_splits, block_n = case
    k_cache, v_cache, meta, gen = make_batch([1] * len(seq_lens), seq_lens, block_size, kv_heads, head_dim,
                                             dtype)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3,
                                 num_splits=num_splits, block_n=block_n, sliding_window=window)
    want = paged_decode_ref(*as_fp32(q, k_cache, v_cache), meta, 0.3, sliding_window=window)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    assert not torch.allclose(want, paged_decode_ref(*as_fp32(q, k_cache, v_cache), meta, 0.3), **TOL[dtype])


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("case", [PREFILL_CASES[1], PREFILL_CASES[2], PREFILL_CASES[4], PREFILL_CASES[7]],
                         ids=lambda c: f"bs{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}")
def test_paged_prefill_sliding_window(case, window):
    """Each query row has its own window start: rows whose window begins past a key tile add nothing from it."""
    block_size, kv_heads, group, head_dim, dtype, query_lens, seq_lens, block_m, block_n = case
    k_cache, v_cache, meta, gen = make_batch(query_lens, seq_lens, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  0.3, meta.max_query_len, block_m=block_m, block_n=block_n, sliding_window=window)
    want = paged_attention_ref(*as_fp32(q, k_cache, v_cache), meta, 0.3, sliding_window=window)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


# every pair of block size, GQA group and head dim (a Latin square: the dim follows from the other two), each in
# both dtypes: 18 interpreted runs where the full product was 54, and no pair of values goes untried
BLOCK_SIZES, GROUPS, HEAD_DIMS = (8, 16, 32), (1, 2, 4), (24, 32, 64)
SWEEP = [(bs, group, HEAD_DIMS[(i + j) % 3], dtype) for i, bs in enumerate(BLOCK_SIZES)
         for j, group in enumerate(GROUPS) for dtype in (torch.float32, torch.float16)]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", SWEEP,
                         ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else str(v))
def test_random_batches(block_size, group, head_dim, dtype):
    """Each setting with random lengths: a decode batch (split-K on or off) and a mixed batch."""
    rng = random.Random(f"{block_size}-{group}-{head_dim}-{dtype}")
    seq_lens = [rng.randint(1, 4 * block_size + 7) for _ in range(3)] + [2 * block_size + 1]
    # a decode row, two rows with a cached prefix (or none), a fresh prompt
    query_lens = [1] + [rng.randint(1, s) for s in seq_lens[1:-1]] + [seq_lens[-1]]
    kv_heads, scale = rng.choice([1, 2]), head_dim**-0.5
    k_cache, v_cache, meta, gen = make_batch(query_lens, seq_lens, block_size, kv_heads, head_dim, dtype,
                                             seed=rng.randrange(1 << 30))
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  scale, meta.max_query_len, block_m=16, block_n=rng.choice([16, 32]))
    want = paged_attention_ref(*as_fp32(q, k_cache, v_cache), meta, scale)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])

    # the same contexts, now each decoding its last token
    meta = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                             torch.arange(len(seq_lens) + 1, dtype=torch.int32), 1, meta.max_seq_len,
                             [1] * len(seq_lens), meta.seq_lens_cpu)
    q = q[: len(seq_lens)]
    num_splits = rng.choice([1, 2, 3])
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                 num_splits=num_splits, block_n=16)
    want = paged_decode_ref(*as_fp32(q, k_cache, v_cache), meta, scale)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 2048, num_sms=132) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 16  # capped at MAX_SPLITS
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 4  # slices of at least 256 tokens
    assert choose_num_splits(4, 8, 8192, num_sms=132) == 9  # enough to fill the GPU about twice
    assert choose_num_splits(2, 8, 200, num_sms=132) == 1  # too short to be worth splitting
    assert choose_num_splits(3, 2, 100000, num_sms=1) == 1  # the CPU interpreter


@pytest.mark.parametrize("decode", [False, True])
def test_backend_matches_torch_backend(decode):
    """forward() stores then attends exactly like the torch backend, with q/k/v as strided views."""
    query_lens, seq_lens = ([1, 1, 1], [9, 26, 4]) if decode else ([6, 1, 11], [14, 26, 11])
    k_cache, v_cache, meta, gen = make_batch(query_lens, seq_lens, 8, 2, 24, torch.float32)
    qkv = torch.randn(sum(query_lens), (4 + 2 + 2) * 24, generator=gen)
    q, k, v = (t.view(-1, n, 24) for t, n in zip(qkv.split([96, 48, 48], dim=-1), (4, 2, 2), strict=True))
    caches = (k_cache.clone(), v_cache.clone())
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.2)
    want = TorchAttentionBackend().forward(q, k, v, *caches, meta, 0.2)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    torch.testing.assert_close(out, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim,heads,with_residual", [(64, 0, False), (100, 0, True), (24, 3, False), (96, 0, True)])
def test_rms_norm_kernel(dim, heads, with_residual, dtype):
    """The fused kernel against the module's torch path: whole rows, residual adds, and per-head rows of a view."""
    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6).to(dtype)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    if heads:  # q/k norm: [T, heads, dim] carved out of a wider fused-projection output
        x = torch.randn(7, heads * dim + 10, generator=gen).to(dtype)[:, 5 : 5 + heads * dim].view(7, heads, dim)
    else:
        x = torch.randn(9, dim, generator=gen).to(dtype)
    residual = torch.randn(9, dim, generator=gen).to(dtype) if with_residual else None
    out, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    if with_residual:
        want, want_residual = norm(x, residual)
        torch.testing.assert_close(new_residual, want_residual, **TOL[dtype])
    else:
        want = norm(x)
        assert new_residual is None
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(24, 4, 2), (64, 3, 1), (32, 8, 8)])
def test_rotary_kernel(head_dim, heads, kv_heads, dtype):
    """apply_rotary against the torch rotation, q and k as strided views of one fused qkv output."""
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 300, 10000.0, None)
    rope.build()
    qkv = torch.randn(11, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(11, heads, head_dim), k.view(11, kv_heads, head_dim)
    positions = torch.randint(0, 300, (11,), generator=gen)
    got_q, got_k = apply_rotary(positions, q, k, rope.cos_sin)
    want_q, want_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,intermediate,block", [(5, 136, 1024), (3, 100, 32), (1, 64, 16)])
def test_silu_and_mul_kernel(tokens, intermediate, block, dtype):
    """One kernel for SwiGLU's activation against the torch pair, from a strided view of a wider buffer."""
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = torch.randn(tokens, 2 * intermediate + 6, generator=gen).mul(3).to(dtype)[:, 3 : 3 + 2 * intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate.float()) * up.float()
    torch.testing.assert_close(silu_and_mul(gate_up, block=block).float(), want, **TOL[dtype])


def test_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch\n"
            "from minivllm.attention.triton_backend import TritonAttentionBackend\n"
            "x = torch.zeros(1, 1, 16)\n"
            "for make in (lambda: TritonAttentionBackend('cpu'),\n"
            "             lambda: TritonAttentionBackend().forward(x, x, x, None, None, None, 1.0)):\n"
            "    try:\n"
            "        make()\n"
            "    except ValueError as e:\n"
            "        assert 'TRITON_INTERPRET' in str(e) and 'torch' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('no error')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_engine_triton_matches_torch(checkpoints):
    """The whole engine, chunked prefill and a prefix-cache hit included, gives the same greedy tokens."""
    path = checkpoints["qwen3"][0]  # head_dim 24
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 121)), [5] * 11]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, device="cpu", block_size=8, num_kv_blocks=40,
                  max_num_batched_tokens=16)
        assert llm.engine.runner.platform.name == ("cuda" if backend == "triton" else "cpu")
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": prompts[0] + [1, 2]}], params, use_tqdm=False)  # cached
        tokens[backend] = [o.outputs[0].token_ids for o in first + again]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["torch"])
