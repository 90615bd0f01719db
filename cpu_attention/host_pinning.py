"""Page-locks a host range for the GPU's copy engines: in chunks, on worker threads, through the driver API.

Not `cudaHostRegister` through torch: a failed runtime call leaves its error for torch to report at the thread's
next kernel launch, where a driver call (libcuda through ctypes) returns it and leaves nothing behind. Chunks on
several threads, because one call locks its range page by page. A failure unregisters every chunk that had
succeeded and names the CUDA error (docs/decisions/host-kernel.md, "Pinning through the driver API, in chunks").
"""
import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor

CHUNK_BYTES = 1 << 30
MAX_THREADS = 8
_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: page-locked for every context, whichever device copies


class CudaDriver:
    """The few libcuda entry points pinning needs, each returning the CUresult as an int."""

    def __init__(self):
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise OSError(f"cannot load the CUDA driver (libcuda.so.1) to pin the host KV pool: {error}") from error
        lib = self._lib
        self._register = _symbol(lib, "cuMemHostRegister_v2", "cuMemHostRegister")
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._release_context = _symbol(lib, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def primary_context(self, device_index: int) -> int:
        """Retains the device's primary context (the one torch uses) and returns its handle."""
        device, context = ctypes.c_int(), ctypes.c_void_p()
        for code in (self._lib.cuInit(0), self._lib.cuDeviceGet(ctypes.byref(device), device_index),
                     self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)):
            if code:
                raise OSError(f"CUDA driver could not open device {device_index}: {self.describe(code)}")
        return context.value

    def release_context(self, device_index: int) -> None:
        self._release_context(device_index)

    def use_context(self, context: int) -> int:
        return self._lib.cuCtxSetCurrent(context)

    def can_use_host_pointer(self, device_index: int) -> bool:
        """Whether kernels on the device may address registered host memory by its host pointer
        (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)."""
        value = ctypes.c_int()
        return self._lib.cuDeviceGetAttribute(ctypes.byref(value), 91, device_index) == 0 and value.value == 1

    def register(self, ptr: int, nbytes: int) -> int:
        return self._register(ptr, nbytes, _PORTABLE)

    def unregister(self, ptr: int) -> int:
        return self._lib.cuMemHostUnregister(ptr)

    def describe(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.cuGetErrorName(code, ctypes.byref(name))
        self._lib.cuGetErrorString(code, ctypes.byref(text))
        return f"{(name.value or b'CUDA error %d' % code).decode()} ({(text.value or b'').decode()})"


def _symbol(lib, *names):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise OSError(f"the CUDA driver has none of {names}: update the NVIDIA driver")


class HostPinning:
    """Registers [ptr, ptr + nbytes) in chunks, starting at once on worker threads.

    wait() blocks until every chunk is registered (raising OSError, with nothing left registered, if one
    failed); release() unregisters what was registered. Both are safe to call more than once.
    """

    def __init__(self, ptr: int, nbytes: int, device_index: int, driver=None, chunk_bytes: int = CHUNK_BYTES):
        self.driver = driver or CudaDriver()
        self.nbytes, self.device_index = nbytes, device_index
        self.context = self.driver.primary_context(device_index)
        self.chunks = [(ptr + start, min(chunk_bytes, nbytes - start)) for start in range(0, nbytes, chunk_bytes)]
        self.registered: list[int] = []
        self.seconds = 0.0
        self._started = time.perf_counter()
        threads = max(1, min(MAX_THREADS, len(self.chunks), os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pin-host",
                                        initializer=self.driver.use_context, initargs=(self.context,))
        self._results = [self._pool.submit(self.driver.register, *chunk) for chunk in self.chunks]
        self._done = False

    def wait(self) -> float:
        """Seconds the registration took, once it has finished."""
        if not self._done:
            self._done = True
            codes = [result.result() for result in self._results]
            self._pool.shutdown()
            self.seconds = time.perf_counter() - self._started
            self.registered = [ptr for (ptr, _), code in zip(self.chunks, codes) if code == 0]
            failed = next((code for code in codes if code), 0)
            if failed:
                self.release()
                raise OSError(f"pinning the host KV pool ({self.nbytes / 2**30:.1f} GiB) failed with "
                              f"{self.driver.describe(failed)}: lower cpu_kv_cache_gb / num_cpu_blocks, or raise "
                              "the locked-memory limit (ulimit -l)")
        return self.seconds

    def release(self) -> None:
        if not self._done:
            try:
                self.wait()
            except OSError:
                return  # wait() has already released what it registered
        for ptr in self.registered:
            self.driver.unregister(ptr)
        if self.context is not None:
            self.driver.release_context(self.device_index)
            self.context = None
        self.registered = []
