"""AVX-512 BF16 tiles: a block's scores and its P x V from vdpbf16ps on bfloat16 patterns as stored.

32 exact products an instruction and nothing widened. Off by default (kernel_switches.BF16_DOT says why).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_attention.tile_ir import FLOATS, load_at, row_address, store_sums, tile_addresses

BF16_LANES = 32  # bfloat16 values per vdpbf16ps operand: head_dim must be a multiple of this for the bf16 path


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat type, which llvmlite does not name: only ever a bitcast target for 16-bit patterns."""
    null = "0xR0000"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        return "0xR0000"


_BFloat._create_instance()
_HALVES = ir.VectorType(ir.IntType(16), BF16_LANES)  # 32 bfloat16 patterns as loaded
_BFLOATS = ir.VectorType(_BFloat(), BF16_LANES)  # the same bits as vdpbf16ps takes them


def _tile_setup(context, builder, signature, args):
    """What every vdpbf16ps tile's codegen starts from: tile_addresses and the vdpbf16ps intrinsic."""
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS, _BFLOATS, _BFLOATS]),
                                         "llvm.x86.avx512bf16.dpbf16ps.512")
    return (*tile_addresses(context, builder, signature, args), dot)


def _bf16_tile(num_heads, num_rows):
    """An intrinsic tile(q, q_row, k, k_row, scores, score_row, dim, scale), on addresses and row strides in bytes
    (ints): scores[i, j] = scale * q[i] . k[j] for i < num_heads, j < num_rows, where q and k hold uint16 bfloat16
    patterns, rows of `dim` values (a multiple of BF16_LANES), and scores float32. Every 32-value stretch of a
    query row and a K row is one vdpbf16ps into a float32 accumulator per (head, row): exact products, float32
    sums, the widening path's in another order."""

    @intrinsic
    def tile(typingctx, q, q_row, k, k_row, scores, score_row, dim, scale):
        def codegen(context, builder, signature, args):
            intp, (q_addr, q_step, k_addr, k_step, s_addr, s_step, length), dot = _tile_setup(
                context, builder, signature, args)
            sums = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(num_rows)]
                    for _ in range(num_heads)]

            def load(start, step, row, offset):
                return builder.bitcast(load_at(builder, row_address(builder, intp, start, step, row, offset), _HALVES, 2),
                                       _BFLOATS)

            with cgutils.for_range(builder, builder.udiv(length, intp(BF16_LANES))) as loop:
                offset = builder.mul(loop.index, intp(2 * BF16_LANES))  # bytes
                qs = [load(q_addr, q_step, i, offset) for i in range(num_heads)]
                ks = [load(k_addr, k_step, j, offset) for j in range(num_rows)]
                for i in range(num_heads):
                    for j in range(num_rows):
                        builder.store(builder.call(dot, [builder.load(sums[i][j]), qs[i], ks[j]]), sums[i][j])
            vectors = [builder.load(sums[i][j]) for i in range(num_heads) for j in range(num_rows)]
            store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, args[7])
            return context.get_dummy_value()

        integers = (q, q_row, k, k_row, scores, score_row, dim)
        if not (all(isinstance(a, types.Integer) for a in integers) and scale == types.float32):
            return None
        return types.void(q, q_row, k, k_row, scores, score_row, dim, scale), codegen

    return tile


