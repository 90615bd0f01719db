"""The runner's AttentionMetadata is exactly docs/design.md's table ("The dual maps"): one set of maps per tier, the
other masked."""
import torch

from offload_engine.engine.runner.step_inputs import StepInputBuilder
from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE


def _placed(num_tokens, location, block_table, computed):
    seq = Sequence(list(range(1, num_tokens + 1)), SamplingParams(), budget=num_tokens + 8)
    seq.location, seq.block_table, seq.num_computed_tokens = location, block_table, computed
    seq.num_scheduled_tokens = num_tokens - computed
    return seq


def test_decode_maps_mask_the_other_tier():
    builder = StepInputBuilder(torch.device(TEST_DEVICE), block_size=4, cpu_block_size=8)
    gpu_seq = _placed(6, BlockLocation.GPU, [5, 2], computed=5)  # newest token at position 5
    cpu_seq = _placed(9, BlockLocation.CPU, [7, 3], computed=8)  # newest token at position 8
    meta = builder.decode([gpu_seq, cpu_seq]).meta
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, -1]
    assert meta.slot_mapping_cpu.tolist() == [-1, 3 * 8 + 0]
    assert meta.context_lens.tolist() == [6, 0]
    assert meta.context_lens_cpu.tolist() == [0, 9]
    assert meta.block_tables.tolist() == [[5, 2], [-1, -1]]
    assert meta.block_tables_cpu.tolist() == [[-1, -1], [7, 3]]
    assert meta.context_lens.dtype == meta.block_tables.dtype == meta.block_tables_cpu.dtype == torch.int32
    assert meta.has_gpu_rows and meta.has_cpu_rows and not meta.is_prefill
    # The device tier's maps are on the device; the host tier's are built on the host and stay there.
    assert {t.device.type for t in (meta.slot_mapping, meta.context_lens, meta.block_tables)} == {TEST_DEVICE}
    assert {t.device.type for t in (meta.slot_mapping_cpu, meta.context_lens_cpu, meta.block_tables_cpu)} == {"cpu"}


def test_prefill_maps_and_prefix_staging_for_host_rows():
    builder = StepInputBuilder(torch.device(TEST_DEVICE), block_size=4, cpu_block_size=4)
    gpu_seq = _placed(3, BlockLocation.GPU, [9], computed=0)
    cpu_seq = _placed(7, BlockLocation.CPU, [6, 1], computed=5)  # prefix 0..4 cached, chunk = positions 5, 6
    step = builder.prefill([gpu_seq, cpu_seq])
    meta = step.meta
    assert step.positions.tolist() == [0, 1, 2, 5, 6]
    assert step.sample_rows.tolist() == [2, 4]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 5] and meta.max_seqlen_q == 3
    assert meta.slot_mapping.tolist() == [36, 37, 38, -1, -1]
    assert meta.slot_mapping_cpu.tolist() == [-1, -1, -1, 1 * 4 + 1, 1 * 4 + 2]
    assert meta.context_lens.tolist() == [3, 0] and meta.context_lens_cpu.tolist() == [0, 7]
    staging = meta.staging
    # Both host blocks hold prefix tokens, so both are staged, in order, as staging blocks 0 and 1.
    assert staging.source_blocks.tolist() == [6, 1] and staging.num_blocks == 2
    assert staging.block_tables.tolist() == [[-1, -1], [0, 1]]
    assert staging.slot_mapping.tolist() == [-1, -1, -1, 5, 6]
    assert staging.context_lens.tolist() == [0, 7]
    assert staging.host_token_indices.tolist() == [3, 4] and staging.host_token_slots.tolist() == [5, 6]
    # The staging cache is a device cache; the host pool's own blocks and slots are read and written on the host.
    assert {t.device.type for t in (staging.block_tables, staging.slot_mapping, staging.context_lens,
                                    staging.host_token_indices)} == {TEST_DEVICE}
    assert {t.device.type for t in (staging.source_blocks, staging.host_token_slots)} == {"cpu"}


def _split(num_tokens, device_prefix, device_tokens, host_table, computed):
    seq = _placed(num_tokens, BlockLocation.CPU, host_table, computed)
    seq.device_prefix, seq.num_device_tokens = device_prefix, device_tokens
    return seq


def test_decode_maps_of_a_split_row_fill_both_tiers():
    builder = StepInputBuilder(torch.device(TEST_DEVICE), block_size=4, cpu_block_size=8)
    gpu_seq = _placed(6, BlockLocation.GPU, [5, 2], computed=5)
    # 8 tokens on the device (blocks 4, 0), the rest on the host from token 8: the newest (13) is host token 5.
    split = _split(14, [4, 0], 8, [6], computed=13)
    meta = builder.decode([gpu_seq, split]).meta
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, -1]
    assert meta.slot_mapping_cpu.tolist() == [-1, 6 * 8 + 5]
    assert meta.context_lens.tolist() == [6, 8] and meta.context_lens_cpu.tolist() == [0, 6]
    assert meta.block_tables.tolist() == [[5, 2], [4, 0]]
    assert meta.block_tables_cpu.tolist() == [[-1], [6]]
    assert meta.has_gpu_rows and meta.has_cpu_rows


