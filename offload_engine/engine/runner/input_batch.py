"""The device lane's decode rows, kept in place across steps (docs/design.md, "The runner"; why:
docs/decisions/device-lane.md). A row whose newest token the in-flight step sampled (PENDING_TOKEN on the host) reads
it on the device from `sampled` (`gather_tokens`), which holds one step's ids until DeferredTokens copies them.
"""
import numpy as np
import torch

from offload_engine.engine.runner.cpu_gpu_buffer import PackedCpuGpuBuffers
from offload_engine.engine.sequence import PENDING_TOKEN, Sequence
from offload_engine.layers.attention_metadata import AttentionMetadata
from offload_engine.layers.sampler import SamplingBatch


class DecodeInputBatch:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self.rows: list[Sequence] = []
        self._tables: list[list[int]] = []  # row index -> the block-table list its host row was written from
        self.table = np.full((max_rows, max_blocks), -1, dtype=np.int32)  # host block tables, rows in place
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.block_writes = 0  # blocks written into `table` (tests: only what changed is written)
        self.step = 0
        self.inputs = PackedCpuGpuBuffers({
            "host_tokens": (max_rows, torch.int64, 0),  # the host's newest token of each row (stale if pending)
            "feed": (max_rows, torch.int64, -1),  # the row of `sampled` whose id is this row's token, or -1
            "positions": (max_rows, torch.int64, 0),
            "slot_mapping": (max_rows, torch.int64, -1),
            "temperatures": (max_rows, torch.float32, 0),  # 0: greedy
            "keys": (max_rows, torch.int64, 0),
            "top_ks": (max_rows, torch.int64, 0),  # written only where a row of the step filters
            "top_ps": (max_rows, torch.float32, 1),
            "context_lens": (max_rows, torch.int32, 0),
            # The block tables cross as one dense [rows, columns used] window, then land in the wide table.
            "table_window": (max_rows * max_blocks, torch.int32, -1),
        }, device)
        dev = self.inputs.device
        self.positions, self.slot_mapping, self.context_lens = dev["positions"], dev["slot_mapping"], dev["context_lens"]
        self.token_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)  # the last step's ids, by its rows
        self.block_tables = torch.full((max_rows, max_blocks), -1, dtype=torch.int32, device=device)
        self.filtered: SamplingBatch | None = None  # top-k/top-p, penalties, min_p: where a row has them
        self.empty_host = torch.empty(0)

    def place(self, seqs: list[Sequence]) -> list[Sequence]:
        """Makes the batch's rows exactly `seqs`, keeping continuing rows where they are; returns them in row
        order (the order of the step's logits and sampled ids)."""
        wanted = {seq.seq_id for seq in seqs}
        row = 0
        while row < len(self.rows):
            if self.rows[row].seq_id in wanted:
                row += 1
                continue
            last = len(self.rows) - 1
            if row != last:
                self.rows[row], self._tables[row] = self.rows[last], self._tables[last]
                self.table[row] = self.table[last]
                self.num_blocks[row] = self.num_blocks[last]
            self.rows.pop()
            self._tables.pop()
        present = {seq.seq_id for seq in self.rows}
        for seq in seqs:
            if seq.seq_id not in present:
                self.rows.append(seq)
                self._tables.append(None)
                self.num_blocks[len(self.rows) - 1] = 0
        return list(self.rows)

    def prepare(self, padded: int, in_flight, settings=None) -> AttentionMetadata:
        """Writes the step's inputs for rows [0, padded) and queues their one copy; padding rows read and write no
        KV. in_flight: the lane's DeferredTokens not yet read, or None. settings: as StepInputBuilder's."""
        parity, self.step = self.step % 2, self.step + 1
        host = lambda name: self.inputs.host(parity, name)
        count = len(self.rows)
        positions, slots, context = host("positions"), host("slot_mapping"), host("context_lens")
        tokens = host("host_tokens")
        for row, seq in enumerate(self.rows):
            self._sync_table(row, seq)
            positions[row] = len(seq) - 1
            tokens[row] = seq.token_ids[-1]
        size = self.block_size
        pos = positions[:count]
        slots[:count] = self.table[np.arange(count), pos // size].astype(np.int64) * size + pos % size
        context[:count] = pos + 1
        slots[count:padded], context[count:padded] = -1, 0
        tokens[count:padded] = 0  # padding rows embed some real token, never a pending one's -1
        self._write_feed(host("feed"), tokens, count, padded, in_flight)
        self._write_sampling(parity, count, padded, settings)
        columns = max(1, int(self.num_blocks[:count].max(initial=1)))
        host("table_window")[: padded * columns].reshape(padded, columns)[:count] = self.table[:count, :columns]
        self.inputs.copy_to_device(parity, padded * columns)
        window = self.inputs.device["table_window"][: padded * columns].view(padded, columns)
        self.block_tables[:padded, :columns].copy_(window)
        return AttentionMetadata(
            is_prefill=False, has_gpu_rows=True, has_cpu_rows=False, slot_mapping=self.slot_mapping[:padded],
            context_lens=self.context_lens[:padded], block_tables=self.block_tables[:padded, :columns],
            slot_mapping_cpu=self.empty_host, context_lens_cpu=self.empty_host, block_tables_cpu=self.empty_host)

    def _write_feed(self, feed: np.ndarray, tokens: np.ndarray, count: int, padded: int, in_flight) -> None:
        feed[:padded] = -1
        pending = np.flatnonzero(tokens[:count] == PENDING_TOKEN)
        if len(pending) and in_flight is None:
            raise RuntimeError("a row's newest token is pending but no device step is in flight")
        for row in pending:
            feed[row] = in_flight.row_of[self.rows[row].seq_id]

    def _write_sampling(self, parity: int, count: int, padded: int, settings) -> None:
        temperatures = self.inputs.host(parity, "temperatures")
        temperatures[:padded] = 0  # greedy, also for the padding rows
        self.filtered = None
        if settings is None:
            return
        temperatures[:count] = settings[0]
        self.inputs.host(parity, "keys")[:count] = settings[1]
        filters, processing = settings[2] is not None, settings[4]
        if filters or processing is not None:  # top-k / top-p, penalties, min_p: sampled again after the step
            dev = self.inputs.device
            if filters:
                self.inputs.host(parity, "top_ks")[:count] = settings[2]
                self.inputs.host(parity, "top_ps")[:count] = settings[3]
            self.filtered = SamplingBatch(dev["temperatures"][:count], dev["keys"][:count],
                                          dev["top_ks"][:count] if filters else None,
                                          dev["top_ps"][:count] if filters else None, needs_filter=filters,
                                          processing=processing)

    def gather_tokens(self, size: int) -> torch.Tensor:
        """token_ids[:size] = the host's token, or the in-flight step's sampled id where feed says so. Queued on
        the device (inside the whole-step graphs); returns token_ids[:size]."""
        feed, dev = self.inputs.device["feed"][:size], self.inputs.device
        from_step = self.sampled.index_select(0, feed.clamp(min=0))
        return torch.where(feed >= 0, from_step, dev["host_tokens"][:size], out=self.token_ids[:size])

    def sampling(self, size: int) -> SamplingBatch:
        """The step's temperatures and keys on the device (no filters: see `filtered`)."""
        dev = self.inputs.device
        return SamplingBatch(temperatures=dev["temperatures"][:size], keys=dev["keys"][:size])

    def _sync_table(self, row: int, seq: Sequence) -> None:
        """Brings the row's host block table up to the sequence's: only the blocks it gained since the last step,
        unless its table was replaced (a sequence that left the lane comes back with a new one)."""
        if self._tables[row] is not seq.block_table:
            self._tables[row], self.num_blocks[row] = seq.block_table, 0
            self.table[row] = -1  # nothing of the row's last sequence stays behind
        have, need = int(self.num_blocks[row]), len(seq.block_table)
        if need > have:
            self.table[row, have:need] = seq.block_table[have:need]
            self.num_blocks[row] = need
            self.block_writes += need - have
