"""One engine step's plan, made by Scheduler.plan from a LaneState and carried out by LLMEngine._step in this order:
the promotions; then the prefill step, or the host-lane step, the demotions and the device-lane step (without device
rows, the wait). docs/design.md, "One engine step, two decode lanes".
"""
from dataclasses import dataclass
from enum import Enum

from offload_engine.engine.sequence import Sequence

Move = tuple[Sequence, list[int]]  # a sequence and the blocks that still hold its KV on the tier it leaves


class Wait(Enum):
    """What a step without device rows waits for (the first of these that is under way)."""

    NOTHING = "nothing"  # nothing is in flight: the step only took in what came back
    DEVICE_STEP = "device_step"  # the device-lane step queued last, whose tokens are not read yet
    PROMOTIONS = "promotions"  # promotions' copies: their rows are the device lane's next ones
    PREFILL_LANE = "prefill_lane"  # the prefill lane's step or its KV's landing, or the host step if sooner
    HOST_STEP = "host_step"


@dataclass(frozen=True)
class LaneState:
    """What the lanes have in flight as a step is planned, and what the runner allows beside them."""

    host_step_in_flight: bool = False
    device_step_in_flight: bool = False  # async scheduling: the last device step's tokens are unread
    promotions_landing: bool = False
    may_promote: bool = True  # a promotion can start now (no host step holds what its copy needs)
    promotions_sit_out: bool = False  # a promotion's copy lands after this step: its rows sit out both lanes till then
    hold_back_horizon: float | None = None  # device steps one host step spans (None: no promotion beside host steps)
    prefill_lane: bool = False  # device-tier prompts prefill on another device
    prefill_lane_computing: bool = False  # a batch is on the prefill lane: no other prefill is scheduled
    prefill_lane_busy: bool = False  # ... or its KV is still crossing


@dataclass(frozen=True)
class StepPlan:
    """A step is a prefill step (`prefill` has rows, nothing decodes) or a decode step (the rest)."""

    promotions: tuple[Move, ...] = ()  # host-tier rows moving into device blocks (split rows' growths too)
    prefill: tuple[Sequence, ...] = ()
    prefill_elsewhere: tuple[Sequence, ...] = ()  # prompt chunks for the prefill lane
    host_rows: tuple[Sequence, ...] = ()  # a host-lane step to start now
    device_rows: tuple[Sequence, ...] = ()
    demotions: tuple[Move, ...] = ()  # device rows moving to host blocks, with their old device blocks
    first_freed_blocks: tuple[int, ...] = ()  # of those, the blocks the next steps may write: their copy goes first
    wait: Wait = Wait.NOTHING  # without device rows
    idle_host_rows: tuple[Sequence, ...] = ()  # without device rows: a host step started before the wait

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)

    @property
    def moved_tokens(self) -> int:
        """Tokens of KV this step's moves copy (LaneStats.move_done)."""
        return sum(seq.num_computed_tokens for seq, _ in self.promotions + self.demotions)
