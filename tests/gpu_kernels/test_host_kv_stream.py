"""stream_host_blocks copies the first count[0] listed host blocks of one layer, K and V, into their staging places
and writes nothing else; stamp writes the device's nanosecond timer into one clock entry."""
import pytest
import torch

from gpu_kernels import host_kv_stream
from gpu_kernels.host_kv_stream import compile_host_kv_stream, stamp, stream_host_blocks
from tests.conftest import requires_cuda
from tests.reference import on_test_device


def reference(host_layer, blocks, count, staging):
    """A plain loop: staging place i of K and of V takes host block blocks[i], for i < count."""
    staging = staging.clone()
    for i, block in enumerate(blocks.tolist()[:count]):
        for kv in range(2):
            staging[kv, i] = host_layer[kv, block]
    return staging


def random_buffers(num_kv_heads, block, head_dim, dtype, host_blocks=9, capacity=8, seed=0):
    """Random (never zero) host layer and staging: a staging place left alone must keep its exact old value."""
    gen = torch.Generator().manual_seed(seed)
    host_layer = torch.randn((2, host_blocks, num_kv_heads, block, head_dim), generator=gen).to(dtype)
    staging = torch.randn((2, capacity, num_kv_heads, block, head_dim), generator=gen).to(dtype)
    return host_layer, staging, gen


def run(host_layer, blocks, count, staging, **kwargs):
    """The kernel on the test device, its staging brought back to the CPU."""
    host_layer, blocks, count, staging = on_test_device(host_layer, blocks, count, staging)
    stream_host_blocks(host_layer, blocks, count, staging, **kwargs)
    return staging.cpu()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("num_kv_heads,block,head_dim", [(2, 4, 64), (3, 8, 24), (1, 16, 128), (3, 16, 96)])
def test_each_listed_block_lands_in_its_staging_place_and_nothing_else_moves(dtype, num_kv_heads, block, head_dim):
    """Shapes: one chunk a block (even and masked), whole chunks, and two chunks the last one masked (3 x 16 x 96)."""
    host_layer, staging, gen = random_buffers(num_kv_heads, block, head_dim, dtype)
    # Scattered block ids, one repeated, count short of the capacity: places 5.. keep their random contents.
    blocks = torch.cat([torch.randperm(9, generator=gen)[:4], torch.tensor([2]), torch.randint(0, 9, (3,))])
    blocks[1] = 2
    count = torch.tensor([5], dtype=torch.int32)
    want = reference(host_layer, blocks, 5, staging)
    assert torch.equal(run(host_layer, blocks, count, staging, programs=3), want)  # fewer programs than units


@pytest.mark.parametrize("count_dtype", (torch.int32, torch.int64))
def test_a_full_staging_buffer_and_the_default_programs(count_dtype):
    host_layer, staging, gen = random_buffers(2, 8, 16, torch.bfloat16, capacity=6)
    blocks = torch.randint(0, 9, (6,), generator=gen)
    want = reference(host_layer, blocks, 6, staging)
    assert torch.equal(run(host_layer, blocks, torch.tensor([6], dtype=count_dtype), staging), want)


def test_count_zero_writes_nothing():
    host_layer, staging, gen = random_buffers(2, 4, 24, torch.float16)
    blocks = torch.randint(0, 9, (8,), generator=gen)
    assert torch.equal(run(host_layer, blocks, torch.zeros(1, dtype=torch.int64), staging), staging)


def test_start_up_launch_copies_nothing_and_leaves_count_zero(monkeypatch):
    """compile_host_kv_stream launches over no blocks: staging is unchanged, count reads 0, and a later copy on
    these buffers compiles nothing (on CUDA, where Triton compiles)."""
    host_layer, staging, gen = random_buffers(2, 8, 16, torch.bfloat16)
    blocks = torch.randint(0, 9, (8,), generator=gen)
    want = staging.clone()
    host_layer, staging, blocks, count = on_test_device(host_layer, staging, blocks, torch.tensor([4]))
    compile_host_kv_stream(host_layer, staging, blocks, count)
    assert torch.equal(staging.cpu(), want) and count.item() == 0
    if staging.is_cuda:
        def compile_again(*args, **kwargs):
            raise AssertionError("a copy compiled the stream kernel again")
        monkeypatch.setattr(host_kv_stream._stream_kernel, "_do_compile", compile_again)
    count.fill_(3)
    stream_host_blocks(host_layer, blocks, count, staging)
    assert torch.equal(staging.cpu(), reference(host_layer.cpu(), blocks.cpu(), 3, want))


def test_bad_arguments_are_refused_naming_the_argument():
    host_layer, staging, _ = random_buffers(2, 4, 16, torch.float32, capacity=4)
    blocks, count = torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    cases = [
        ("host_layer must be", dict(host_layer=host_layer[:1])),
        ("host_layer must be", dict(host_layer=host_layer.transpose(3, 4))),
        ("staging must be", dict(staging=torch.randn(2, 4, 2, 4, 8))),
        ("staging must be", dict(staging=staging.transpose(1, 2))),
        ("staging must have host_layer's dtype", dict(staging=staging.half())),
        ("blocks must be", dict(blocks=blocks.int())),
        ("blocks must be", dict(blocks=blocks[:3])),
        ("count must be", dict(count=count.float())),
        ("count must be", dict(count=torch.zeros(2, dtype=torch.int32))),
    ]
    for message, change in cases:
        args = dict(host_layer=host_layer, blocks=blocks, count=count, staging=staging) | change
        with pytest.raises(ValueError, match=message):
            stream_host_blocks(**args)


def test_stamp_refuses_a_cpu_clock():
    with pytest.raises(ValueError, match="stamp needs a CUDA tensor"):
        stamp(torch.zeros(2, dtype=torch.int64), 0)


@requires_cuda
def test_two_stamps_around_an_op_read_positive_non_decreasing_nanoseconds():
    clock = torch.zeros(2, dtype=torch.int64, device="cuda")
    x = torch.randn(1 << 20, device="cuda")
    stamp(clock, 0)
    x.mul_(2)
    stamp(clock, 1)
    first, second = clock.tolist()
    assert 0 < first <= second
