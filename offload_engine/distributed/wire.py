"""Sequences as they cross to the workers, as JSON, never pickled: a worker builds only the types named here. Only
the tokens from num_computed_tokens on cross; the copy holds zeros before them, which nothing on a worker reads.
Why: docs/decisions/multi-gpu.md, "The wire: JSON snapshots, only the tokens computed now"."""
import dataclasses
import json
import threading
import weakref
from enum import Enum

from offload_engine.engine.sequence import BlockLocation, Sequence, SequenceStatus
from offload_engine.sampling_params import SamplingParams

_ENUMS = {cls.__name__: cls for cls in (BlockLocation, SequenceStatus)}


@dataclasses.dataclass(frozen=True)
class Call:
    """One of rank 0's runner calls, as a worker makes it (worker._Mirror has a method of each name)."""

    method: str
    args: tuple
    after: int  # calls of the other lane rank 0 had finished when it made this one
    reply: bool = False  # answer on the channel once done (rank 0 waits for it)


def encode_call(call: Call | None) -> bytes:
    """A call (None: STOP) as JSON bytes; a value of any type not named in this module is a TypeError here."""
    fields = None if call is None else {"method": call.method, "args": call.args, "after": call.after,
                                        "reply": call.reply}  # not asdict: it would turn SamplingParams into a dict
    return json.dumps(fields, default=_encode).encode()


def decode_call(data: bytes) -> Call | None:
    fields = json.loads(data, object_hook=_decode)
    return None if fields is None else Call(fields["method"], tuple(fields["args"]), fields["after"], fields["reply"])


def _encode(value):
    if isinstance(value, Enum) and type(value).__name__ in _ENUMS:
        return {"enum": type(value).__name__, "name": value.name}
    if isinstance(value, SamplingParams):
        return {"sampling_params": {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}}
    raise TypeError(f"{type(value).__name__} does not cross to tensor-parallel workers")


def _decode(fields: dict):
    if "enum" in fields:
        return _ENUMS[fields["enum"]][fields["name"]]
    if "sampling_params" in fields:
        return SamplingParams(**fields["sampling_params"])
    return fields


def pack_seqs(seqs: list[Sequence]) -> list[tuple]:
    return [_pack(seq) for seq in seqs]


def pack_moves(moves: list[tuple[Sequence, list[int]]]) -> list[tuple]:
    """A promotion's or demotion's (sequence, its blocks in the tier it leaves) pairs."""
    return [(_pack(seq), list(blocks)) for seq, blocks in moves]


_RANK_ZERO_ONLY = ("token_ids", "after", "token_logprobs")  # sent otherwise, or only rank 0 reads them


def _pack(seq: Sequence) -> tuple:
    # Penalties read every token (on every rank: each samples), so a penalized row sends them all.
    start = 0 if seq.params.penalized else min(seq.num_computed_tokens, len(seq))
    state = {name: value for name, value in vars(seq).items() if name not in _RANK_ZERO_ONLY}
    return len(seq), start, seq.token_ids[start:], state


class SequenceMirror:
    """A worker's copies of rank 0's sequences, by seq_id. Both lanes' threads unpack; the engine never gives one
    sequence to both lanes at once, so only the table itself needs the lock."""

    def __init__(self):
        self._live: weakref.WeakValueDictionary[int, Sequence] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def unpack_seqs(self, packed: list[tuple]) -> list[Sequence]:
        return [self._unpack(item) for item in packed]

    def unpack_moves(self, packed: list[tuple]) -> list[tuple[Sequence, list[int]]]:
        return [(self._unpack(seq), blocks) for seq, blocks in packed]

    def _unpack(self, item: tuple) -> Sequence:
        length, start, tail, state = item
        with self._lock:
            seq = self._live.get(state["seq_id"])
            if seq is None:
                seq = Sequence.__new__(Sequence)
                seq.token_ids, seq.after, seq.token_logprobs = [], None, {}
                self._live[state["seq_id"]] = seq
        tokens = seq.token_ids
        seq.__dict__.update(state)
        del tokens[start:]  # in place, and no longer than it must be: a decode step touches one or two tokens
        tokens.extend([0] * (start - len(tokens)))
        tokens.extend(tail)
        assert len(tokens) == length
        return seq
