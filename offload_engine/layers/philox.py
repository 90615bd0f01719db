"""The uniforms Triton's `tl.rand(key, column)` draws, in torch: the sampler's path on CPU tensors, and the reference
its kernel is tested against. tl.rand runs Philox 4x32-10 on the counter (column, 0, 0, 0) under the key (its low,
high 32 bits), takes the first word as a signed int32 x, and returns (x < 0 ? ~x : x) * 4.6566127342e-10 in float32.
The 32-bit words live in int64 tensors; every product is split so that nothing exceeds 63 bits.
"""
import torch

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def _mul_hi_lo(constant: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(constant * word) >> 32 and its low 32 bits, for a 32-bit constant and 32-bit words."""
    high16, low16 = word >> 16, word & 0xFFFF
    upper, lower = constant * high16, constant * low16  # each < 2**48
    middle = (upper & 0xFFFF) << 16
    low = middle + lower
    return (upper >> 16) + (low >> 32), low & _MASK


def philox_uniform(keys: torch.Tensor, columns: int) -> torch.Tensor:
    """keys [rows] int64 -> float32 [rows, columns] in [0, 1): row r, column c is tl.rand(keys[r], c)."""
    rows = keys.shape[0]
    c0 = torch.arange(columns, dtype=torch.int64, device=keys.device).expand(rows, columns)
    c1 = c2 = c3 = torch.zeros_like(c0)
    k0 = (keys & _MASK).unsqueeze(1)
    k1 = ((keys >> 32) & _MASK).unsqueeze(1)
    for _ in range(10):
        high_b, low_b = _mul_hi_lo(_ROUND_B, c2)
        high_a, low_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _MASK, (k1 + _KEY_B) & _MASK
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    signed = torch.where(signed < 0, -signed - 1, signed)  # ~x for negative x
    return signed.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)
