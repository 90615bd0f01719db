"""The flash-attn backend keeps our kernel contract (paged decode and causal prefill against float64; GQA, block
boundaries, -1 padding, rows without keys, chunks after a cached prefix), and "auto" picks per operation.

Where flash-attn 4 runs (CUDA, Hopper or later) the checks call it; elsewhere they call a float64 stand-in written to
flash-attn 4's documented conventions (`page_table` + `seqused_k`, causal aligned to the end of the keys, lse
[Hq, total_q] for varlen queries and [B, Hq, seqlen_q] for batched ones), which checks our side of the call: the
arguments we pass and what we make of the results."""
import math

import pytest
import torch

from offload_engine.layers import attention_backends, flash_attn_backend
from offload_engine.layers.flash_attn_backend import FlashAttn4
from tests.conftest import TEST_DEVICE
from tests.reference import attention_reference, random_paged_kv, relative_error

REAL = TEST_DEVICE == "cuda" and attention_backends.flash_attn_version(torch.device("cuda")) == 4
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def stand_in(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, seqused_k=None, page_table=None, softmax_scale=None,
             causal=False, num_splits=1, return_lse=False):
    """flash_attn_varlen_func's paged forward in float64, reading only each row's first seqused_k tokens."""
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and (page_table >= 0).all()
    assert return_lse and seqused_k is not None
    batched = cu_seqlens_q is None
    starts = list(range(0, q.shape[0] + 1)) if batched else cu_seqlens_q.tolist()
    flat_q = q.flatten(0, 1) if batched else q
    out = torch.zeros(flat_q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((flat_q.shape[1], flat_q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    page = k.shape[1]
    for b, used in enumerate(seqused_k.tolist()):
        rows = slice(starts[b], starts[b + 1])
        if used == 0 or rows.start == rows.stop:
            continue
        pages = page_table[b, : math.ceil(used / page)].long()
        keys, values = k[pages].flatten(0, 1)[:used], v[pages].flatten(0, 1)[:used]
        first = used - (rows.stop - rows.start) if causal else None
        out[rows], row_lse = attention_reference(flat_q[rows], keys, values, softmax_scale, first_query_position=first)
        lse[:, rows] = row_lse.T
    if batched:
        return out.view(q.shape).to(q.dtype), lse.T.reshape(q.shape[0], q.shape[1], -1).transpose(1, 2)
    return out.to(q.dtype), lse.float()


@pytest.fixture(autouse=True)
def flash_attn_4(monkeypatch):
    if not REAL:
        monkeypatch.setattr(flash_attn_backend, "_varlen", lambda: stand_in)


def caches(context_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    k_cache, v_cache, tables, keys, values = random_paged_kv(context_lens, num_kv_heads, head_dim, block_size, dtype,
                                                             layout="token_major", seed=seed)
    if REAL:  # flash-attn 4 may load a partial last page whole: the engine's caches hold finite values there
        k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    return k_cache, v_cache, tables, keys, values


def on_device(*tensors):
    return [t.to(TEST_DEVICE) for t in tensors]


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_matches_float64_with_padding_and_rows_without_keys(num_q_heads, num_kv_heads, block_size):
    dtype = torch.bfloat16 if REAL else torch.float32
    context_lens = [1, block_size, block_size + 1, 0, 3 * block_size - 1]
    k_cache, v_cache, tables, keys, values = caches(context_lens, num_kv_heads, 64, block_size, dtype, seed=5)
    q = torch.randn(len(context_lens), num_q_heads, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out, lse = FlashAttn4.paged_decode_attention(*on_device(q, k_cache, v_cache, tables, lens), 0.125)
    out, lse = out.cpu(), lse.cpu()
    for b, n in enumerate(context_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
            continue
        ref_out, ref_lse = attention_reference(q[b : b + 1], keys[b], values[b], 0.125)
        assert relative_error(out[b : b + 1], ref_out) < TOLERANCE[dtype]
        assert (lse[b].double() - ref_lse[0]).abs().max().item() < 1e-3


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_prefill_chunks_after_cached_prefixes_and_rows_of_the_other_tier(num_q_heads, num_kv_heads):
    dtype = torch.bfloat16 if REAL else torch.float32
    block_size = 16
    context_lens, query_lens = [40, 0, 17, 33], [40, 5, 1, 16]  # whole prompt; another tier's row; 1 new; a chunk
    k_cache, v_cache, tables, keys, values = caches(context_lens, num_kv_heads, 64, block_size, dtype, seed=7)
    q = torch.randn(sum(query_lens), num_q_heads, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out, lse = FlashAttn4.paged_prefill_attention(*on_device(q, k_cache, v_cache, tables, cu, lens), 0.125,
                                                  max(query_lens))
    out, lse = out.cpu(), lse.cpu()
    assert out.shape == q.shape and lse.shape == (q.shape[0], num_q_heads)
    for b, (n, m) in enumerate(zip(context_lens, query_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if n == 0:
            assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isneginf(lse[rows]).all()
            continue
        ref_out, ref_lse = attention_reference(q[rows], keys[b], values[b], 0.125, first_query_position=n - m)
        assert relative_error(out[rows], ref_out) < TOLERANCE[dtype]
        assert (lse[rows].double() - ref_lse).abs().max().item() < 1e-3


def test_no_rows_at_all():
    q = torch.zeros(0, 4, 64)
    cache = torch.zeros(2, 16, 4, 64)
    out, lse = FlashAttn4.paged_decode_attention(q, cache, cache, torch.zeros(0, 1, dtype=torch.int32),
                                                 torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_auto_decodes_on_triton_and_prefills_long_steps_on_flash_attn(monkeypatch):
    import gpu_kernels

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention_backends, "flash_attn_version", lambda device: 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    served = []
    monkeypatch.setattr(gpu_kernels, "paged_prefill_attention", lambda *a, **kw: served.append(("triton", kw)))
    monkeypatch.setattr(FlashAttn4, "paged_prefill_attention", staticmethod(lambda *a: served.append(("fa4", {}))))
    backend = attention_backends.select_backend("auto", cuda, 16, torch.bfloat16)
    assert (backend.decode_name, backend.paged_decode_attention) == ("triton", gpu_kernels.paged_decode_attention)
    assert backend.flash_attn_prefill is FlashAttn4.paged_prefill_attention and backend.prefill_takes_contiguous
    # A step's key span is its table's width x the block size, known on the host.
    long_keys, cache = attention_backends.AUTO_CHOICE["long_prefill_keys"], torch.zeros(1, 16, 1, 8)
    for width in (long_keys // 16 - 1, long_keys // 16):
        backend.paged_prefill_attention(None, cache, cache, torch.zeros(1, width), None, None, 1.0, 1,
                                        contiguous=True)
    assert served == [("triton", {"contiguous": True}), ("fa4", {})]
    # Prefill graphs' tile maps and the streamed share's strided views stay on Triton.
    assert backend.tiled_prefill_attention is gpu_kernels.paged_prefill_attention
    assert backend.strided_decode_attention is gpu_kernels.paged_decode_attention
    # flash-attn runs float16 and bfloat16 only; without it, or off CUDA, auto is Triton, or torch.
    assert attention_backends.select_backend("auto", cuda, 16, torch.float32).name == "triton"
    monkeypatch.setattr(attention_backends, "flash_attn_version", lambda device: None)
    assert attention_backends.select_backend("auto", cuda, 16).name == "triton"
    assert attention_backends.select_backend("auto", torch.device("cpu"), 16).name == "torch"


def test_a_forced_flash_attn_that_cannot_run_says_what_to_do(monkeypatch):
    monkeypatch.setattr(attention_backends, "flash_attn_version", lambda device: None)
    with pytest.raises(ValueError, match=r"offload-engine\[flash-attn\]"):
        attention_backends.select_backend("flash-attn", torch.device("cuda", 0), 16)
    monkeypatch.setattr(attention_backends, "flash_attn_version", lambda device: 2)
    with pytest.raises(ValueError, match="multiple of 256"):
        attention_backends.select_backend("flash_attn", torch.device("cuda", 0), 16)
    forced = attention_backends.select_backend("flash-attn", torch.device("cuda", 0), 256)
    assert forced.name == "flash-attn" and forced.tiled_prefill_attention is not None
    with pytest.raises(ValueError, match="float16 and bfloat16.*dtype='bfloat16'"):
        attention_backends.select_backend("flash-attn", torch.device("cuda", 0), 256, torch.float32)


def test_head_sizes_flash_attn_4_cannot_run_stay_on_triton(monkeypatch):
    import gpu_kernels

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention_backends, "flash_attn_version", lambda device: 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention_backends.select_backend("auto", cuda, 16, torch.bfloat16, 128).flash_attn_prefill is not None
    for head_dim in (4, 12, 320):  # below 8, not a multiple of 8, past 256
        auto = attention_backends.select_backend("auto", cuda, 16, torch.bfloat16, head_dim)
        assert auto.flash_attn_prefill is None and auto.paged_prefill_attention is gpu_kernels.paged_prefill_attention
        with pytest.raises(ValueError, match=f"heads of {head_dim}.*attention_backend='triton'"):
            attention_backends.select_backend("flash-attn", cuda, 16, torch.bfloat16, head_dim)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert attention_backends.select_backend("auto", cuda, 16, torch.bfloat16, 192).flash_attn_prefill is None
