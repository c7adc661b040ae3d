"""The CPU fast path (attention/cpu_attention.py) against the torch reference it replaces on CPU.

Random caches whose requests own shuffled physical blocks; contexts that cross block boundaries; GQA ratios
1, 2, 4 and odd head counts; decode-only batches and mixes of prompts, chunks, drafts and decodes; batches of
many requests, whose work items cover several KV heads each; decodes of one or two requests, whose contexts are
attended in parts.
"""

import logging

import pytest
import torch

from minivllm.attention import cpu_attention
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend, paged_attention_ref, store_kv
from minivllm.platforms import choose_platform, cpu, cpu_extension

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def kernel():
    if not cpu.extension_built():
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    return cpu_attention.paged_attention


def make_batch(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q [T, heads, dim], caches [blocks, block_size, kv_heads, dim] and a metadata over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 2
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        table, perm = perm[:n], perm[n:]
        tables.append(table + [0] * (max(need) - n))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return q, k_cache, v_cache, meta


BATCHES = {
    "decode": ([1] * 6, [1, 15, 16, 17, 33, 100]),
    "many-decodes": ([1] * 40, [3 + 7 * i for i in range(40)]),  # enough for the reference's length groups
    "mixed": ([12, 1, 3, 1, 40], [12, 17, 20, 64, 57]),  # a prompt, decodes, 3 drafts, a chunk after a prefix
    # many requests of a few rows each: the kernel's work items then take several KV heads at once
    "many-drafts": ([3, 1, 2] * 6, [5 + 11 * i for i in range(18)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 3, 64), (8, 2, 64), (9, 3, 64), (5, 1, 24)])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size", [4, 12, 16, 32])  # within a chunk; not a power of two; a chunk; two
def test_kernel_matches_reference(kernel, dtype, heads, kv_heads, head_dim, batch, block_size):
    q, k_cache, v_cache, meta = make_batch(*BATCHES[batch], block_size, heads, kv_heads, head_dim, dtype)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    got = kernel(q, k_cache, v_cache, meta, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (5, 1, 24), (32, 1, 64)])
@pytest.mark.parametrize("lens", [[300], [70, 129], [64], [1000]])
@pytest.mark.parametrize("block_size", [12, 16])
def test_a_decode_of_few_requests_splits_its_contexts(kernel, threads, dtype, heads, kv_heads, head_dim, lens,
                                                       block_size):
    """Fewer KV heads than two a thread: each context is attended in parts, then merged (32 heads on one KV head:
    more query rows than an item takes, so not split)."""
    q, k_cache, v_cache, meta = make_batch([1] * len(lens), lens, block_size, heads, kv_heads, head_dim, dtype)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(q, k_cache, v_cache, meta, 0.3)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float16, 24)])
@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])  # one key; inside a chunk; a chunk; across chunks; all
@pytest.mark.parametrize("batch", list(BATCHES))
def test_sliding_window_matches_reference(kernel, dtype, head_dim, window, batch):
    """Each query sees its `window` latest keys: chunks wholly before every row's window are skipped, the
    window's first chunk is masked before its start."""
    q, k_cache, v_cache, meta = make_batch(*BATCHES[batch], 4, 6, 2, head_dim, dtype)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.3, sliding_window=window)
    got = kernel(q, k_cache, v_cache, meta, 0.3, sliding_window=window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    if window < 16:  # the window changes the result: the test would catch a kernel that ignored it
        assert not torch.allclose(got.float(), paged_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                                                   meta, 0.3), **TOL[dtype])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 64), (torch.bfloat16, 48), (torch.float16, 24)])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_rows_widened_first(kernel, dtype, head_dim, batch):
    """The rows the vector code does not read in place (fp16; bf16 rows that are not whole 32-element vectors)
    are widened to fp32 per chunk first, then take the fp32 vector code (head_dim 48, 64) or plain loops (24)."""
    q, k_cache, v_cache, meta = make_batch(*BATCHES[batch], 4, 6, 2, head_dim, dtype)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, meta, 0.3).float(), want, **TOL[dtype])


def test_strided_query_and_large_block(kernel):
    """q as a view of a fused projection (rows wider than heads * dim), blocks of 32."""
    q, k_cache, v_cache, meta = make_batch([1, 7, 1], [40, 7, 70], 32, 4, 2, 64, torch.float32)
    wide = torch.randn(q.shape[0], 4 * 64 + 96)
    wide[:, 32 : 32 + 256] = q.flatten(1)
    strided = wide[:, 32 : 32 + 256].view(-1, 4, 64)
    torch.testing.assert_close(kernel(strided, k_cache, v_cache, meta, 0.125),
                               paged_attention_ref(q, k_cache, v_cache, meta, 0.125), **TOL[torch.float32])


