"""Rank 0's calls as they cross to the workers, as JSON, never pickled: a worker builds only the types named here.
A sequence crosses as a row of what changed since rank 0 last sent it: its tokens from num_computed_tokens on, the
block-table entries added in place, its SamplingParams once; its other fields whole, by position. A worker's copy
(SequenceMirror) lives until rank 0's sequence has been collected (Call.gone). Why: docs/decisions/multi-gpu.md,
"The wire: JSON, only what changed since the last call"."""
import collections
import dataclasses
import json
import operator
import threading
import weakref
from enum import Enum

from offload_engine.engine.sched.block_manager import DevicePartGrowth
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
    gone: tuple = ()  # seq_ids rank 0 has dropped: forgotten once `after` is met, before the call runs


def encode_call(call: Call | None) -> bytes:
    """A call (None: STOP) as JSON bytes; a value of any type not named in this module is a TypeError here."""
    fields = None if call is None else {"method": call.method, "args": call.args, "after": call.after,
                                        "reply": call.reply, "gone": call.gone}  # not asdict: it copies deeply
    return json.dumps(fields, default=_encode, separators=(",", ":"), check_circular=False).encode()


def decode_call(data: bytes) -> Call | None:
    fields = json.loads(data, object_hook=_decode)
    if fields is None:
        return None
    return Call(fields["method"], tuple(fields["args"]), fields["after"], fields["reply"], tuple(fields["gone"]))


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


# A row: [seq_id, len, start, tokens[start:], table, device_prefix, params or None, *_SCALARS, (other fields)].
# The tables: [-1, *entries] (a new list) or [entries sent before, *entries added since] (the same list, grown).
_HEAD = 7
_SCALARS = ("num_prompt_tokens", "budget", "status", "location", "admitted_to", "promoted", "demoted",
            "num_device_tokens", "admitted_device_tokens", "num_computed_tokens", "num_scheduled_tokens", "held_since",
            "num_hashed_blocks", "finish_reason", "stop_string", "min_tokens_bans", "in_flight")
_ENUM_SCALARS = {"status": SequenceStatus, "location": BlockLocation, "admitted_to": BlockLocation}  # by name
_TO_NAME = {_HEAD + _SCALARS.index(field): {None: None, **{member: member.name for member in cls}}
            for field, cls in _ENUM_SCALARS.items()}  # row position -> {member: name}
_NO_NAME = object()
_FROM_NAME = {field: {None: None, **cls.__members__} for field, cls in _ENUM_SCALARS.items()}
_TABLES = ("block_table", "device_prefix")
_RANK_ZERO_ONLY = ("token_ids", "after", "token_logprobs")  # sent otherwise, or only rank 0 reads them
_IN_ROW = frozenset(("seq_id", "params", *_TABLES, *_SCALARS, *_RANK_ZERO_ONLY))
_scalars = operator.attrgetter(*_SCALARS)
NEW_TABLE = -1


@dataclasses.dataclass
class _Sent:
    """What rank 0 last sent of one sequence: each table's list object and its length then, the params object."""

    tables: tuple = ((None, 0),) * len(_TABLES)  # (list, length) in _TABLES order
    params: SamplingParams | None = None


class SequenceSender:
    """Rank 0's side of the rows: remembers per seq_id what it sent, so that a row carries only what changed. One
    per TensorParallelRunner, called from both lanes' threads. A sequence's rows must reach each worker in the order
    they were packed (the engine never gives one sequence to both lanes at once; Call.after orders the lanes)."""

    def __init__(self):
        self._sent: dict[int, _Sent] = {}
        self._lock = threading.Lock()
        # Filled by finalizers, which may run on any thread, inside a pack too: a deque, never the lock.
        self._dropped: collections.deque[int] = collections.deque()

    def pack_seqs(self, seqs: list[Sequence]) -> list[list]:
        return self._pack_all(seqs)

    def pack_moves(self, moves: list[tuple[Sequence | DevicePartGrowth, list[int]]]) -> list[tuple]:
        """A promotion's or demotion's (sequence, its blocks in the tier it leaves) pairs; a split row's growth
        (DevicePartGrowth) crosses as its sequence's row with the growth's tokens and new device blocks."""
        rows = self._pack_all([getattr(item, "seq", item) for item, _ in moves])
        return [(row, list(blocks), _growth(item)) for row, (item, blocks) in zip(rows, moves)]

    def take_gone(self) -> tuple[int, ...]:
        """The seq_ids collected since the last call, forgotten here too. Take them before reading a call's
        `after`: a sequence is collected only after every call that carried it has finished on rank 0."""
        gone = []
        while self._dropped:
            gone.append(self._dropped.popleft())
        with self._lock:
            for seq_id in gone:
                self._sent.pop(seq_id, None)
        return tuple(gone)

    def _pack_all(self, seqs: list[Sequence]) -> list[list]:
        rows = []
        with self._lock:
            try:
                for seq in seqs:
                    rows.append(self._pack(seq))
            except BaseException:
                for seq in seqs[: len(rows)]:  # nothing of this call crosses: their next rows go whole
                    self._sent[seq.seq_id] = _Sent()
                raise
        return rows

    def _pack(self, seq: Sequence) -> list:
        """The row; what it sent is remembered only once nothing more can fail."""
        sent = self._sent.get(seq.seq_id) or _Sent()
        tables = [getattr(seq, name) for name in _TABLES]
        deltas = [_table_delta(table, *last) for table, last in zip(tables, sent.tables)]
        params = None if seq.params is sent.params else seq.params
        # Penalties read every token (on every rank: each samples), so a penalized row sends them all.
        start = 0 if seq.params.penalized else min(seq.num_computed_tokens, len(seq))
        row = [seq.seq_id, len(seq), start, seq.token_ids[start:], *deltas, params, *_scalars(seq)]
        for i, names in _TO_NAME.items():
            if (name := names.get(row[i], _NO_NAME)) is _NO_NAME:
                raise TypeError(f"{type(row[i]).__name__} does not cross to tensor-parallel workers as "
                                f"{_SCALARS[i - _HEAD]}")
            row[i] = name
        state = vars(seq)
        if len(state) != len(_IN_ROW) or not _IN_ROW.issuperset(state):
            row.append({name: value for name, value in state.items() if name not in _IN_ROW})
        if seq.seq_id not in self._sent:
            self._sent[seq.seq_id] = sent
            weakref.finalize(seq, self._dropped.append, seq.seq_id).atexit = False
        sent.tables, sent.params = tuple((table, len(table)) for table in tables), seq.params
        return row


