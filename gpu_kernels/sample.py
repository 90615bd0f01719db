"""sample_tokens: one pass over each row's logits draws its token, greedy or at its temperature.

Sampling from softmax(x / T) is the argmax of x / T + G with G standard Gumbel noise (the exponential race
argmax(p / E), E ~ Exp(1), in log space), so no softmax, sum or cumulative search is needed: every element is
read once and only a running maximum is kept. Why one pass: docs/decisions/device-kernels.md, "One-pass sampler".

Contract: logits [rows, V] (float32, bfloat16 or float16; the last dimension has stride 1), temperatures [rows]
float32 (0: greedy, the row's argmax), keys [rows] int64. A row with temperature t > 0 draws
u = tl.rand(key, column), Triton's Philox 4x32-10 stream for that key at the column's index, and takes
argmax(x / t - log(-log u)) in float32, so a row's token depends on its logits, t and key only: not on the batch,
the tile size or the device (layers/philox.py draws the same u in torch). Ties go to the smallest column, as
torch.argmax breaks them. -inf logits (filtered out) are never drawn while the row has a finite one.

Two launches, no host syncs, so it runs inside a CUDA graph: each program finds its tile's best, then one program
per row picks among the tiles. Tiles spread a row over many SMs, which a single long row needs at batch 1.
"""
import torch
import triton
import triton.language as tl

from ._common import next_power_of_2, on_device

TILE = 4096


@triton.jit
def _tile_best_kernel(logits_ptr, temperatures_ptr, keys_ptr, best_ptr, index_ptr, stride, V, tiles,
                      TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    inside = cols < V
    x = tl.load(logits_ptr + row * stride + cols, mask=inside, other=-float("inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        u = tl.rand(tl.load(keys_ptr + row), cols)
        x = tl.math.div_rn(x, temperature) - tl.log(-tl.log(u))  # x / t rounded as torch divides
    x = tl.where(inside, x, -float("inf"))
    best = tl.max(x, axis=0)
    index = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(best_ptr + row * tiles + tile, best)
    tl.store(index_ptr + row * tiles + tile, tile * TILE + index)


@triton.jit
def _row_best_kernel(best_ptr, index_ptr, out_ptr, tiles, TILES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, TILES)
    inside = offs < tiles
    best = tl.load(best_ptr + row * tiles + offs, mask=inside, other=-float("inf"))
    index = tl.load(index_ptr + row * tiles + offs, mask=inside, other=0)
    # Tiles are in column order, so the leftmost best tile holds the row's leftmost best column.
    winner = tl.argmax(best, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == winner, index, 0), axis=0))


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                  out: torch.Tensor | None = None, tile: int = TILE) -> torch.Tensor:
    """-> token ids [rows] int64 (written into `out` when given). `tile`: columns a program reads (tests make
    it small so that rows span several tiles)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"sample_tokens needs logits [rows, V] with a unit last stride, got {tuple(logits.shape)} "
                         f"(strides {logits.stride()})")
    rows, vocab = logits.shape
    if temperatures.shape != (rows,) or keys.shape != (rows,) or keys.dtype != torch.int64:
        raise ValueError(f"sample_tokens needs temperatures [{rows}] and int64 keys [{rows}], got "
                         f"{tuple(temperatures.shape)} and {tuple(keys.shape)} {keys.dtype}")
    if tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    tiles = triton.cdiv(vocab, tile)
    best = torch.empty(rows, tiles, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, tiles, dtype=torch.int64, device=logits.device)
    if rows:
        with on_device(logits):
            _tile_best_kernel[(rows, tiles)](logits, temperatures, keys, best, index, logits.stride(0), vocab, tiles,
                                             TILE=tile)
            _row_best_kernel[(rows,)](best, index, out, tiles, TILES=next_power_of_2(tiles))
    return out
