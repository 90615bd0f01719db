"""Rank 0's calls cross to the workers as JSON: a worker's copy of each sequence reads as rank 0's did at the call,
though a row carries only what changed since the last (new block-table entries, params once); a value of a type the
wire does not name fails at rank 0, before anything is sent."""
import gc
import random
import time

import pytest
import torch

from offload_engine.distributed.wire import Call, SequenceMirror, SequenceSender, decode_call, encode_call
from offload_engine.engine.runner.input_batch import DecodeInputBatch
from offload_engine.engine.sequence import PENDING_TOKEN, BlockLocation, Sequence, SequenceStatus
from offload_engine.sampling_params import SamplingParams


def _random_sequence(rng: random.Random) -> Sequence:
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 200))]
    params = SamplingParams(temperature=rng.random(), top_p=0.5 + rng.random() / 2, top_k=rng.randrange(-1, 50),
                            max_tokens=rng.randrange(1, 100), stop_token_ids=[rng.randrange(1000)],
                            seed=rng.choice([None, rng.randrange(2**31)]))
    seq = Sequence(prompt, params, len(prompt) + params.max_tokens)
    seq.status = SequenceStatus.RUNNING
    seq.location = seq.admitted_to = rng.choice(list(BlockLocation))
    seq.block_table = [rng.randrange(10_000) for _ in range(rng.randrange(1, 20))]
    seq.device_prefix = [rng.randrange(10_000) for _ in range(rng.randrange(3))]
    seq.num_computed_tokens = rng.randrange(len(prompt) + 1)
    seq.in_flight = rng.random() < 0.5
    seq.token_ids.append(PENDING_TOKEN)
    return seq


def _as_worker_reads(seq: Sequence) -> dict:
    """Every field, with the tokens a worker computes from (those without KV yet): earlier ones it never reads."""
    fields = dict(vars(seq))
    fields["token_ids"] = seq.token_ids[seq.num_computed_tokens:]
    return fields


def _cross(sender: SequenceSender, mirror: SequenceMirror, seqs: list[Sequence]) -> tuple[list[Sequence], int]:
    """One host step's call through JSON: the worker's copies, and the message's bytes."""
    data = encode_call(Call("decode_host", (sender.pack_seqs(seqs),), after=0, gone=sender.take_gone()))
    call = decode_call(data)
    mirror.forget(call.gone)
    return mirror.unpack_seqs(call.args[0]), len(data)


