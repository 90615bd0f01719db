"""The streamed share inside the host-step graphs: static maps, a double-buffered staging buffer, and the copies on a
stream of their own, so that layer l + 1's blocks cross PCIe while layer l computes (docs/design.md, "Streaming host
KV"). Copy l writes buffer l % 2 and waits for the attention that last read it (layer l - 1's); layer l's attention
waits for copy l. Stamps of the device's clock around each copy time the link as the step ran.
"""
import torch

from gpu_kernels.host_kv_stream import stamp, stream_host_blocks


class StreamStaging:
    def __init__(self, model, largest: int, capacity_blocks: int, blocks_per_row: int, copy_stream):
        """capacity_blocks: host blocks a step streams per layer, at most; blocks_per_row: the tables' width."""
        layers = model.attention_layers()
        self.host_layers = [attn.host_kv_mapped for attn in layers]
        pool = self.host_layers[0]
        device = pool.device
        self.source_blocks = torch.zeros(capacity_blocks, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.tables = torch.full((largest, max(1, blocks_per_row)), -1, dtype=torch.int32, device=device)
        self.lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.staging = torch.empty((2, 2, capacity_blocks, *pool.shape[2:]), dtype=pool.dtype, device=device)
        self.clock = torch.zeros(2 * len(layers), dtype=torch.int64, device=device)
        self.clock_host = torch.zeros(2 * len(layers), dtype=torch.int64).pin_memory()
        self.copy_stream = copy_stream
        self.copied = [torch.cuda.Event() for _ in layers]
        self.used = [torch.cuda.Event() for _ in layers]
        self.capacity_blocks, self.timed = capacity_blocks, False

    @staticmethod
    def nbytes(model_cfg, cpu_block_size: int, capacity_blocks: int, dtype: torch.dtype) -> int:
        """Device memory of the staging buffer: two layers' worth of K and V."""
        return 4 * capacity_blocks * model_cfg.num_kv_heads * cpu_block_size * model_cfg.head_dim * dtype.itemsize

    def fits(self, streamed) -> bool:
        return streamed.num_blocks <= self.capacity_blocks and streamed.block_tables.shape[1] <= self.tables.shape[1]

    def load(self, streamed, batch: int) -> None:
        """The step's maps into the static buffers (rows past the batch stream nothing)."""
        self.lens.zero_()
        if streamed is None:
            self.count.zero_()
            self.timed = False
            return
        self.source_blocks[: streamed.num_blocks].copy_(streamed.source_blocks)
        self.count.copy_(streamed.count)
        self.lens[:batch].copy_(streamed.context_lens)
        self.tables[:batch, : streamed.block_tables.shape[1]].copy_(streamed.block_tables)
        self.timed = True

    def begin(self) -> None:
        """Forks the copy stream off the step's stream and starts layer 0's copy."""
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        self._copy(0)

    def attend(self, layer: int, attn, q: torch.Tensor, size: int):
        """Layer `layer`'s attention over its staged blocks, (out, lse); queues the copy of layer + 1 behind it."""
        main = torch.cuda.current_stream()
        main.wait_event(self.copied[layer])
        staging = self.staging[layer % 2]
        partial = attn.backend.paged_decode_attention(q, staging[0].transpose(1, 2), staging[1].transpose(1, 2),
                                                      self.tables[:size], self.lens[:size], attn.scale)
        self.used[layer].record(main)
        if layer + 1 < len(self.host_layers):
            if layer > 0:
                self.copy_stream.wait_event(self.used[layer - 1])  # buffer (layer + 1) % 2's last reader
            self._copy(layer + 1)
        return partial

    def end(self) -> None:
        """Joins the copy stream back and brings the clock stamps to the host."""
        main = torch.cuda.current_stream()
        main.wait_stream(self.copy_stream)
        self.clock_host.copy_(self.clock, non_blocking=True)

    def _copy(self, layer: int) -> None:
        with torch.cuda.stream(self.copy_stream):
            stamp(self.clock, 2 * layer)
            stream_host_blocks(self.host_layers[layer], self.source_blocks, self.count, self.staging[layer % 2])
            stamp(self.clock, 2 * layer + 1)
            self.copied[layer].record(self.copy_stream)

    def seconds(self) -> float | None:
        """The copies' device time in the last step (read once the step has synced), or None if it streamed none."""
        if not self.timed:
            return None
        stamps = self.clock_host.view(-1, 2)
        return float((stamps[:, 1] - stamps[:, 0]).clamp_min(0).sum()) / 1e9
