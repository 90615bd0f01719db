"""One request as the engine tracks it: its tokens, how many have KV in the cache, and where that KV lives."""
from enum import Enum, auto
from itertools import count

from offload_engine.sampling_params import SamplingParams

# Async scheduling: a token a device step in flight sampled, unknown on the host (Scheduler.launched, resolve).
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class BlockLocation(Enum):
    GPU = "gpu"
    CPU = "cpu"


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, budget: int):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.budget = budget  # the most tokens it can ever hold: prompt + max_tokens, capped at max_model_len
        self.status = SequenceStatus.WAITING
        self.location: BlockLocation | None = None
        self.admitted_to: BlockLocation | None = None  # the tier chosen at admission, kept for the output
        self.promoted = False
        self.demoted = False
        self.block_table: list[int] = []  # block ids in its tier's pool (a split sequence: its host part's)
        # A split sequence's first num_device_tokens tokens' KV (docs/design.md, "Sequences across both tiers").
        self.device_prefix: list[int] = []
        self.num_device_tokens = 0
        self.admitted_device_tokens = 0  # a split sequence's num_device_tokens at admission, for the output
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_scheduled_tokens = 0
        self.held_since: int | None = None  # the engine step it was first held so host rows move up first
        self.num_hashed_blocks = 0  # leading full blocks already registered for prefix reuse
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string its text showed, where one ended it
        self.after: "Sequence | None" = None  # a sibling (SamplingParams.n) whose prompt must be computed first
        self.min_tokens_bans: list[int] = []  # ids not drawn before params.min_tokens: eos and stop tokens
        # position -> (token, logprob, rank, [(id, logprob)] top-k): its tokens' (SamplingParams.logprobs /
        # prompt_logprobs), filled as they are sampled or prefilled
        self.token_logprobs: dict[int, tuple] = {}
        # In a host step, a promotion's copy or on the prefill lane, not back yet: the scheduler leaves it alone.
        self.in_flight = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_split(self) -> bool:
        return bool(self.device_prefix)

    @property
    def num_host_tokens(self) -> int:
        """Tokens whose KV is (or will be) in block_table's tier: all of them but a split sequence's device part."""
        return len(self) - self.num_device_tokens

    @property
    def kv_location(self) -> str:
        """Where its KV was placed at admission: "gpu", "cpu" or "split" (RequestOutput.kv_location)."""
        return "split" if self.admitted_device_tokens else self.admitted_to.value

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate before its budget ends it (eos may end it sooner)."""
        return self.budget - len(self)

    @property
    def in_prefill(self) -> bool:
        """More than the one newest token lacks KV: the next step for it is a (chunked) prefill."""
        return self.num_uncomputed_tokens > 1 or self.num_computed_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
