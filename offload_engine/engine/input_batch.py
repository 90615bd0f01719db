"""The device lane's decode rows, kept in place across steps (the persistent input batch of vLLM v1's runner).

A row keeps its index while its sequence goes on decoding in the device lane: its block-table row on the host is
written once, and after that only the blocks it gains are appended. A sequence that leaves the lane (finished,
preempted, demoted, promoted away) frees its row, and the last row moves into the hole so the rows stay dense;
new sequences take rows at the end. A step then writes its inputs into pinned buffers (cpu_gpu_buffer.py) and
sends each with one non-blocking copy into device tensors that never move, which the device lane's whole-step
CUDA graphs read as their static inputs: nothing is allocated and nothing is copied twice.

Token ids: a row whose newest token was sampled by the step still in flight (async scheduling: the host does not
know it yet, its place holds PENDING_TOKEN) reads it on the device from that step's sampled ids.
"""
import numpy as np
import torch

from offload_engine.engine.cpu_gpu_buffer import CpuGpuBuffer
from offload_engine.engine.sequence import PENDING_TOKEN, Sequence
from offload_engine.layers.attention_metadata import AttentionMetadata


class DecodeInputBatch:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self.rows: list[Sequence] = []  # row index -> its sequence
        self._tables: list[list[int]] = []  # row index -> the block-table list its host row was written from
        self.table = np.full((max_rows, max_blocks), -1, dtype=np.int32)  # host block tables, rows in place
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)  # of each row, written into `table`
        self.block_writes = 0  # blocks written into `table` (tests: only what changed is written)
        self.step = 0  # parity of the host halves
        buffer = lambda *shape, dtype, fill=0: CpuGpuBuffer(*shape, dtype=dtype, device=device, fill=fill)
        self.token_ids = buffer(max_rows, dtype=torch.int64)
        self.positions = buffer(max_rows, dtype=torch.int64)
        self.slot_mapping = buffer(max_rows, dtype=torch.int64, fill=-1)
        self.context_lens = buffer(max_rows, dtype=torch.int32)
        self.feed = buffer(max_rows, dtype=torch.int64)  # where each row's token comes from (see _feed_tokens)
        # The block tables cross as one dense [rows, columns used] window, then land in the wide device table.
        self.table_window = buffer(max_rows * max_blocks, dtype=torch.int32, fill=-1)
        self.block_tables = torch.full((max_rows, max_blocks), -1, dtype=torch.int32, device=device)
        self.empty_host = torch.empty(0)

    @property
    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a whole-step graph reads: token ids, positions, slot mapping, context lengths,
        block tables (cuda_graphs.DecodeGraphs)."""
        return (self.token_ids.device, self.positions.device, self.slot_mapping.device, self.context_lens.device,
                self.block_tables)

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
            if row != last:  # the last row moves into the hole
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

    def prepare(self, padded: int, in_flight) -> AttentionMetadata:
        """Writes the step's inputs for rows [0, padded) (rows past the batch: slot -1, context 0, so they read
        and write no KV) and queues their copies. in_flight: the device lane's step whose sampled ids are not on
        the host yet (a DeferredTokens), or None."""
        parity, self.step = self.step % 2, self.step + 1
        count = len(self.rows)
        positions, slots = self.positions.host(parity), self.slot_mapping.host(parity)
        context, tokens = self.context_lens.host(parity), self.token_ids.host(parity)
        for row, seq in enumerate(self.rows):
            self._sync_table(row, seq)
            positions[row] = len(seq) - 1
            tokens[row] = seq.token_ids[-1]
        size = self.block_size
        rows = np.arange(count)
        pos = positions[:count]
        slots[:count] = self.table[rows, pos // size].astype(np.int64) * size + pos % size
        context[:count] = pos + 1
        slots[count:padded], context[count:padded] = -1, 0
        columns = max(1, int(self.num_blocks[:count].max(initial=1)))
        window = self.table_window.host(parity)[: padded * columns].reshape(padded, columns)
        window[:count] = self.table[:count, :columns]
        meta = AttentionMetadata(
            is_prefill=False, has_gpu_rows=True, has_cpu_rows=False,
            slot_mapping=self.slot_mapping.copy_to_device(parity, padded),
            context_lens=self.context_lens.copy_to_device(parity, padded),
            block_tables=self._copy_tables(parity, padded, columns),
            slot_mapping_cpu=self.empty_host, context_lens_cpu=self.empty_host, block_tables_cpu=self.empty_host)
        self.positions.copy_to_device(parity, padded)
        self._feed_tokens(parity, count, in_flight)
        return meta

    def _sync_table(self, row: int, seq: Sequence) -> None:
        """Brings the row's host block table up to the sequence's: only the blocks it gained since the last step,
        unless its table was replaced (a sequence that left the lane comes back with a new one)."""
        if self._tables[row] is not seq.block_table:
            self._tables[row], self.num_blocks[row] = seq.block_table, 0
            self.table[row] = -1  # nothing of the row's last sequence stays behind (-1 padded, as the contract says)
        have, need = int(self.num_blocks[row]), len(seq.block_table)
        if need > have:
            self.table[row, have:need] = seq.block_table[have:need]
            self.num_blocks[row] = need
            self.block_writes += need - have

    def _copy_tables(self, parity: int, padded: int, columns: int) -> torch.Tensor:
        """The [padded, columns] window crosses densely, then lands in the wide device table (the graphs read
        that one); returns the window's view of it."""
        dense = self.table_window.copy_to_device(parity, padded * columns).view(padded, columns)
        self.block_tables[:padded, :columns].copy_(dense)
        return self.block_tables[:padded, :columns]

    def _feed_tokens(self, parity: int, count: int, in_flight) -> None:
        """Each row's input token: the host's where it knows it, otherwise the in-flight step's sampled id for
        that sequence, gathered on the device. feed[row] indexes [in-flight sampled ids..., host ids...]."""
        tokens = self.token_ids.host(parity)
        pending = [row for row in range(count) if tokens[row] == PENDING_TOKEN]
        if not pending:
            self.token_ids.copy_to_device(parity, count)
            return
        if in_flight is None:
            raise RuntimeError("a row's newest token is pending but no device step is in flight")
        sampled = in_flight.sampled
        feed = self.feed.host(parity)
        feed[:count] = np.arange(count) + sampled.shape[0]
        for row in pending:
            feed[row] = in_flight.row_of[self.rows[row].seq_id]
        # cat makes a new tensor, so the gather may write into the twin the host ids crossed into.
        source = torch.cat([sampled, self.token_ids.copy_to_device(parity, count)])
        torch.index_select(source, 0, self.feed.copy_to_device(parity, count), out=self.token_ids.device[:count])
