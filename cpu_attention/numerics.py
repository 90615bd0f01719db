"""Element arithmetic the host kernels inline: 16-bit cache patterns widened to float32, and exp over scores.
bfloat16 arrives as uint16 and float16 as int16 patterns: the element type alone selects the widening.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

# reassoc lets LLVM vectorize the dot-product and sum reductions, contract fuses multiply-adds. No nnan/ninf:
# -inf is a real value here (empty rows, the running max before the first block).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def widen(x):
    """float32 value of one cache element (float32, bfloat16 pattern as uint16, float16 pattern as int16)."""
    raise NotImplementedError  # numba-only: see the overload below


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:  # bfloat16 is the top half of a float32
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if x == types.int16:
        return lambda x: _half_to_float(np.uint32(np.uint16(x)))
    return None


@njit(inline="always", fastmath=FASTMATH)
def _half_to_float(h):
    """float16 bits -> float32 with integer masks only (no per-element branch), so the loop vectorizes. Normals
    rebias the exponent (15 -> 127); inf/nan keep an all-ones exponent; zero and subnormals are m * 2**-24, a
    normal float32 (immune to flush-to-zero modes)."""
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = (h >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = h & np.uint32(0x3FF)
    normal = ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))
    special = np.uint32(0x7F800000) | (mantissa << np.uint32(13))
    small = np.float32(np.float32(mantissa) * np.float32(5.9604644775390625e-08)).view(np.uint32)
    special_mask = np.uint32(0) - np.uint32(exponent == np.uint32(31))
    small_mask = np.uint32(0) - np.uint32(exponent == np.uint32(0))
    bits = (normal & ~special_mask) | (special & special_mask)
    bits = (bits & ~small_mask) | (small & small_mask)
    return np.uint32(bits | sign).view(np.float32)


@njit(inline="always", fastmath=FASTMATH)
def exp_nonpositive(x):
    """exp(x) for x <= 0 (a score minus its running max), vectorizable, relative error ~2e-7: libm's expf is a
    scalar call per score, as dear as the dot product. 2**(x*log2 e) as a power of two from the exponent bits times
    a degree-6 polynomial on [-0.5, 0.5]; below 2**-126 it clamps there, which no sum holding exp(0) = 1 notices."""
    t = max(x * np.float32(1.4426950408889634), np.float32(-126.0))
    n = np.floor(t + np.float32(0.5))
    f = t - n
    p = np.float32(1.5353362e-4)
    p = p * f + np.float32(1.3398874e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022651e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    return np.int32(np.float32(p).view(np.int32) + (np.int32(n) << np.int32(23))).view(np.float32)