def new_slots(meta, block_size):
    """Each new token's slot: query i of request b sits at position seq_len - q_len + i."""
    tables = meta.block_tables.tolist()
    return [tables[b][p // block_size] * block_size + p % block_size
            for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
            for p in range(seq_len - q_len, seq_len)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("batch", ["decode", "mixed"])  # decodes; a prompt, drafts and a chunk after a prefix
def test_kernel_stores_like_store_kv(kernel, dtype, slot_dtype, batch):
    """Given this step's k and v, the op writes them to their slots first (store_kv's job), then attends: the
    caches after it are store_kv's, bit for bit, and the output the reference's over those caches. k and v are
    views of a wider projection, and two rows are padding (slot -1): they store nothing."""
    block_size, heads, kv_heads, dim = 4, 6, 3, 64
    q, k_cache, v_cache, meta = make_batch(*BATCHES[batch], block_size, heads, kv_heads, dim, dtype, seed=1)
    slots = new_slots(meta, block_size)
    slots[0] = slots[-1] = -1
    meta.slot_mapping = torch.tensor(slots, dtype=slot_dtype)
    kv = torch.randn(q.shape[0], 2 * kv_heads * dim + 8).to(dtype)
    k, v = (kv[:, i * kv_heads * dim : (i + 1) * kv_heads * dim].view(-1, kv_heads, dim) for i in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, want_k, want_v, meta.slot_mapping.long())
    want = paged_attention_ref(q.float(), want_k.float(), want_v.float(), meta, 0.3)
    got = kernel(q, k_cache, v_cache, meta, 0.3, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_store_rejects_a_slot_outside_the_cache(kernel):
    q, k_cache, v_cache, meta = make_batch([1], [5], 4, 2, 2, 64, torch.float32)
    meta.slot_mapping = torch.tensor([k_cache.shape[0] * 4])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, k_cache, v_cache, meta, 0.3, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))


def test_backend_uses_kernel_and_falls_back(kernel):
    """The CPU backend stores then attends through the kernel; a cache in another dtype (an fp8 cache, say)
    takes the reference."""
    backend = choose_platform("cpu", torch.float32).attention
    assert isinstance(backend, cpu_attention.CpuAttentionBackend)
    q, k_cache, v_cache, meta = make_batch([3, 1], [9, 21], 4, 4, 2, 64, torch.float32)
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    meta.slot_mapping = torch.tensor([k_cache.shape[0] * 4 - 1 - i for i in range(4)])  # slots nobody reads
    caches = (k_cache.clone(), v_cache.clone())
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.2)
    want = TorchAttentionBackend().forward(q, k, v, *caches, meta, 0.2)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])  # the kernel stored k, v too
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert not cpu_attention.fits(q, k_cache.half(), meta)
    assert not cpu_attention.fits(q[:3], k_cache, meta)  # rows the metadata does not account for
    assert not cpu_attention.fits(q, k_cache, meta, k.half(), v.half())  # new keys in another dtype than the cache


def test_switch_and_missing_compiler(monkeypatch, caplog):
    monkeypatch.setenv("MINIVLLM_CPU_ATTENTION", "reference")
    assert type(choose_platform("cpu", torch.float32).attention) is TorchAttentionBackend
    monkeypatch.setenv("MINIVLLM_CPU_ATTENTION", "fastest")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_ATTENTION"):
        choose_platform("cpu", torch.float32)
    monkeypatch.delenv("MINIVLLM_CPU_ATTENTION")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(cpu_extension, "build_failure", cpu_extension.build_failure.__wrapped__)
    with caplog.at_level(logging.WARNING):
        assert cpu.extension_built.__wrapped__() is False
    assert "using the readable torch code" in caplog.text and "command not found" in caplog.text
    monkeypatch.setattr(cpu, "extension_built", lambda: False)
    assert type(choose_platform("cpu", torch.float32).attention) is TorchAttentionBackend


def test_a_compile_says_so_and_building_ahead_never_fails(monkeypatch, capsys):
    """The first LLM() on a fresh clone compiles for half a minute: one line says so first and one
    says how long after; `make install`'s build-ahead says why it kept the readable path and exits
    cleanly where there is no compiler."""
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: None)
    monkeypatch.setattr(cpu_extension, "needs_compiling", lambda name: True)
    monkeypatch.setattr(cpu_extension, "missing_toolchain", lambda: None)
    cpu_extension.build()
    err = capsys.readouterr().err
    assert "compiling its C++ CPU kernels" in err and "once" in err and "compiled in" in err
    monkeypatch.setattr(cpu_extension, "needs_compiling", lambda name: False)
    cpu_extension.build()
    assert capsys.readouterr().err == "", "a cached build loads silently"

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(cpu_extension, "build_failure", cpu_extension.build_failure.__wrapped__)
    cpu_extension.build_ahead()
    out = capsys.readouterr().out
    assert "not built" in out and "command not found" in out and "readable torch code" in out
