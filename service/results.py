"""What the engine reports: each step's phase times (`StepTimes`), each request's stats
(`RequestStats`), a streamed request's progress after a step (`Progress`), a finished request's
result (`GenerationResult`) and what a step did (`StepResult`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass
class StepTimes:
    """Wall-clock seconds of engine steps by phase. prefill = joining requests' prompts and KV
    slot moves (with Ray actors: the compute of every call posted since the last step);
    overhead = bookkeeping and the draft's commit; transfer = what the remote workers' calls
    took beyond their own compute (zero in-process)."""

    prefill: float = 0.0
    draft: float = 0.0
    tree: float = 0.0
    target: float = 0.0
    transfer: float = 0.0
    verify: float = 0.0
    overhead: float = 0.0
    batch_size: int = 0

    PHASES = ("prefill", "draft", "tree", "target", "transfer", "verify", "overhead")

    def add(self, other: StepTimes) -> None:
        for name in self.PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.batch_size += other.batch_size


@dataclass
class RequestStats:
    target_calls: int = 0
    accepted: int = 0  # draft tokens accepted in all
    accepted_per_position: list[int] = field(default_factory=list)  # [γ]: steps accepting pos i
    steps_by_config: Counter[str] = field(default_factory=Counter)  # steps per Arm (`auto`)
    # Sums over the steps this request was part of (their time is shared with its batch-mates).
    steps: StepTimes = field(default_factory=StepTimes)

    @property
    def mean_batch_size(self) -> float:
        return self.steps.batch_size / max(self.target_calls, 1)

    @property
    def tokens_per_call(self) -> float:
        """Block efficiency: emitted tokens per target call (accepted + 1 per call)."""
        return (self.accepted + self.target_calls) / max(self.target_calls, 1)

    def count_call(self, arm: str, accepted: int) -> None:
        """One more target call of this request, under `arm`, accepting `accepted` tokens."""
        self.target_calls += 1
        self.steps_by_config[arm] += 1
        self.accepted += accepted
        for pos in range(min(accepted, len(self.accepted_per_position))):
            self.accepted_per_position[pos] += 1

    def copy(self) -> RequestStats:
        return RequestStats(
            self.target_calls,
            self.accepted,
            list(self.accepted_per_position),
            Counter(self.steps_by_config),
            replace(self.steps),
        )


@dataclass(frozen=True)
class Progress:
    """A streamed request after one step: the tokens the step added to its output, and, for
    a request with stop strings, its stats so far (a copy, whole for the step): the gateway
    may cut its stream at one, and then finishes it with these. Without stop strings nothing
    cuts a stream short, so no step copies or ships them (None)."""

    token_ids: list[int]
    stats: RequestStats | None
    cached_tokens: int


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" (a cancelled request has no result)
    stats: RequestStats
    cached_tokens: int = 0  # prompt tokens whose target KV came from the session's parked slot


@dataclass
class StepResult:
    """What one engine step did: the requests it finished and where its time went."""

    finished: list[GenerationResult]
    times: StepTimes  # this step's (all zero when there was nothing to run)
