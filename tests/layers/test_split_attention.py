"""The split attention layer on a mixed decode batch: each row attends on its own tier, in batch order.

The engine's lanes keep decode batches single-tier, but the layer's contract (docs/design.md, "The dual maps")
covers mixed batches too, and prefill batches are mixed; this checks the decode merge path directly, with the
backend the engine picks on TEST_DEVICE (the torch path on the CPU, the Triton kernels on CUDA).
"""
import torch

from cpu_attention import CpuAttentionExecutor
from offload_engine.engine.runner.step_inputs import StepInputBuilder
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.layers.attention import Attention
from offload_engine.layers.attention_backends import select_backend
from offload_engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE
from tests.reference import on_test_device, paged_decode_reference, random_paged_kv, relative_error


def _seq(length, location, table):
    seq = Sequence(list(range(length)), SamplingParams(), budget=length)
    seq.location, seq.block_table, seq.num_computed_tokens = location, table, length - 1
    return seq


def test_mixed_decode_rows_attend_on_their_own_tier():
    heads, kv_heads, dim = 4, 2, 16
    gpu_lens, cpu_lens = [9, 16], [33, 5]
    k_gpu, v_gpu, t_gpu, keys_gpu, values_gpu = random_paged_kv(gpu_lens, kv_heads, dim, 4, torch.float32,
                                                                "token_major", seed=1)
    k_cpu, v_cpu, t_cpu, keys_cpu, values_cpu = random_paged_kv(cpu_lens, kv_heads, dim, 8, torch.float32,
                                                                "head_major", seed=2)
    # Batch order interleaves the tiers: gpu, cpu, gpu, cpu.
    seqs = [_seq(gpu_lens[0], BlockLocation.GPU, t_gpu[0][t_gpu[0] >= 0].tolist()),
            _seq(cpu_lens[0], BlockLocation.CPU, t_cpu[0][t_cpu[0] >= 0].tolist()),
            _seq(gpu_lens[1], BlockLocation.GPU, t_gpu[1][t_gpu[1] >= 0].tolist()),
            _seq(cpu_lens[1], BlockLocation.CPU, t_cpu[1][t_cpu[1] >= 0].tolist())]
    device = torch.device(TEST_DEVICE)
    meta = StepInputBuilder(device, block_size=4, cpu_block_size=8).decode(seqs).meta
    layer = Attention(heads, kv_heads, dim, scale=0.3)
    layer.k_cache, layer.v_cache = on_test_device(k_gpu, v_gpu)
    layer.k_cache_cpu, layer.v_cache_cpu = k_cpu, v_cpu  # the host tier stays on the host
    layer.backend = select_backend("auto", device, 4)
    layer.executor = CpuAttentionExecutor(num_threads=1)
    # The newest token's K/V is written by the layer itself: take it from each sequence's own reference rows.
    keys = [keys_gpu[0], keys_cpu[0], keys_gpu[1], keys_cpu[1]]
    values = [values_gpu[0], values_cpu[0], values_gpu[1], values_cpu[1]]
    q = torch.randn(4, heads, dim)
    out = layer(*on_test_device(q, torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values])), meta)
    out = out.cpu()
    ref, _ = paged_decode_reference(q, keys, values, 0.3)
    assert relative_error(out, ref) < 1e-5
    for row in range(4):  # and row by row, so a swap of two rows cannot hide in the norm
        assert relative_error(out[row], ref[row]) < 1e-5
    layer.executor.shutdown()


def test_staged_prefill_warm_up_runs_the_backend_and_leaves_both_pools_alone():
    """ModelRunner calls this at start-up on CUDA so the staging cache's kernel variants compile then, not in
    the first host-tier prefill. It must run on the backend the engine picks and write nothing into either pool."""
    heads, kv_heads, dim = 4, 2, 16
    k_gpu, v_gpu, _, _, _ = random_paged_kv([9, 16], kv_heads, dim, 4, torch.float32, "token_major", seed=3)
    k_cpu, v_cpu, _, _, _ = random_paged_kv([33, 5], kv_heads, dim, 8, torch.float32, "head_major", seed=4)
    layer = Attention(heads, kv_heads, dim, scale=0.3)
    layer.k_cache, layer.v_cache = on_test_device(k_gpu, v_gpu)
    layer.k_cache_cpu, layer.v_cache_cpu = k_cpu, v_cpu
    layer.backend = select_backend("auto", torch.device(TEST_DEVICE), 4)
    before = [t.clone() for t in (layer.k_cache, layer.v_cache, k_cpu, v_cpu)]
    layer.compile_staged_prefill()
    for old, new in zip(before, (layer.k_cache, layer.v_cache, k_cpu, v_cpu)):
        assert torch.allclose(old, new, rtol=0, atol=0, equal_nan=True)  # unused slots hold NaN
