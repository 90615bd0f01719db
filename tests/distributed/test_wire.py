"""Rank 0's calls cross to the workers as JSON: a worker's copy of each sequence reads as rank 0's did at the call,
and a value of a type the wire does not name fails at rank 0, before anything is sent."""
import random

import pytest

from offload_engine.distributed.wire import Call, SequenceMirror, decode_call, encode_call, pack_moves, pack_seqs
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


def test_calls_round_trip_through_json():
    rng = random.Random(7)
    seqs = [_random_sequence(rng) for _ in range(6)]
    mirror = SequenceMirror()
    for call in (Call("decode_host", (pack_seqs(seqs),), after=3),
                 Call("promote", (pack_moves([(s, s.block_table) for s in seqs[:2]]),), after=1, reply=True)):
        received = decode_call(encode_call(call))
        assert (received.method, received.after, received.reply) == (call.method, call.after, call.reply)
        copies = (mirror.unpack_seqs(received.args[0]) if call.method == "decode_host"
                  else [seq for seq, _ in mirror.unpack_moves(received.args[0])])
        for original, copy in zip(seqs, copies):
            assert copy is not original
            worker_view = _as_worker_reads(copy)
            assert worker_view == _as_worker_reads(original)
            assert len(copy) == len(original)
    assert decode_call(encode_call(None)) is None  # STOP


def test_a_value_the_wire_does_not_name_fails_at_the_sender():
    seq = _random_sequence(random.Random(8))
    seq.token_ids = seq.token_ids[:1]
    seq.num_computed_tokens = 0
    seq.extra = object()
    with pytest.raises(TypeError, match="does not cross"):
        encode_call(Call("prefill", (pack_seqs([seq]),), after=0))


def test_a_penalized_row_sends_every_token_since_each_rank_samples_it():
    seq = _random_sequence(random.Random(9))
    seq.params = SamplingParams(presence_penalty=0.5)
    seq.token_ids[-1] = 5  # (the worker reads tokens as they are: a pending place is rank 0's own)
    copy = SequenceMirror().unpack_seqs(decode_call(encode_call(Call("decode_host", (pack_seqs([seq]),),
                                                                     after=0))).args[0])[0]
    assert copy.token_ids == seq.token_ids and copy.params == seq.params
