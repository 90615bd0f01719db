"""What the two decode lanes cost, measured as the engine runs: the inputs of placement's cost checks.

Host-lane step: fixed + per_byte x KV bytes. Device-lane slowdown: step time with a host step in flight over without,
at equal row counts. Every estimate is a median of its last WINDOW values: one stalled sample must not set the checks'
inputs, since a refusal stops the samples that would correct it. Why each estimator: docs/decisions/lane-stats.md.
"""
import statistics
from collections import Counter, deque

WINDOW = 32
# Device steps beside a streaming host step over beside a plain one, until measured: 1.057 on the H100 host at 8B
# (docs/decisions/host-streaming.md).
STREAM_SLOWDOWN_PRIOR = 1.06


class _Recent:
    """The median of the last WINDOW values added (None until one is); `count`: values added in all."""

    def __init__(self):
        self._values: deque[float] = deque(maxlen=WINDOW)
        self._median: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self._values.append(x)
        self._median = None
        self.count += 1

    @property
    def value(self) -> float | None:
        if self._median is None and self._values:
            self._median = statistics.median(self._values)
        return self._median


class DevicePrefillSteps:
    """A prefill step of n tokens without host-tier rows: fixed + per_token * n, a Theil-Sen line over the last
    WINDOW steps (per token alone would make small steps look dear); through the origin while no two steps' sizes
    differ by UNLIKE."""

    UNLIKE = 1.25  # sizes this far apart give a slope

    def __init__(self):
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._line: tuple[float, float] | None = None  # (fixed, per_token)
        self.count = 0

    def add(self, tokens: int, seconds: float) -> None:
        self._steps.append((tokens, seconds))
        self._line = None
        self.count += 1

    def seconds(self, tokens: int) -> float | None:
        """A step of `tokens` tokens without host-tier rows, as the steps so far put it (None: none measured)."""
        if not self._steps:
            return None
        if self._line is None:
            self._line = self._fit()
        fixed, per_token = self._line
        return fixed + per_token * tokens

    def _fit(self) -> tuple[float, float]:
        steps = list(self._steps)
        slopes = [(s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(steps) for t2, s2 in steps[i + 1:]
                  if max(t1, t2) >= self.UNLIKE * min(t1, t2)]
        if not slopes:
            return 0.0, statistics.median(s / t for t, s in steps)
        per_token = max(0.0, statistics.median(slopes))
        return max(0.0, statistics.median(s - per_token * t for t, s in steps)), per_token


class LaneStats:
    def __init__(self, kv_bytes_per_token: int | None = None, link_seconds_per_byte: float | None = None):
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link_seconds_per_byte = link_seconds_per_byte
        self.host_fixed = _Recent()  # seconds of a host step outside its CPU kernels
        self._kernel_per_byte = _Recent()  # seconds of a host step's CPU kernels per KV byte they read
        self._device_steps: dict[tuple[int, bool, bool], _Recent] = {}  # (rows, host busy, it streams) -> seconds
        self.device_tok_s = _Recent()
        self._move_per_token = _Recent()
        self._device_prefill = DevicePrefillSteps()
        self._host_prefill_extra = _Recent()  # seconds per host-tier prompt token beyond that
        self.device_prefill_elsewhere = False
        self._host_read_per_byte = _Recent()  # CPU kernel seconds per byte it read itself
        self._stream_per_byte = _Recent()  # seconds per byte a host step's streamed share took to cross
        self.host_kernel_bytes = self.stream_bytes = 0  # read by each path, in all
        self.stream_share = 0.0  # the latest host step's
        # Where host steps' seconds went, in all: the CPU kernels' work, their waits for the device's side of each
        # layer (its copies, gates and the rows' dense layers), and the rest (inputs, launch, sampling, hand-offs).
        self.host_step_parts = {"steps": 0, "seconds": 0.0, "kernel_seconds": 0.0, "device_wait_seconds": 0.0}
        self.checks: Counter = Counter()  # placement's cost-check outcomes, e.g. ("demote", False)
        self.device_steps_since_host_step = 0

    def host_step(self, kv_bytes: int, seconds: float, kernel_seconds: float, device_wait_seconds: float = 0.0
                  ) -> None:
        """A host-lane step over kv_bytes of KV took `seconds`, `kernel_seconds` of it in the CPU kernels and
        `device_wait_seconds` with the kernels waiting for the device's side of a layer."""
        kernel_seconds = min(kernel_seconds, seconds)
        parts = self.host_step_parts
        parts["steps"] += 1
        parts["seconds"] += seconds
        parts["kernel_seconds"] += kernel_seconds
        parts["device_wait_seconds"] += min(device_wait_seconds, seconds - kernel_seconds)
        self.device_steps_since_host_step = 0
        self.host_fixed.add(seconds - kernel_seconds)
        if kv_bytes > 0:
            self._kernel_per_byte.add(kernel_seconds / kv_bytes)

    def host_reads(self, kernel_bytes: int, kernel_seconds: float, stream_bytes: int,
                   stream_seconds: float | None) -> None:
        """A host step's two paths to host KV: the CPU kernel read kernel_bytes in kernel_seconds; stream_bytes
        crossed to the device in stream_seconds (None: not timed)."""
        self.host_kernel_bytes += kernel_bytes
        self.stream_bytes += stream_bytes
        self.stream_share = stream_bytes / max(1, stream_bytes + kernel_bytes)
        if kernel_bytes > 0 and kernel_seconds > 0:
            self._host_read_per_byte.add(kernel_seconds / kernel_bytes)
        if stream_bytes > 0 and stream_seconds:
            self._stream_per_byte.add(stream_seconds / stream_bytes)

    @property
    def host_read_seconds_per_byte(self) -> float | None:
        return self._host_read_per_byte.value

    @property
    def stream_seconds_per_byte(self) -> float | None:
        """Measured in host steps, else the link's rate measured at start-up (a seed), else None."""
        return self._stream_per_byte.value or self.link_seconds_per_byte

    def device_step_done(self, rows: int, seconds: float, host_busy: bool, host_streams: bool = False) -> None:
        """A device step of `rows` rows took `seconds`, beside a host step (host_busy) that streamed (host_streams)."""
        self._device_steps.setdefault((rows, host_busy, host_busy and host_streams), _Recent()).add(seconds)
        self.device_tok_s.add(rows / max(seconds, 1e-6))
        self.device_steps_since_host_step += 1

    def move_done(self, tokens: int, seconds: float) -> None:
        """A move of `tokens` tokens' KV cost the device lane `seconds` (engine thread and slower steps)."""
        if tokens > 0:
            self._move_per_token.add(max(0.0, seconds) / tokens)

    def prefill_done(self, tokens: int, host_tokens: int, seconds: float) -> None:
        """A prefill step of `tokens` prompt tokens, `host_tokens` of them host-tier, took `seconds`."""
        if tokens <= 0:
            return
        if self.device_prefill_elsewhere:  # only split rows prefill here, and their host tokens cost all of it
            if host_tokens:
                self._host_prefill_extra.add(max(0.0, seconds) / host_tokens)
        elif not host_tokens:
            self._device_prefill.add(tokens, seconds)
        elif self._device_prefill.count:
            self._host_prefill_extra.add(max(0.0, seconds - self._device_prefill.seconds(tokens)) / host_tokens)

    def record_check(self, kind: str, pays: bool) -> None:
        self.checks[(kind, pays)] += 1

    @property
    def host_per_byte(self) -> float | None:
        return self._kernel_per_byte.value

    def idle_device_step_seconds(self, rows: int) -> float | None:
        """A device step's time at this row count with the host lane idle, as measured (None: not seen)."""
        average = self._device_steps.get((rows, False, False))
        return None if average is None else average.value

    @property
    def move_seconds_per_token(self) -> float:
        """Device-lane seconds a move costs per token of KV: measured, else the link's seed, else 0."""
        if self._move_per_token.count:
            return self._move_per_token.value
        if self.link_seconds_per_byte is not None and self.kv_bytes_per_token:
            return self.link_seconds_per_byte * self.kv_bytes_per_token
        return 0.0

    @property
    def device_prefill_measured(self) -> bool:
        return self._device_prefill.count > 0 or self.device_prefill_elsewhere

    @property
    def host_prefill_seconds_per_token(self) -> float | None:
        """What a host-tier prompt token's prefill costs this device beyond a device-tier one's (None until
        measured). Where prompts prefill on another device (prefill_device) they cost this one nothing, except split
        rows, which prefill here: a host-tier token then costs its whole prefill step."""
        return self._host_prefill_extra.value

    @property
    def host_prefills_measured(self) -> int:
        """Samples behind host_prefill_seconds_per_token."""
        return self._host_prefill_extra.count

    def host_step_seconds(self, kv_bytes: int) -> float | None:
        """Predicted host step time for rows holding kv_bytes of KV, or None before a host step was measured."""
        per_byte = self.host_per_byte
        return None if per_byte is None else self.host_fixed.value + per_byte * kv_bytes

    @property
    def slowdown(self) -> float:
        """Device steps beside a host step over those without: the mean of per-row-count ratios busy / idle (a busy
        host lane coincides with full batches, slower anyway), each weighted by the steps behind its rarer side; 1.0
        until some row count was seen both ways."""
        return self._slowdown((False, True)) or 1.0

    @property
    def stream_slowdown_ratio(self) -> float:
        """How much slower device steps are beside a host step that streams than beside one that does not (the copies
        take SMs and PCIe); STREAM_SLOWDOWN_PRIOR until both were seen. At least 1: streaming only adds work to the
        device, so a ratio below 1 is noise (two samples taken at different times), and taken as it is it would make
        streaming pay whatever the host lane gains."""
        streaming, plain = self._slowdown((True,)), self._slowdown((False,))
        return max(1.0, streaming / plain) if streaming and plain else STREAM_SLOWDOWN_PRIOR

    def _slowdown(self, streams: tuple[bool, ...]) -> float | None:
        total = weight_sum = 0.0
        for (rows, busy, streaming), busy_avg in self._device_steps.items():
            idle_avg = self._device_steps.get((rows, False, False)) if busy and streaming in streams else None
            if idle_avg is None or not idle_avg.value:
                continue
            weight = min(idle_avg.count, busy_avg.count)
            total += weight * busy_avg.value / idle_avg.value
            weight_sum += weight
        return max(1.0, total / weight_sum) if weight_sum else None

    def snapshot(self) -> dict:
        """The check's inputs as they stand, and its outcomes so far (for benchmark JSON)."""
        return {"host_fixed_s": self.host_fixed.value, "host_kernel_s_per_gb": (self.host_per_byte or 0) * 1e9,
                "host_steps": self.host_fixed.count, "device_slowdown": self.slowdown,
                "device_tok_s": self.device_tok_s.value, "move_us_per_token": self.move_seconds_per_token * 1e6,
                "moves_measured": self._move_per_token.count,
                "host_prefill_extra_us_per_token": (self.host_prefill_seconds_per_token or 0.0) * 1e6,
                "host_prefills_measured": self._host_prefill_extra.count,
                "host_kernel_bytes": self.host_kernel_bytes, "stream_bytes": self.stream_bytes,
                "stream_share": self.stream_share,
                "host_kernel_gbps": 1e-9 / self.host_read_seconds_per_byte if self.host_read_seconds_per_byte else None,
                "stream_gbps": 1e-9 / self._stream_per_byte.value if self._stream_per_byte.value else None,
                "stream_slowdown_ratio": self.stream_slowdown_ratio, "host_step_parts": dict(self.host_step_parts),
                "checks": {f"{kind}_{'pays' if pays else 'refused'}": n for (kind, pays), n in self.checks.items()}}
