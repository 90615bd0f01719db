"""paged_prefill_attention matches causal float64 attention of each chunk over its cached prefix + itself."""
import pytest
import torch

from gpu_kernels import paged_prefill_attention
from gpu_kernels.paged_prefill import prefill_tiles, query_tile_rows
from tests.conftest import TEST_DEVICE
from tests.reference import attention_reference, on_test_device, random_paged_kv, relative_error

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def check_prefill(context_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
                  max_seqlen_q=None, strided_q=False, tiled=False, contiguous=False, config=None):
    """context_lens[b] counts cached tokens including the chunk; the chunk is the last query_lens[b] of them.
    tiled: the grid from a tile map (as a CUDA graph runs it), three rows of -1 past the last tile. contiguous: one
    row whose cache holds its blocks in order (a staging cache), its table the identity, which the kernel does not
    read. config: the kernel's tiles, (BLOCK_M, BLOCK_N, warps, stages)."""
    k_cache, v_cache, block_tables, keys, values = random_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, layout="token_major", seed=seed)
    if contiguous:
        assert len(context_lens) == 1
        order = block_tables[0][block_tables[0] >= 0].long()
        k_cache, v_cache = k_cache[order], v_cache[order]
        block_tables = torch.arange(order.numel(), dtype=torch.int32)[None]
    gen = torch.Generator().manual_seed(seed + 1)
    num_tokens = sum(query_lens)
    fused = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q = fused[:, :num_q_heads] if strided_q else fused[:, :num_q_heads].contiguous()
    # A strided q stays a view of the fused projection on the device too.
    q_in = fused.to(TEST_DEVICE)[:, :num_q_heads] if strided_q else q.to(TEST_DEVICE)
    cu_seqlens = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    scale = head_dim ** -0.5
    tiles = None
    if tiled:
        tile_rows = query_tile_rows(torch.device(TEST_DEVICE), dtype, head_dim)
        needed = sum(-(-n // tile_rows) for n in query_lens)
        tiles = on_test_device(torch.from_numpy(prefill_tiles(query_lens, tile_rows, needed + 3)))[0]
    out, lse = paged_prefill_attention(q_in, *on_test_device(k_cache, v_cache, block_tables, cu_seqlens,
                                                             torch.tensor(context_lens, dtype=torch.int32)),
                                       scale, max_seqlen_q if max_seqlen_q is not None else max(query_lens),
                                       tiles=tiles, contiguous=contiguous, config=config)
    out, lse = out.cpu(), lse.cpu()
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (num_tokens, num_q_heads)
    for b, (context, q_len) in enumerate(zip(context_lens, query_lens)):
        rows = slice(cu_seqlens[b].item(), cu_seqlens[b + 1].item())
        if q_len == 0:
            continue
        ref_out, ref_lse = attention_reference(q[rows], keys[b], values[b], scale,
                                               first_query_position=context - q_len)
        assert relative_error(out[rows], ref_out) < TOLERANCE[dtype], f"sequence {b}"
        assert (lse[rows].double() - ref_lse).abs().max().item() < LSE_TOLERANCE[dtype], f"sequence {b}"


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
def test_chunks_after_cached_prefixes_gqa(num_q_heads, num_kv_heads):
    # A chunk after a prefix, a whole-sequence prefill, a single query, and rows with no queries at all.
    check_prefill([70, 21, 33, 17, 0], [40, 21, 1, 0, 0], num_q_heads, num_kv_heads, 64, 8, torch.float32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_tile_map_runs_every_query_tile_once(dtype):
    # Rows of several tiles, one query, none; a prefix before a chunk; GQA; spare map rows of -1.
    check_prefill([70, 21, 33, 17, 0, 50], [40, 21, 1, 0, 0, 33], 8, 2, 64, 8, dtype, seed=5, tiled=True)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_staging_cache_read_without_its_identity_table(dtype):
    # A chunk after a prefix that crosses pages and query tiles; the kernel computes each block from the token.
    check_prefill([203], [77], 8, 2, 64, 8, dtype, seed=7, contiguous=True)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the long tile's shared memory: CUDA only")
@pytest.mark.parametrize("contiguous", (False, True))
def test_the_long_tile_on_long_chunks(contiguous):
    # 256 queries a program, a chunk of several of them after a prefix, GQA, a last tile cut short.
    from gpu_kernels.paged_prefill import LONG_TILE

    check_prefill([1900], [1100], 8, 2, 128, 16, torch.bfloat16, seed=9, contiguous=contiguous, config=LONG_TILE)


def test_the_long_tile_is_chosen_only_where_it_fills_the_gpu(monkeypatch):
    from gpu_kernels import paged_prefill as pp

    monkeypatch.setattr(pp, "_gpu", lambda device: (132, 227 * 1024))
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    default = pp._tile_config(cuda, bf16, 128)
    assert pp._launch_config(cuda, bf16, 16, 128, 16384, 1, tiled=False) == pp.LONG_TILE  # 1,024 programs
    assert pp._launch_config(cuda, bf16, 16, 128, 4096, 1, tiled=False) == default  # 256: under four waves
    assert pp._launch_config(cuda, bf16, 16, 128, 16384, 1, tiled=True) == default  # graphs cut tiles by the default
    assert pp._launch_config(cuda, torch.float32, 16, 128, 16384, 1, tiled=False) == pp._tile_config(
        cuda, torch.float32, 128)
    assert pp._launch_config(cuda, bf16, 16, 64, 16384, 1, tiled=False) == pp._tile_config(cuda, bf16, 64)
    monkeypatch.setattr(pp, "_gpu", lambda device: (108, 163 * 1024))  # too little shared memory for it
    assert pp._launch_config(cuda, bf16, 16, 128, 16384, 1, tiled=False) == default
    cpu = torch.device("cpu")
    assert pp._launch_config(cpu, bf16, 16, 128, 16384, 1, tiled=False) == pp._tile_config(cpu, bf16, 128)


def test_the_tile_map_puts_the_longest_causal_tiles_first():
    tiles = prefill_tiles([33, 0, 16, 1], 16, 8)
    assert tiles.dtype.name == "int32" and tiles.shape == (8, 2)
    assert tiles[:5].tolist() == [[0, 2], [0, 1], [0, 0], [2, 0], [3, 0]]
    assert (tiles[5:] == -1).all()
    with pytest.raises(ValueError, match="tile map"):
        prefill_tiles([33, 16], 16, 3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_dtypes_head_dim_128(dtype):
    check_prefill([48, 16], [20, 16], 4, 2, 128, 16, dtype, seed=1)


@pytest.mark.parametrize("block_size", (4, 32))
def test_odd_head_dim_and_page_sizes(block_size):
    # Pages smaller and larger than the key tile; D = 24 pads to a 32-wide tile.
    check_prefill([45, 31], [17, 31], 4, 2, 24, block_size, torch.bfloat16, seed=2, strided_q=True)


def test_single_query_rows_and_a_loose_grid_bound():
    # max_seqlen_q above every chunk: the extra query tiles must exit without writing.
    check_prefill([1, 16, 17, 40], [1, 1, 1, 1], 4, 4, 32, 16, torch.float16, seed=3, max_seqlen_q=40)


def test_chunk_ending_on_a_tile_boundary():
    # Chunk starts right after a 32-token prefix: the first query tile's unmasked range ends on a tile edge.
    check_prefill([64, 15], [32, 15], 2, 1, 64, 16, torch.float32, seed=4)


def test_no_queries_at_all():
    k_cache, v_cache, block_tables, _, _ = random_paged_kv([5, 3], 1, 16, 4, torch.float32, layout="token_major")
    out, lse = paged_prefill_attention(*on_test_device(torch.randn(0, 2, 16), k_cache, v_cache, block_tables,
                                                       torch.zeros(3, dtype=torch.int32),
                                                       torch.tensor([5, 3], dtype=torch.int32)), 0.25, 0)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_bad_inputs_raise_value_error():
    k_cache, v_cache, block_tables, _, _ = random_paged_kv([5], 2, 16, 4, torch.float32, layout="token_major")
    k_cache, v_cache, block_tables = on_test_device(k_cache, v_cache, block_tables)
    q = torch.randn(5, 4, 16, device=TEST_DEVICE)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=TEST_DEVICE)
    context_lens = torch.tensor([5], dtype=torch.int32, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, cu.long(), context_lens, 0.25, 5)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, 0.25, torch.tensor(5))
    with pytest.raises(ValueError, match="multiple"):
        paged_prefill_attention(q[:, :3], k_cache, v_cache, block_tables, cu, context_lens, 0.25, 5)


def test_rows_of_the_other_tier_come_back_empty():
    """The dual maps give the other tier's rows context 0 with queries present: out 0, lse -inf, and the
    -1 block-table rows are never walked (the cache has no spare blocks to hide a stray read)."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(5, 16, 2, 16), torch.randn(5, 16, 2, 16)
    tables = torch.tensor([[-1] * 4] * 3 + [[0, 1, 2, 3], [4, -1, -1, -1]], dtype=torch.int32)
    query_lens, context_lens = [1, 17, 40, 64, 16], [0, 0, 0, 64, 16]
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(query_lens), 4, 16)
    out, lse = paged_prefill_attention(*on_test_device(q, k_cache, v_cache, tables, cu,
                                                       torch.tensor(context_lens, dtype=torch.int32)),
                                       0.25, max(query_lens))
    out, lse = out.cpu(), lse.cpu()
    masked = slice(0, 58)
    assert torch.equal(out[masked], torch.zeros_like(out[masked])) and torch.isneginf(lse[masked]).all()
    keys = [k_cache[:4].flatten(0, 1), k_cache[4]]
    values = [v_cache[:4].flatten(0, 1), v_cache[4]]
    for rows, k, v in ((slice(58, 122), *[keys[0], values[0]]), (slice(122, 138), keys[1], values[1])):
        ref_out, ref_lse = attention_reference(q[rows], k, v, 0.25, first_query_position=0)
        assert relative_error(out[rows], ref_out) < 1e-4
        assert (lse[rows].double() - ref_lse).abs().max().item() < 1e-4