def _table_delta(table: list[int], last: list[int] | None, sent: int) -> list[int]:
    """The same list, grown: its new entries; else the whole (a new list: allocation, a move between tiers,
    preemption). Relies on BlockManager changing a table in place only by appending (append_slot)."""
    if table is last and len(table) >= sent:
        return [sent, *table[sent:]]
    return [NEW_TABLE, *table]


def _growth(item) -> list | None:
    return [item.num_computed_tokens, list(item.block_table)] if isinstance(item, DevicePartGrowth) else None


class SequenceMirror:
    """A worker's copies of rank 0's sequences, by seq_id, each one object updated in place (the input batch keeps
    its rows' objects and their tables' lists). Held until rank 0 says the sequence is gone. Both lanes' threads
    unpack; the engine never gives one sequence to both lanes at once, so only the dict itself needs the lock."""

    def __init__(self):
        self._live: dict[int, Sequence] = {}
        self._lock = threading.Lock()

    def unpack_seqs(self, packed: list[list]) -> list[Sequence]:
        return [self._unpack(row) for row in packed]

    def unpack_moves(self, packed: list[tuple]) -> list[tuple[Sequence | DevicePartGrowth, list[int]]]:
        moves = []
        for row, blocks, growth in packed:
            seq = self._unpack(row)
            moves.append((seq if growth is None else DevicePartGrowth(seq, *growth), blocks))
        return moves

    def forget(self, seq_ids) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._live.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def _unpack(self, row: list) -> Sequence:
        if type(row) is not list or len(row) - _HEAD - len(_SCALARS) not in (0, 1):
            raise ValueError(f"not a sequence's row: {row!r:.100}")
        seq_id, length, start, tail, *tables, params = row[:_HEAD]
        with self._lock:
            seq = self._live.get(seq_id)
            if seq is None:
                if params is None:
                    raise AssertionError(f"sequence {seq_id}'s row comes without its SamplingParams, yet this worker "
                                         "holds no copy of it: a row was lost or it was forgotten too soon")
                seq = self._live[seq_id] = _blank(seq_id)
        state = seq.__dict__
        state.update(zip(_SCALARS, row[_HEAD : _HEAD + len(_SCALARS)]))
        for field, members in _FROM_NAME.items():
            state[field] = members[state[field]]
        if len(row) > _HEAD + len(_SCALARS):
            state.update(row[-1])
        if params is not None:
            seq.params = params
        for name, delta in zip(_TABLES, tables):
            _apply_table(seq, name, delta)
        _apply_tokens(seq.token_ids, length, start, tail)
        return seq


def _blank(seq_id: int) -> Sequence:
    seq = Sequence.__new__(Sequence)
    seq.seq_id, seq.token_ids, seq.after, seq.token_logprobs = seq_id, [], None, {}
    seq.block_table, seq.device_prefix = [], []
    return seq


def _apply_table(seq: Sequence, name: str, delta: list[int]) -> None:
    """A new list for a whole table (the input batch then rewrites its row); the same list, extended, for a delta."""
    head, entries = delta[0], delta[1:]
    if head == NEW_TABLE:
        setattr(seq, name, entries)
        return
    table = getattr(seq, name)
    if head != len(table):
        raise AssertionError(f"sequence {seq.seq_id}'s {name} has {len(table)} entries here but rank 0 sent it "
                             f"{head}: a row was lost or applied out of order")
    table.extend(entries)


def _apply_tokens(tokens: list[int], length: int, start: int, tail: list[int]) -> None:
    """In place, and no longer than it must be: a decode step touches one or two tokens. Zeros before `start`,
    which nothing on a worker reads."""
    del tokens[start:]
    tokens.extend([0] * (start - len(tokens)))
    tokens.extend(tail)
    if len(tokens) != length:
        raise AssertionError(f"a sequence's tokens came to {len(tokens)} here, {length} on rank 0")
