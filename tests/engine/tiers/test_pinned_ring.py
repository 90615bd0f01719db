"""The pinned ring hands out disjoint regions, reuses the oldest only once it is done, and never grows."""
from concurrent.futures import Future

import torch

from offload_engine.engine.tiers.pinned_ring import ALIGN, PinnedRing


def _done() -> Future:
    future = Future()
    future.set_result(None)
    return future


def test_regions_are_disjoint_and_wrap_around_once_the_oldest_is_done():
    ring = PinnedRing(nbytes=8 * ALIGN, pin=False)
    first, r1 = ring.take((3 * ALIGN,), torch.uint8)
    second, r2 = ring.take((3 * ALIGN,), torch.uint8)
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == 3 * ALIGN  # no overlap: writing the second left the first alone
    pending = Future()
    ring.busy_until(r1, pending)
    ring.busy_until(r2, _done())
    # 2 regions of 3 leave 2 at the end: a region of 3 must wrap to the front, where the first still is.
    waited = []
    pending.add_done_callback(lambda _: waited.append(True))
    import threading

    threading.Timer(0.05, pending.set_result, args=(None,)).start()
    third, _ = ring.take((3 * ALIGN,), torch.uint8)
    assert waited and third.data_ptr() == first.data_ptr()  # it waited for the oldest, then reused its bytes
    assert ring.buffer.numel() == 8 * ALIGN


def test_a_request_larger_than_the_ring_gets_its_own_tensor():
    ring = PinnedRing(nbytes=4 * ALIGN, pin=False)
    big, region = ring.take((2, 4 * ALIGN), torch.float32)
    assert region is None and big.shape == (2, 4 * ALIGN) and not ring.regions


def test_typed_views_keep_their_shape():
    ring = PinnedRing(nbytes=64 * ALIGN, pin=False)
    k, _ = ring.take((2, 5, 3, 7), torch.bfloat16)
    assert k.shape == (2, 5, 3, 7) and k.dtype == torch.bfloat16 and k.is_contiguous()
