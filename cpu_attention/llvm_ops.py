"""LLVM instructions numba does not expose, as numba intrinsics: cache hints, atomics, the cycle counter. Each
compiles to one or two instructions; nothing here allocates or takes the GIL.
"""
import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, arr, flat_index):
    """Cache hint for arr.ravel()[flat_index] (read, into L2); never faults, so any index is safe."""
    if not isinstance(arr, types.Array) or not isinstance(flat_index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        pointer = builder.bitcast(builder.gep(array.data, [index]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [pointer, i32(0), i32(2), i32(1)])  # locality 2: into L2, L1 stays for the block
        return context.get_dummy_value()

    return types.void(arr, flat_index), codegen


@intrinsic
def atomic_increment(typingctx, counters, index):
    """Atomic counters[index] += 1 with acquire-release order, returning the old value. As a ticket it hands out
    work items; as a tally of finished items, whoever reads the total (with acquire) sees every item's writes."""
    if not (isinstance(counters, types.Array) and counters.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", builder.gep(array.data, [index_value]), one, "acq_rel")

    return types.int64(counters, index), codegen


@intrinsic
def prefer_wide_vectors(typingctx):
    """Lets LLVM vectorize the calling function's loops (and what it inlines) at the full AVX-512 width, where its
    tuning for Intel's AVX-512 server cores prefers 256 bits (docs/decisions/host-kernel.md, "Full AVX-512 width").
    llvmlite's attribute set knows only flag attributes, hence set.add; without AVX-512 it changes nothing."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def load_acquire(typingctx, arr, index):
    """arr[index] read atomically with acquire order: a flag another agent (the GPU's DMA) writes."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int32, types.int64)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        pointer = builder.gep(array.data, [index_value])
        return builder.load_atomic(pointer, "acquire", arr.dtype.bitwidth // 8)

    return arr.dtype(arr, index), codegen


@intrinsic
def store_release(typingctx, arr, index, value):
    """arr[index] = value, atomically with release order: every write before it is visible first."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int32, types.int64)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        index_value = context.cast(builder, args[1], signature.args[1], types.intp)
        stored = context.cast(builder, args[2], signature.args[2], arr.dtype)
        builder.store_atomic(stored, builder.gep(array.data, [index_value]), "release", arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def cycle_counter(typingctx):
    """The CPU's cycle counter (rdtsc on x86, constant-rate): times the loop's waits and kernels from inside the
    native call, where no Python clock can be read."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def spin_pause(typingctx):
    """x86 `pause` in a spin loop (nothing elsewhere): the spinning core yields its pipeline to its sibling
    hyperthread and leaves the loop without a memory-order flush once the flag changes."""

    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen
