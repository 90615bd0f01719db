"""The host kernel's word tiles (bfloat16 read as 32-bit words, even and odd values apart) against float64.

Each piece on its own: the even/odd reordering of a row and its inverse, the vector max, a block's scores with
every tile shape and tail, and a block's P x V into even/odd accumulators. test_decode.py checks the whole kernel,
which takes this path for bfloat16 caches whose head_dim is a multiple of 32.
"""
import numpy as np
import pytest
from numba import njit

from cpu_attention import kernel_switches, tile_ir, word_tiles
from cpu_attention.block_attention import block_scores_words, block_values_words

pytestmark = pytest.mark.skipif(not kernel_switches.WORD_TILES, reason="word tiles need a little-endian CPU")


@njit
def _split(row):
    word_tiles.split_pairs(row.ctypes.data, row.shape[0])


@njit
def _join(row):
    word_tiles.join_pairs(row.ctypes.data, row.shape[0])


@njit
def _max(values, count):
    return tile_ir.max_of(values.ctypes.data, count)


def _bf16(shape, rng):
    """Random bfloat16 patterns (uint16) and their float64 values, of mixed signs and magnitudes."""
    values = rng.standard_normal(shape).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _even_odd(natural):
    """numpy's own even/odd order of [..., D] rows: in each stretch of 32, the even-indexed values, then the odd."""
    shape = natural.shape
    return natural.reshape(*shape[:-1], -1, 16, 2).swapaxes(-1, -2).reshape(shape)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_split_and_join_pairs(dim):
    rng = np.random.default_rng(dim)
    natural = rng.standard_normal(dim).astype(np.float32)
    row = natural.copy()
    _split(row)
    np.testing.assert_array_equal(row, _even_odd(natural))
    _join(row)
    np.testing.assert_array_equal(row, natural)


@pytest.mark.parametrize("count", [1, 5, 15, 16, 17, 33, 64])
def test_max_of_every_count(count):
    rng = np.random.default_rng(count)
    for where in range(count):  # the largest value in every lane and in the tail
        values = (rng.standard_normal(70) * 50 - 200).astype(np.float32)
        values[where] = 1e3
        values[count:] = 1e6  # past the count: never read into the answer
        assert _max(values, count) == np.float32(1e3)
    values = -np.abs(rng.standard_normal(count)).astype(np.float32) - 1e30
    assert _max(values, count) == values.max()


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64])
@pytest.mark.parametrize("dim", [32, 128])
def test_block_scores_match_float64(group, n, dim):
    rng = np.random.default_rng(group * 1000 + n * 10 + dim)
    block_size, num_kv_heads, h = 64, 2, 1
    k_cache, k_values = _bf16((3, num_kv_heads, block_size, dim), rng)
    queries = rng.standard_normal((num_kv_heads * group, dim)).astype(np.float32)
    wide_q = _even_odd(queries).copy()  # as _attend_split leaves it: widened, even/odd
    scores = np.full((group, block_size), np.nan, np.float32)
    block_max = np.full(group, np.nan, np.float32)
    scale = np.float32(0.0884)  # about 1 / sqrt(128)
    block_scores_words(wide_q, h * group, group, k_cache[2, h], n, scores, block_max, k_cache, 0, scale)
    expected = float(scale) * (queries[h * group:(h + 1) * group].astype(np.float64) @ k_values[2, h, :n].T)
    np.testing.assert_allclose(scores[:, :n], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_array_equal(block_max, scores[:, :n].max(axis=1))
    assert np.isnan(scores[:, n:]).all()  # nothing written past the block's rows


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64])
@pytest.mark.parametrize("dim", [32, 128])
def test_block_values_match_float64(group, n, dim):
    rng = np.random.default_rng(group * 1000 + n * 10 + dim + 7)
    block_size, num_kv_heads, h = 64, 2, 1
    v_cache, v_values = _bf16((3, num_kv_heads, block_size, dim), rng)
    weights = rng.random((group, block_size)).astype(np.float32)
    weights[:, n:] = np.nan  # past the block's rows: never read
    start = rng.standard_normal((group, dim)).astype(np.float32)
    acc = _even_odd(start).copy()
    block_values_words(v_cache[1, h], n, weights, acc, v_cache, 0)
    for g in range(group):
        _join(acc[g])
    expected = start.astype(np.float64) + weights[:, :n].astype(np.float64) @ v_values[1, h, :n]
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

