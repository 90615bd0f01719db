"""Pinning the host pool: chunks on worker threads; a failure names the CUDA error and leaves nothing pinned."""
import mmap

import pytest
import torch

from cpu_attention.host_pinning import HostPinning
from cpu_attention.kv_pool import HostKVPool
from tests.conftest import TEST_DEVICE

ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED


class FakeDriver:
    """Records what is registered; fails the chunk that starts at `fail_at`."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.pinned: set[int] = set()
        self.contexts = 0
        self.threads_bound = 0

    def primary_context(self, device_index):
        self.contexts += 1
        return 1234

    def release_context(self, device_index):
        self.contexts -= 1

    def use_context(self, context):
        assert context == 1234
        self.threads_bound += 1
        return 0

    def register(self, ptr, nbytes):
        if ptr == self.fail_at:
            return ALREADY_REGISTERED
        assert ptr not in self.pinned
        self.pinned.add(ptr)
        return 0

    def unregister(self, ptr):
        self.pinned.remove(ptr)
        return 0

    def describe(self, code):
        return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (part or all of the range is already registered)"


def test_every_chunk_is_registered_and_released():
    driver = FakeDriver()
    pinning = HostPinning(ptr=4096, nbytes=10_000, device_index=0, driver=driver, chunk_bytes=1024)
    pinning.wait()
    assert driver.pinned == {4096 + 1024 * i for i in range(10)} and driver.threads_bound >= 1
    pinning.release()
    pinning.release()
    assert driver.pinned == set() and driver.contexts == 0


def test_a_failed_chunk_names_the_error_and_unpins_the_others():
    driver = FakeDriver(fail_at=4096 + 5 * 1024)
    pinning = HostPinning(ptr=4096, nbytes=10_000, device_index=0, driver=driver, chunk_bytes=1024)
    with pytest.raises(OSError, match="CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.*lower cpu_kv_cache_gb"):
        pinning.wait()
    assert driver.pinned == set() and driver.contexts == 0
    pinning.release()  # still safe
    assert driver.pinned == set() and driver.contexts == 0


def test_pool_layers_are_disjoint_views_that_outlive_close():
    pool = HostKVPool(num_layers=3, num_blocks=5, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.bfloat16)
    for i, (k, v) in enumerate(pool.layers):
        assert k.shape == v.shape == (5, 2, 4, 8) and k.is_contiguous() and k.dtype == torch.bfloat16
        k.fill_(2 * i)
        v.fill_(2 * i + 1)
    assert [(float(k.float().mean()), float(v.float().mean())) for k, v in pool.layers] == [(0, 1), (2, 3), (4, 5)]
    keep = pool.layers[2][1]
    pool.close()
    pool.close()
    assert pool.layers == [] and float(keep.float().mean()) == 5  # a view still held keeps its memory


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs the CUDA driver")
def test_real_driver_failure_leaves_no_error_behind():
    memory = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(memory, dtype=torch.uint8)
    first = HostPinning(host.data_ptr(), host.numel(), torch.cuda.current_device())
    first.wait()
    assert host.is_pinned()
    again = HostPinning(host.data_ptr(), host.numel(), torch.cuda.current_device(), chunk_bytes=1 << 20)
    with pytest.raises(OSError, match="CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"):
        again.wait()
    # No stale error for torch to report at its next launch, and the first registration is intact.
    x = torch.randn(1024, device="cuda")
    assert torch.allclose((x * 2).cpu(), x.cpu() * 2)
    torch.cuda.synchronize()
    assert host.is_pinned()
    first.release()
    assert not host.is_pinned()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs the CUDA driver")
def test_pool_pins_on_cuda_and_unpins_on_close():
    pool = HostKVPool(num_layers=2, num_blocks=64, num_kv_heads=2, block_size=64, head_dim=64, dtype=torch.float16,
                      pin_device=torch.device("cuda"))
    pool.wait_pinned()
    k = pool.layers[1][0]
    assert pool.pinned and k.is_pinned()
    pool.close()
    assert not k.is_pinned()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs the CUDA driver")
def test_device_stacked_is_the_pinned_pool_seen_from_the_device():
    """Kernels read and write the pool itself through device_stacked (promotion reads it, demotion writes it):
    random values written on the host are what a device gather sees, and a device write lands in host memory."""
    pool = HostKVPool(num_layers=3, num_blocks=40, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.bfloat16,
                      pin_device=torch.device("cuda"))
    pool.wait_pinned()
    gen = torch.Generator().manual_seed(3)
    for k, v in pool.layers:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    mapped = pool.device_stacked()
    assert mapped is not None and mapped.is_cuda and mapped.shape == pool.stacked.shape
    blocks = torch.tensor([39, 0, 17], device="cuda")
    for layer, (k, v) in enumerate(pool.layers):
        assert torch.equal(mapped[layer, 0].index_select(0, blocks).cpu(), k[[39, 0, 17]])
        assert torch.equal(mapped[layer, 1].index_select(0, blocks).cpu(), v[[39, 0, 17]])
    mapped[2, 1, 5].fill_(1.5)
    torch.cuda.synchronize()
    assert torch.all(pool.layers[2][1][5] == 1.5) and not torch.any(pool.layers[2][0][5] == 1.5)
    pool.close()
    assert pool.device_stacked() is None
