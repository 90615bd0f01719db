"""Gates between a CUDA stream and a host thread: 32-bit flags in pinned memory that the stream writes or waits on.

cuStreamWriteValue32 / cuStreamWaitValue32 (v2 entry points, CUDA >= 11.7) are queued and captured into graphs like
kernels, so a graph hands work to the host and waits for its answer with no launch. A write follows every earlier
operation of the stream, its copies to host memory included (WRITE_DEFAULT puts a memory barrier first); a wait
holds back every later operation until the flag is >= value.
"""
import ctypes

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
_driver = None


def _lib():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _checked(code: int, what: str) -> None:
    if code:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({code})")


def open_gate(address: int, value: int = 1) -> None:
    """Queues, on the current CUDA stream, the write of `value` to the int32 at `address` (pinned host memory)."""
    stream = torch.cuda.current_stream().cuda_stream
    _checked(_lib().cuStreamWriteValue32_v2(stream, address, value, WRITE_DEFAULT), "cuStreamWriteValue32")


def wait_gate(address: int, value: int = 1) -> None:
    """Queues, on the current CUDA stream, a wait until the int32 at `address` is >= `value`."""
    stream = torch.cuda.current_stream().cuda_stream
    _checked(_lib().cuStreamWaitValue32_v2(stream, address, value, WAIT_GEQ), "cuStreamWaitValue32")
