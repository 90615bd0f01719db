"""bfloat16 read as 32-bit words: a block's scores and its P x V, two values widened a lane.

16 words are 32 values: shifted up 16 bits, each word's low half (the even value; little-endian) is its float32,
and masked, the high half (the odd value) is: two instructions per 32 values, where widening takes two per 16
(docs/decisions/host-kernel.md, "bfloat16 read as words"). Products and sums run on even and odd values apart, so
queries and accumulators are held in that order within every stretch of 32 (split_pairs, undone by join_pairs).
The products are the widening path's, exact in float32; only the order of the float32 sums differs.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attention.tile_ir import FLOATS, load_at, row_address, splat, store_at, store_sums, tile_addresses

WORD_VALUES = 32  # bfloat16 values per word vector: head_dim must be a multiple of this
_WORDS = ir.VectorType(ir.IntType(32), 16)


def _word_halves(builder, words):
    """(even, odd): the float32 values of the 32 bfloat16 patterns in 16 words."""
    even = builder.bitcast(builder.shl(words, ir.Constant(_WORDS, [16] * 16)), FLOATS)
    odd = builder.bitcast(builder.and_(words, ir.Constant(_WORDS, [-65536] * 16)), FLOATS)  # 0xFFFF0000
    return even, odd


def _rows_halves(builder, intp, start, step, offset, num_rows):
    """_word_halves of the 32 values at byte `offset` into each of num_rows bfloat16 rows `step` bytes apart."""
    return [_word_halves(builder, load_at(builder, row_address(builder, intp, start, step, j, offset), _WORDS, 2))
            for j in range(num_rows)]


def _multiply_add(builder):
    """llvm.fmuladd on 16 float32 lanes: a * b + c, fused where the CPU has FMA."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS] * 3),
                                          "llvm.fmuladd.v16f32")


def _word_scores_tile(num_heads, num_rows):
    """An intrinsic tile(q, q_row, k, k_row, scores, score_row, dim, scale), on addresses and row strides in bytes
    (ints): scores[i, j] = scale * q[i] . k[j] for i < num_heads, j < num_rows, where k holds bfloat16 patterns in
    rows of `dim` (a multiple of WORD_VALUES) and q float32 queries in even/odd order (split_pairs). Tiles of fewer
    than eight (head, row) pairs keep even and odd sums apart: at least eight multiply-add chains in flight."""
    apart = num_heads * num_rows < 8

    @intrinsic
    def tile(typingctx, q, q_row, k, k_row, scores, score_row, dim, scale):
        def codegen(context, builder, signature, args):
            intp, (q_addr, q_step, k_addr, k_step, s_addr, s_step, length) = tile_addresses(
                context, builder, signature, args)
            fma = _multiply_add(builder)
            sums = [[[cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(1 + apart)]
                     for _ in range(num_rows)] for _ in range(num_heads)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                k_offset = builder.mul(loop.index, intp(2 * WORD_VALUES))  # bytes into a K row
                q_offset = builder.mul(loop.index, intp(4 * WORD_VALUES))  # bytes into a query row
                halves = _rows_halves(builder, intp, k_addr, k_step, k_offset, num_rows)
                for i in range(num_heads):
                    base = row_address(builder, intp, q_addr, q_step, i, q_offset)
                    queries = (load_at(builder, base, FLOATS, 4),
                               load_at(builder, builder.add(base, intp(64)), FLOATS, 4))
                    for j in range(num_rows):
                        for half in range(2):
                            total = sums[i][j][half if apart else 0]
                            builder.store(builder.call(fma, [queries[half], halves[j][half], builder.load(total)]),
                                          total)
            vectors = []
            for i in range(num_heads):
                for j in range(num_rows):
                    total = builder.load(sums[i][j][0])
                    vectors.append(builder.fadd(total, builder.load(sums[i][j][1])) if apart else total)
            store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, args[7])
            return context.get_dummy_value()

        integers = (q, q_row, k, k_row, scores, score_row, dim)
        if not (all(isinstance(a, types.Integer) for a in integers) and scale == types.float32):
            return None
        return types.void(*integers, scale), codegen

    return tile


