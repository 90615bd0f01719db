"""What the two decode lanes cost, measured as the engine runs: the inputs of placement's cost check.

- A host-lane step takes about `fixed + per_byte * kv_bytes` seconds: per-layer hand-offs and copies, then
  the CPU kernel streaming the rows' KV. Both terms are fitted by least squares over recent steps, old
  steps fading out (the weight halves every HALF_LIFE steps), so the fit follows the host as it warms up.
- A device-lane step takes longer while a host step is in flight than while the host lane is idle; the
  ratio of their recent averages is the slowdown the host lane imposes.
- The device lane's tokens per second, from its recent steps.
"""
from dataclasses import dataclass

HALF_LIFE = 32  # steps


@dataclass
class _Average:
    """An exponentially weighted mean that is None until it has seen a value."""

    value: float | None = None

    def add(self, x: float, weight: float = 1 / HALF_LIFE) -> None:
        self.value = x if self.value is None else self.value + weight * (x - self.value)


class LaneStats:
    def __init__(self, kv_bytes_per_token: int | None = None):
        self.kv_bytes_per_token = kv_bytes_per_token  # of the model: host step cost is per byte of KV read
        self._decay = 0.5 ** (1 / HALF_LIFE)
        self._sums = [0.0] * 5  # weight, x, y, xx, xy of (KV bytes, seconds) of host steps
        self._distinct_bytes: set[int] = set()
        self.device_step = {False: _Average(), True: _Average()}  # keyed by "a host step was in flight"
        self.device_tok_s = _Average()

    # ---- recording -----------------------------------------------------------------------------------------
    def host_step(self, kv_bytes: int, seconds: float) -> None:
        self._sums = [s * self._decay for s in self._sums]
        for i, term in enumerate((1.0, kv_bytes, seconds, kv_bytes * kv_bytes, kv_bytes * seconds)):
            self._sums[i] += term
        if len(self._distinct_bytes) < 2:
            self._distinct_bytes.add(kv_bytes)

    def device_step_done(self, rows: int, seconds: float, host_busy: bool) -> None:
        self.device_step[host_busy].add(seconds)
        self.device_tok_s.add(rows / max(seconds, 1e-6))

    # ---- predictions ---------------------------------------------------------------------------------------
    def host_step_seconds(self, kv_bytes: int) -> float | None:
        """Predicted host step time for rows holding kv_bytes of KV, or None before two different step sizes
        have been seen (one point cannot separate the fixed cost from the per-byte cost)."""
        if len(self._distinct_bytes) < 2:
            return None
        weight, x, y, xx, xy = self._sums
        spread = weight * xx - x * x
        per_byte = max(0.0, (weight * xy - x * y) / spread) if spread > 0 else 0.0
        fixed = max(0.0, (y - per_byte * x) / weight)
        return fixed + per_byte * kv_bytes

    @property
    def slowdown(self) -> float:
        """Device step time with a host step in flight over without (1.0 until both have been seen)."""
        idle, busy = self.device_step[False].value, self.device_step[True].value
        return max(1.0, busy / idle) if idle and busy else 1.0