def _bf16_values_tile(num_heads, num_rows):
    """An intrinsic tile(v, v_row, p, p_row, acc, acc_row, dim), on addresses and row strides in bytes (ints):
    acc[i] += sum_j p[i, j] * v[j] for i < num_heads, j < num_rows, where v holds uint16 bfloat16 patterns (rows
    of `dim` values, a multiple of BF16_LANES), p and acc float32.

    vdpbf16ps multiplies pairs: two V rows are interleaved value by value (one shuffle per 32 values), and their
    probabilities, rounded to bfloat16 (as flash-attention rounds P), are broadcast as one pair; an odd last row
    pairs with zeros. Eight rows a tile: each accumulator row is loaded and stored once per eight V rows."""

    @intrinsic
    def tile(typingctx, v, v_row, p, p_row, acc, acc_row, dim):
        def codegen(context, builder, signature, args):
            intp, (v_addr, v_step, p_addr, p_step, a_addr, a_step, length), dot = _tile_setup(
                context, builder, signature, args)
            i32 = ir.IntType(32)
            pairs = (num_rows + 1) // 2
            weights = []  # [head][pair]: the pair's two probabilities in bfloat16, in every lane
            for i in range(num_heads):
                row = builder.add(p_addr, builder.mul(p_step, intp(i)))
                weights.append([])
                for k in range(pairs):
                    pair = ir.Constant(ir.VectorType(_BFloat(), 2), None)
                    for r in range(2):
                        if 2 * k + r < num_rows:
                            value = load_at(builder, builder.add(row, intp(4 * (2 * k + r))), ir.FloatType(), 4)
                            pair = builder.insert_element(pair, builder.fptrunc(value, _BFloat()), i32(r))
                    bits = builder.bitcast(pair, i32)
                    splat = builder.insert_element(ir.Constant(ir.VectorType(i32, 16), None), bits, i32(0))
                    splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(i32, 16), [0] * 16))
                    weights[i].append(builder.bitcast(splat, _BFLOATS))
            low = ir.Constant(ir.VectorType(i32, BF16_LANES), [w // 2 + (w % 2) * BF16_LANES for w in range(BF16_LANES)])
            high = ir.Constant(ir.VectorType(i32, BF16_LANES), [16 + w // 2 + (w % 2) * BF16_LANES for w in range(BF16_LANES)])
            zeros = ir.Constant(_HALVES, None)
            with cgutils.for_range(builder, builder.udiv(length, intp(BF16_LANES))) as loop:
                offset = builder.mul(loop.index, intp(2 * BF16_LANES))  # bytes into a V row
                rows = [load_at(builder, row_address(builder, intp, v_addr, v_step, j, offset), _HALVES, 2)
                        for j in range(num_rows)]
                # Values 0-15 of the pair's rows interleaved, then values 16-31: the float32 lanes stay in order.
                mixed = []
                for k in range(pairs):
                    first, second = rows[2 * k], rows[2 * k + 1] if 2 * k + 1 < num_rows else zeros
                    mixed.append((builder.bitcast(builder.shuffle_vector(first, second, low), _BFLOATS),
                                  builder.bitcast(builder.shuffle_vector(first, second, high), _BFLOATS)))
                for i in range(num_heads):
                    base = row_address(builder, intp, a_addr, a_step, i, builder.add(offset, offset))
                    halves_at = [builder.inttoptr(address, FLOATS.as_pointer())
                                 for address in (base, builder.add(base, intp(64)))]
                    for h in range(2):
                        total = builder.load(halves_at[h], align=4)
                        for k in range(pairs):
                            total = builder.call(dot, [total, weights[i][k], mixed[k][h]])
                        builder.store(total, halves_at[h], align=4)
            return context.get_dummy_value()

        if not all(isinstance(a, types.Integer) for a in (v, v_row, p, p_row, acc, acc_row, dim)):
            return None
        return types.void(v, v_row, p, p_row, acc, acc_row, dim), codegen

    return tile


_vtile_4x8, _vtile_2x8, _vtile_1x8 = _bf16_values_tile(4, 8), _bf16_values_tile(2, 8), _bf16_values_tile(1, 8)


# The tiles block_attention.py runs the vdpbf16ps path on: scores by (heads x rows), P x V by (heads x rows).
SCORE_TILES = (_bf16_tile(4, 4), _bf16_tile(2, 4), _bf16_tile(1, 4), _bf16_tile(1, 1))
VALUE_TILES = (_bf16_values_tile(4, 8), _bf16_values_tile(2, 8), _bf16_values_tile(1, 8),
               _bf16_values_tile(4, 1), _bf16_values_tile(2, 1), _bf16_values_tile(1, 1))