def test_prefill_maps_of_a_split_row_by_chunk():
    """A chunk inside the device part is a device row; one past it is staged with the device part gathered
    from the device pool; one across the boundary writes each token into its own tier."""
    builder = StepInputBuilder(torch.device(TEST_DEVICE), block_size=4, cpu_block_size=8)
    inside = _split(6, [4, 0], 8, [], computed=0)  # prompt tokens 0..5, all in the device part
    meta = builder.prefill([inside]).meta
    assert meta.slot_mapping.tolist() == [16, 17, 18, 19, 0, 1]
    assert meta.slot_mapping_cpu.tolist() == [-1] * 6
    assert meta.context_lens.tolist() == [6] and meta.has_gpu_rows and not meta.has_cpu_rows

    across = _split(19, [4, 0], 8, [6, 3], computed=6)  # chunk = tokens 6..18: 6, 7 on the device, 8.. on the host
    meta = builder.prefill([across]).meta
    assert meta.slot_mapping.tolist() == [2, 3] + [-1] * 11
    assert meta.slot_mapping_cpu.tolist() == [-1, -1] + [6 * 8 + i for i in range(8)] + [3 * 8 + i for i in range(3)]
    assert meta.context_lens.tolist() == [0] and meta.has_gpu_rows and meta.has_cpu_rows
    staging = meta.staging
    # No host prefix yet; staging block 0 is the device part (device blocks 4, 0), then two chunk blocks.
    assert staging.source_blocks.tolist() == [] and staging.device_source_blocks.tolist() == [4, 0]
    assert staging.num_blocks == 3 and staging.block_tables.tolist() == [[0, 1, 2]]
    assert staging.slot_mapping.tolist() == list(range(6, 19)) and staging.context_lens.tolist() == [19]
    assert staging.host_token_indices.tolist() == list(range(2, 13))

    past = _split(21, [4, 0], 8, [6, 3], computed=19)  # host prefix: host tokens 0..10 in host blocks 6, 3
    meta = builder.prefill([past]).meta
    assert meta.slot_mapping.tolist() == [-1, -1] and meta.slot_mapping_cpu.tolist() == [3 * 8 + 3, 3 * 8 + 4]
    staging = meta.staging
    assert staging.source_blocks.tolist() == [6, 3] and staging.device_source_blocks.tolist() == [4, 0]
    # Staging blocks: host prefix 0, 1; device part 2; the row's table is in token order: 2, 0, 1.
    assert staging.num_blocks == 3 and staging.block_tables.tolist() == [[2, 0, 1]]
    assert staging.slot_mapping.tolist() == [1 * 8 + 3, 1 * 8 + 4]
    assert not meta.has_gpu_rows and staging.host_token_indices is None


def test_a_streamed_share_leaves_the_cpu_maps_and_gets_its_own():
    """Row 0 streams its first 2 host blocks: the CPU kernel's table starts after them and its context is shorter;
    the streamed maps list them in staging order. Row 1 streams none; row 2 is split and streams 1."""
    builder = StepInputBuilder(torch.device(TEST_DEVICE), block_size=4, cpu_block_size=8)
    host = _placed(30, BlockLocation.CPU, [7, 3, 9, 4], computed=29)  # newest token at 29: block 3, offset 5
    short = _placed(9, BlockLocation.CPU, [5, 6], computed=8)
    split = _placed(28, BlockLocation.CPU, [2, 8], computed=27)
    split.device_prefix, split.num_device_tokens = [1, 0, 11], 12  # host part: tokens 12..27
    meta = builder.decode([host, short, split], streamed=[2, 0, 1]).meta
    assert meta.slot_mapping_cpu.tolist() == [4 * 8 + 5, 6 * 8 + 0, 8 * 8 + 7]  # slots are the rows' own
    assert meta.context_lens_cpu.tolist() == [30 - 16, 9, 16 - 8]
    assert meta.block_tables_cpu.tolist() == [[9, 4], [5, 6], [8, -1]]
    streamed = meta.streamed
    assert streamed.source_blocks.tolist() == [7, 3, 2] and streamed.count.tolist() == [3]
    assert streamed.block_tables.tolist() == [[0, 1], [-1, -1], [2, -1]]
    assert streamed.context_lens.tolist() == [16, 0, 8] and streamed.num_blocks == 3
    assert meta.context_lens.tolist() == [0, 0, 12]  # the split row's device part, as without streaming
    assert builder.decode([host, short, split], streamed=[0, 0, 0]).meta.streamed is None
