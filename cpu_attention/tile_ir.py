"""LLVM IR that the tile kernels (bf16_dot_tiles.py, word_tiles.py) are built from, and a vector max. Tiles take
addresses and row strides in bytes, not arrays (docs/decisions/host-kernel.md, "Tiles on addresses").
"""
import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

FLOATS = ir.VectorType(ir.FloatType(), 16)  # 16 float32 lanes: an AVX-512 register


def tile_addresses(context, builder, signature, args):
    """LLVM's intp and a tile's seven integer arguments as intp (addresses, row strides in bytes, dim)."""
    return context.get_value_type(types.intp), [context.cast(builder, args[i], signature.args[i], types.intp)
                                                for i in range(7)]


def row_address(builder, intp, start, step, row, offset):
    """The byte address `offset` into row `row` of rows `step` bytes apart from `start` (all LLVM intp)."""
    return builder.add(builder.add(start, builder.mul(step, intp(row))), offset)


def load_at(builder, address, kind, align):
    return builder.load(builder.inttoptr(address, kind.as_pointer()), align=align)


def store_at(builder, value, address, align):
    builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=align)


def splat(builder, value, count):
    """<count x float> with every lane `value`."""
    vector = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), count), None), value, ir.IntType(32)(0))
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(ir.IntType(32), count), [0] * count))


def reduce_across(builder, vectors):
    """Sums each of n <16 x float> vectors (n a power of two <= 16) into one vector of 16 lanes: returns (vector,
    owner), owner[lane] = which input's total the lane holds (every input owns at least one lane). Each step adds
    pairs of vectors after two shuffles that put two inputs' partial sums side by side: 15 adds and 30 shuffles for
    16 inputs, where one horizontal sum each takes 64 of each (more than a 4 x 4 tile's products)."""
    index = lambda values: ir.Constant(ir.VectorType(ir.IntType(32), 16), values)
    owners = [[k] * 16 for k in range(len(vectors))]
    half = 8
    while half >= 1:
        paired = len(vectors) > 1
        nxt, nxt_owners = [], []
        for m in range(0, len(vectors), 2 if paired else 1):
            a, b = vectors[m], vectors[m + 1] if paired else vectors[m]
            oa, ob = owners[m], owners[m + 1] if paired else owners[m]
            lo, hi, owner = [], [], []
            for p in range(16):
                first = (p // half) % 2 == 0 or not paired
                lane = (p // (2 * half)) * 2 * half + p % half
                offset = 0 if first else 16
                lo.append(lane + offset)
                hi.append(lane + half + offset)
                owner.append((oa if first else ob)[lane])
            nxt.append(builder.fadd(builder.shuffle_vector(a, b, index(lo)), builder.shuffle_vector(a, b, index(hi))))
            nxt_owners.append(owner)
        vectors, owners = nxt, nxt_owners
        half //= 2
    return vectors[0], owners[0]


def store_sums(builder, intp, vectors, num_heads, num_rows, s_addr, s_step, scale):
    """scores[i, j] = scale (an LLVM float) times the total of vectors[i * num_rows + j], rows of num_rows float32
    at s_addr + i * s_step: one reduce_across for the whole tile, then one store a head."""
    lanes, owner = reduce_across(builder, vectors)
    lanes = builder.fmul(lanes, splat(builder, scale, 16))
    for i in range(num_heads):
        address = builder.add(s_addr, builder.mul(s_step, intp(i)))
        if num_rows == 1:
            value = builder.extract_element(lanes, ir.IntType(32)(owner.index(i)))
            builder.store(value, builder.inttoptr(address, ir.FloatType().as_pointer()))
            continue
        row = builder.shuffle_vector(lanes, lanes, ir.Constant(
            ir.VectorType(ir.IntType(32), num_rows), [owner.index(i * num_rows + j) for j in range(num_rows)]))
        builder.store(row, builder.inttoptr(address, ir.VectorType(ir.FloatType(), num_rows).as_pointer()), align=4)


@intrinsic
def max_of(typingctx, address, count):
    """The largest of `count` float32 values at `address` (count >= 1, none NaN), 16 lanes at a time: numba's max()
    does not vectorize as a reduction, and a scalar chain of compares costs as much as a tile's dot products."""
    if not (isinstance(address, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        start, length = (context.cast(builder, args[i], signature.args[i], types.intp) for i in range(2))

        def larger(a, b):
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        top = cgutils.alloca_once_value(builder, splat(builder, ir.Constant(ir.FloatType(), -math.inf), 16))
        whole = builder.udiv(length, intp(16))
        with cgutils.for_range(builder, whole) as loop:
            vector = load_at(builder, builder.add(start, builder.mul(loop.index, intp(64))), FLOATS, 4)
            builder.store(larger(vector, builder.load(top)), top)
        vector = builder.load(top)
        for half in (8, 4, 2, 1):
            rotated = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                                          [(p + half) % 16 for p in range(16)]))
            vector = larger(rotated, vector)
        best = cgutils.alloca_once_value(builder, builder.extract_element(vector, ir.IntType(32)(0)))
        with cgutils.for_range_slice(builder, builder.mul(whole, intp(16)), length, intp(1)) as (index, _):
            value = load_at(builder, builder.add(start, builder.mul(index, intp(4))), ir.FloatType(), 4)
            builder.store(larger(value, builder.load(best)), best)
        return builder.load(best)

    return types.float32(address, count), codegen