def _word_values_tile(num_heads, num_rows):
    """An intrinsic tile(v, v_row, p, p_row, acc, acc_row, dim), on addresses and row strides in bytes (ints):
    acc[i] += sum_j p[i, j] * v[j] for i < num_heads, j < num_rows, where v holds bfloat16 patterns in rows of
    `dim` (a multiple of WORD_VALUES), p is float32 and acc float32 rows in even/odd order (join_pairs puts them
    back). Each accumulator row is loaded and stored once per tile, and each probability broadcast once."""

    @intrinsic
    def tile(typingctx, v, v_row, p, p_row, acc, acc_row, dim):
        def codegen(context, builder, signature, args):
            intp, (v_addr, v_step, p_addr, p_step, a_addr, a_step, length) = tile_addresses(
                context, builder, signature, args)
            fma = _multiply_add(builder)
            weights = [[splat(builder, load_at(builder, row_address(builder, intp, p_addr, p_step, i, intp(4 * j)),
                                               ir.FloatType(), 4), 16)
                        for j in range(num_rows)] for i in range(num_heads)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                v_offset = builder.mul(loop.index, intp(2 * WORD_VALUES))  # bytes into a V row
                a_offset = builder.mul(loop.index, intp(4 * WORD_VALUES))  # bytes into an accumulator row
                halves = _rows_halves(builder, intp, v_addr, v_step, v_offset, num_rows)
                for i in range(num_heads):
                    base = row_address(builder, intp, a_addr, a_step, i, a_offset)
                    for half in range(2):
                        address = builder.add(base, intp(64 * half))
                        total = load_at(builder, address, FLOATS, 4)
                        for j in range(num_rows):
                            total = builder.call(fma, [weights[i][j], halves[j][half], total])
                        store_at(builder, total, address, 4)
            return context.get_dummy_value()

        integers = (v, v_row, p, p_row, acc, acc_row, dim)
        if not all(isinstance(a, types.Integer) for a in integers):
            return None
        return types.void(*integers), codegen

    return tile


def _row_shuffle(first_half, second_half, doc):
    """An intrinsic shuffle(address, dim) rearranging a float32 row of `dim` values (a multiple of WORD_VALUES) in
    place, 32 at a time: the stretch's two 16-lane vectors a, b become shuffle(a, b, first_half) and shuffle(a, b,
    second_half)."""

    @intrinsic
    def shuffle(typingctx, address, dim):
        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)
            start, length = (context.cast(builder, args[i], signature.args[i], types.intp) for i in range(2))
            masks = [ir.Constant(ir.VectorType(ir.IntType(32), 16), half) for half in (first_half, second_half)]
            with cgutils.for_range(builder, builder.udiv(length, intp(WORD_VALUES))) as loop:
                base = builder.add(start, builder.mul(loop.index, intp(4 * WORD_VALUES)))
                a = load_at(builder, base, FLOATS, 4)
                b = load_at(builder, builder.add(base, intp(64)), FLOATS, 4)
                for half, mask in enumerate(masks):
                    store_at(builder, builder.shuffle_vector(a, b, mask), builder.add(base, intp(64 * half)), 4)
            return context.get_dummy_value()

        if not (isinstance(address, types.Integer) and isinstance(dim, types.Integer)):
            return None
        return types.void(address, dim), codegen

    shuffle.__doc__ = doc
    return shuffle


split_pairs = _row_shuffle(list(range(0, 32, 2)), list(range(1, 32, 2)),
                            "A row into even/odd order: in each stretch of 32, the even-indexed values, then the odd.")
join_pairs = _row_shuffle([w // 2 + (w % 2) * 16 for w in range(16)], [8 + w // 2 + (w % 2) * 16 for w in range(16)],
                           "split_pairs undone.")


# The tiles block_attention.py runs the word path on: scores by (heads x rows), P x V by (heads x rows).
SCORE_TILES = (_word_scores_tile(4, 4), _word_scores_tile(2, 4), _word_scores_tile(1, 4), _word_scores_tile(1, 1))
VALUE_TILES = (_word_values_tile(4, 8), _word_values_tile(2, 8), _word_values_tile(1, 8),
               _word_values_tile(4, 1), _word_values_tile(2, 1), _word_values_tile(1, 1))