def _decode_step(seq: Sequence, block_size: int = 16) -> None:
    """What the engine does to a decode row between steps: its newest token computed, one more, a block if due."""
    seq.num_computed_tokens = len(seq)
    seq.token_ids.append(PENDING_TOKEN)
    if -(-len(seq) // block_size) > len(seq.block_table):
        seq.block_table.append(len(seq) * 7)  # in place, as BlockManager.append_slot


def test_calls_round_trip_through_json():
    rng = random.Random(7)
    seqs = [_random_sequence(rng) for _ in range(6)]
    sender, mirror = SequenceSender(), SequenceMirror()
    for call in (Call("decode_host", (sender.pack_seqs(seqs),), after=3, gone=(1, 2)),
                 Call("promote", (sender.pack_moves([(s, s.block_table) for s in seqs[:2]]),), after=1, reply=True)):
        received = decode_call(encode_call(call))
        assert (received.method, received.after, received.reply, received.gone) == (call.method, call.after,
                                                                                      call.reply, call.gone)
        copies = (mirror.unpack_seqs(received.args[0]) if call.method == "decode_host"
                  else [seq for seq, _ in mirror.unpack_moves(received.args[0])])
        for original, copy in zip(seqs, copies):
            assert copy is not original
            assert _as_worker_reads(copy) == _as_worker_reads(original)
            assert len(copy) == len(original)
    assert decode_call(encode_call(None)) is None  # STOP


def test_every_sequence_field_has_its_place_in_the_row_and_any_other_crosses_too():
    seq = _random_sequence(random.Random(1))
    row = SequenceSender().pack_seqs([seq])[0]
    assert not isinstance(row[-1], dict), "a Sequence field the row has no place for: add it to wire._SCALARS"
    seq.extra = [3, None]
    copy = _cross(SequenceSender(), SequenceMirror(), [seq])[0][0]
    assert copy.extra == [3, None] and _as_worker_reads(copy) == _as_worker_reads(seq)


def test_a_value_the_wire_does_not_name_fails_at_the_sender():
    seq = _random_sequence(random.Random(8))
    seq.token_ids = seq.token_ids[:1]
    seq.num_computed_tokens = 0
    seq.extra = object()
    with pytest.raises(TypeError, match="does not cross"):
        encode_call(Call("prefill", (SequenceSender().pack_seqs([seq]),), after=0))
    seq.extra, seq.location = None, "gpu"  # a string where a BlockLocation goes
    with pytest.raises(TypeError, match="does not cross"):
        SequenceSender().pack_seqs([seq])


def test_a_penalized_row_sends_every_token_since_each_rank_samples_it():
    seq = _random_sequence(random.Random(9))
    seq.params = SamplingParams(presence_penalty=0.5)
    seq.token_ids[-1] = 5  # (the worker reads tokens as they are: a pending place is rank 0's own)
    copy = _cross(SequenceSender(), SequenceMirror(), [seq])[0][0]
    assert copy.token_ids == seq.token_ids and copy.params == seq.params


def test_a_table_grown_in_place_crosses_as_its_new_entries_into_the_same_list():
    seq = _random_sequence(random.Random(10))
    sender, mirror = SequenceSender(), SequenceMirror()
    copy = _cross(sender, mirror, [seq])[0][0]
    table = copy.block_table
    for step in range(40):
        _decode_step(seq)
        row = sender.pack_seqs([seq])[0]
        assert row[4][0] == len(table)  # entries the worker has, then only those added since
        assert row[6] is None  # params: sent once
        (again,) = mirror.unpack_seqs(decode_call(encode_call(Call("decode_host", ([row],), after=0))).args[0])
        assert again is copy and copy.block_table is table
        assert _as_worker_reads(copy) == _as_worker_reads(seq)


def test_a_replaced_or_emptied_table_crosses_whole_into_a_new_list():
    seq = _random_sequence(random.Random(11))
    seq.location = BlockLocation.CPU
    sender, mirror = SequenceSender(), SequenceMirror()
    first = _cross(sender, mirror, [seq])[0][0].block_table
    seq.block_table, seq.location = [901, 902], BlockLocation.GPU  # a promotion: BlockManager.move
    copy = _cross(sender, mirror, [seq])[0][0]
    assert copy.block_table == [901, 902] and copy.block_table is not first and copy.location == BlockLocation.GPU
    seq.block_table, seq.device_prefix, seq.num_computed_tokens = [], [], 0  # preempted: BlockManager.deallocate
    copy = _cross(sender, mirror, [seq])[0][0]
    assert copy.block_table == [] and _as_worker_reads(copy) == _as_worker_reads(seq)
    seq.block_table = [5, 6, 7]  # admitted again
    copy = _cross(sender, mirror, [seq])[0][0]
    assert copy.block_table == [5, 6, 7] and _as_worker_reads(copy) == _as_worker_reads(seq)
    seq.device_prefix = seq.device_prefix + [8]  # a split sequence's device part grows: a new list too
    assert _cross(sender, mirror, [seq])[0][0].device_prefix == [8]


def test_params_cross_once_and_again_only_when_replaced():
    seq = _random_sequence(random.Random(12))
    sender = SequenceSender()
    assert sender.pack_seqs([seq])[0][6] is seq.params
    assert sender.pack_seqs([seq])[0][6] is None
    seq.params = SamplingParams(temperature=0)
    assert sender.pack_seqs([seq])[0][6] is seq.params


def test_a_collected_sequence_is_forgotten_by_the_next_call():
    rng = random.Random(13)
    seqs = [_random_sequence(rng) for _ in range(3)]
    sender, mirror = SequenceSender(), SequenceMirror()
    _cross(sender, mirror, seqs)
    assert len(mirror) == 3
    gone = seqs.pop(1).seq_id
    gc.collect()
    data = encode_call(Call("check_host_writes", (False,), after=0, gone=sender.take_gone()))
    assert decode_call(data).gone == (gone,)
    mirror.forget(decode_call(data).gone)
    assert len(mirror) == 2 and sender.take_gone() == ()
    _cross(sender, mirror, seqs)  # the others go on as deltas
    assert len(mirror) == 2


def test_a_row_the_mirror_cannot_apply_fails_loudly():
    seq = _random_sequence(random.Random(14))
    sender, mirror = SequenceSender(), SequenceMirror()
    _cross(sender, mirror, [seq])
    _decode_step(seq, block_size=1)
    sender.pack_seqs([seq])  # lost on the way
    _decode_step(seq, block_size=1)
    with pytest.raises(AssertionError, match="rank 0 sent it"):
        mirror.unpack_seqs(sender.pack_seqs([seq]))
    with pytest.raises(AssertionError, match="without its SamplingParams"):
        SequenceMirror().unpack_seqs(sender.pack_seqs([seq]))
    with pytest.raises(ValueError, match="not a sequence's row"):
        SequenceMirror().unpack_seqs(["not a sequence"])


def test_after_a_failed_pack_the_rows_of_that_call_go_whole():
    rng = random.Random(15)
    good, bad = _random_sequence(rng), _random_sequence(rng)
    sender, mirror = SequenceSender(), SequenceMirror()
    _cross(sender, mirror, [good])
    good.block_table.append(77)
    bad.status = "RUNNING"  # not the enum
    with pytest.raises(TypeError):
        sender.pack_seqs([good, bad])
    row = sender.pack_seqs([good])[0]
    assert row[4][0] == -1 and row[6] is good.params  # whole: safe whatever the worker holds
    assert _as_worker_reads(mirror.unpack_seqs([row])[0]) == _as_worker_reads(good)


def test_the_input_batch_writes_only_the_new_blocks_of_a_mirrored_row():
    seqs = [Sequence([1] * 33, SamplingParams(), budget=100) for _ in range(2)]
    for i, seq in enumerate(seqs):
        seq.location, seq.block_table, seq.num_computed_tokens = BlockLocation.GPU, [i * 10, i * 10 + 1, i * 10 + 2], 32
    sender, mirror = SequenceSender(), SequenceMirror()
    batch = DecodeInputBatch(max_rows=4, max_blocks=8, block_size=16, device=torch.device("cpu"))
    batch.place(_cross(sender, mirror, seqs)[0])
    batch.prepare(2, None)
    assert batch.block_writes == 6
    for _ in range(16):  # a's 49th token starts a fourth block
        seqs[0].num_computed_tokens = len(seqs[0])
        seqs[0].token_ids.append(5)
    seqs[0].block_table.append(3)
    seqs[1].block_table = [40, 41, 42]  # replaced: rewritten whole
    batch.place(_cross(sender, mirror, seqs)[0])
    batch.prepare(2, None)
    assert batch.block_writes == 6 + 1 + 3
    assert batch.table[:2, :4].tolist() == [[0, 1, 2, 3], [40, 41, 42, -1]]


def _long_rows(count: int, tokens: int, block_size: int = 16) -> list[Sequence]:
    rng = random.Random(16)
    seqs = []
    for i in range(count):
        seq = Sequence([rng.randrange(150_000) for _ in range(tokens)], SamplingParams(temperature=0.7, top_p=0.9,
                       max_tokens=512, seed=i, stop_token_ids=[2]), tokens + 512)
        seq.status, seq.location = SequenceStatus.RUNNING, BlockLocation.GPU
        seq.block_table = [rng.randrange(200_000) for _ in range(-(-tokens // block_size))]
        seq.num_computed_tokens, seq.min_tokens_bans = tokens - 1, [2]
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("rows", [64, 256])
def test_a_decode_step_after_the_first_sends_a_small_message(rows):
    seqs = _long_rows(rows, 2048)
    sender, mirror = SequenceSender(), SequenceMirror()
    began = time.perf_counter()
    first = encode_call(Call("launch_device_decode", (sender.pack_seqs(seqs),), after=0))
    encoded = time.perf_counter()
    mirror.unpack_seqs(decode_call(first).args[0])
    decoded = time.perf_counter()
    timings = [(len(first), encoded - began, decoded - encoded)]
    for _ in range(20):
        for seq in seqs:
            _decode_step(seq)
        began = time.perf_counter()
        data = encode_call(Call("launch_device_decode", (sender.pack_seqs(seqs),), after=0))
        encoded = time.perf_counter()
        copies = mirror.unpack_seqs(decode_call(data).args[0])
        timings.append((len(data), encoded - began, time.perf_counter() - encoded))
    assert all(_as_worker_reads(c) == _as_worker_reads(s) for c, s in zip(copies, seqs))
    later = sorted(timings[1:], key=lambda t: t[1])[len(timings) // 2]
    print(f"\n{rows} x 2,048 tokens: first {timings[0][0]:,} B ({timings[0][1] * 1e3:.2f} ms to encode, "
          f"{timings[0][2] * 1e3:.2f} ms to decode); a later step {later[0]:,} B ({later[1] * 1e3:.2f} ms, "
          f"{later[2] * 1e3:.2f} ms)")
    assert max(size for size, _, _ in timings[1:]) < timings[0][0] / 10
    if rows == 64:
        assert max(size for size, _, _ in timings[1:]) < 16_000
