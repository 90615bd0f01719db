"""Which code paths the host kernels compile, read once from the CPU and the environment.

Each switch is frozen into the compiled kernels. numba keys its cache on the CPU, not on these, so
numba_cache.py files compiled kernels under cache_tag(): a process that sets a switch gets kernels of its own.
"""
import os
import platform
import sys


def host_has_bf16_dot() -> bool:
    """Whether this CPU has vdpbf16ps (AVX-512 BF16: Sapphire Rapids and later Xeons, Zen 4 and later)."""
    import llvmlite.binding as llvm

    return platform.machine().lower() in ("x86_64", "amd64") and bool(llvm.get_host_cpu_features().get("avx512bf16"))


def _use_bf16_dot() -> bool:
    """Whether bfloat16 caches take the vdpbf16ps path: only where OFFLOAD_ENGINE_BF16_DOT=1 and the CPU has it.
    Off by default: with items of whole block-heads, widening led it inside the host lane, and the word tiles beat
    widening (docs/decisions/host-kernel.md, "vdpbf16ps, off by default")."""
    return os.environ.get("OFFLOAD_ENGINE_BF16_DOT", "0") == "1" and host_has_bf16_dot()


BF16_DOT = _use_bf16_dot()

# The word tiles (word_tiles.py): bfloat16 caches read as 32-bit words, two values a lane; value by value otherwise.
WORD_TILES = sys.byteorder == "little" and os.environ.get("OFFLOAD_ENGINE_WORD_TILES", "1") != "0"


def cache_tag() -> str:
    """The switches as a cache subdirectory name."""
    return f"words{int(WORD_TILES)}-bf16dot{int(BF16_DOT)}"
