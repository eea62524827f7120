"""`method: auto`: before each step, pick the (method, K, γ) that maximises the batch's expected
emitted tokens per second, from what this replica has measured so far.

For the step's auto requests R, the chosen arm a maximises

    Σ_{r ∈ R} E[tokens_r | a] / T̂(step with a)

- E[tokens_r | a] = 1 + Σ_{i=1..γ} Π_{j≤i} c_r(a, j): one recovered or bonus token plus the
  expected accepted prefix, capped at what r still has to generate. c_r(a, j) is the
  conditional acceptance at draft position j, P[τ ≥ j | τ ≥ j-1], with arm a: request r's own
  past steps with a, shrunk toward the replica-wide rate by PRIOR_STEPS pseudo-steps. A new
  request starts from the replica's experience; one whose text drafts well (code, boilerplate)
  earns long drafts of its own.
- T̂ is the step's predicted seconds: a linear model of the step's shape (`StepShape`: batch
  size, tree nodes, draft depth, multi-path nodes, prompt tokens prefilled) fitted by least
  squares with forgetting to this replica's own steps, plus a per-arm correction (the arm's
  mean residual over its latest steps: a method's verification cost, say). The model carries what
  a step at batch 8 taught to batch 16, so the policy need not explore every arm at every
  batch size; the correction keeps an arm honest where the line is wrong. `none` (γ = 0) is
  an arm like any other, and fixed-method batch-mates count in the shape.
- Exploration: every arm runs EXPLORE_STEPS steps before the policy exploits; after that every
  REVISIT-th choice re-runs the arm run longest ago, so estimates follow drift (prompt mix,
  load, a noisy neighbour). All of it is deterministic.

Why `auto` stays lossless (docs/auto.md has the argument in full): the choice is a function of
finished steps only (counters and timings) and is made before the step draws anything. Given
the past, the step is an ordinary step of a lossless verifier, so its emitted tokens follow the
target's law given the prefix; by induction over steps so does the whole output. Methods that
carry a modified target from step to step (greedy_block, spectr_gbv) are lossless only when
every step of the request uses them, so they are never candidates.

Seeded `auto` requests: the draws a step makes depend on the arm, so the exact tokens depend on
the replica's history and load (their law does not). Name a method for reproducible output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from blockspec.verification import VERIFIERS
from blockspec.workers.step import PLAIN

AUTO = "auto"

PRIOR_STEPS = 8.0  # weight of the replica-wide rate in a request's estimate, in steps
UNSEEN_RATE = 0.5  # conditional acceptance assumed where nothing was measured
REPLICA_DECAY = 0.995  # per request-step observed: the replica-wide rates follow drift
EXPLORE_STEPS = 2  # steps each arm runs before the policy exploits
REVISIT = 32  # every REVISIT-th choice re-runs the arm run longest ago
COST_DECAY = 0.999  # forgetting factor of the step-cost fit, per step
RIDGE = 1e-6  # relative ridge of the step-cost fit (see StepCost.add)
RESIDUAL_STEPS = 8  # an arm's correction: its mean residual over this many latest steps


@dataclass(frozen=True)
class Arm:
    """One configuration `auto` can run a step with; `none` has K = γ = 0."""

    method: str
    k: int = 0
    gamma: int = 0

    @property
    def nodes(self) -> int:
        """Draft tokens this arm puts in one request's tree (an upper bound: shared prefixes
        of K paths merge)."""
        return self.k * self.gamma

    def __str__(self) -> str:
        return PLAIN if self.method == PLAIN else f"{self.method}/{self.k}/{self.gamma}"

    @staticmethod
    def parse(text: str) -> Arm:
        """`none` or `method/K/γ`, e.g. `block/1/4`; checked against the verifier registry."""
        if text == PLAIN:
            return Arm(PLAIN)
        arm = Arm.parse_shape(text, "auto_arms", "is not 'none' or 'method/K/γ'")
        if VERIFIERS[arm.method].modifies_target:
            raise ValueError(
                f"auto_arms: {text!r}: {arm.method} carries a modified target between steps, "
                "so it cannot be switched to and from (it stays available by name)"
            )
        return arm

    @staticmethod
    def parse_shape(text: str, field: str, malformed: str = "is not 'method/K/γ'") -> Arm:
        """A speculative `method/K/γ` (K = 1 for a single-path method); ValueError naming
        `field` and what is wrong."""
        try:
            method, k, gamma = text.split("/")
            arm = Arm(method, int(k), int(gamma))
        except ValueError:
            raise ValueError(f"{field}: {text!r} {malformed}") from None
        verifier = VERIFIERS.get(arm.method)
        if verifier is None:
            raise ValueError(f"{field}: {text!r}: unknown method {arm.method!r}")
        if arm.k < 1 or arm.gamma < 1 or (verifier.single_path and arm.k != 1):
            raise ValueError(f"{field}: {text!r}: K and γ must be >= 1 (K = 1 for {method})")
        return arm


DEFAULT_ARMS = ("none", "block/1/1", "block/1/2", "block/1/3", "block/1/4", "block/1/6", "gbv/2/3")


@dataclass
class Acceptance:
    """Counts of one arm at each draft position j = 1.. (index j - 1): steps that reached j
    (accepted j - 1 and drafted ≥ j) and steps that accepted it."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def add(self, gamma: int, tau: int, decay: float = 1.0) -> None:
        """Count a step that drafted γ tokens and accepted τ; older counts weigh `decay`."""
        grow = gamma - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        if decay != 1.0:
            self.reached = [decay * x for x in self.reached]
            self.accepted = [decay * x for x in self.accepted]
        for j in range(min(tau + 1, gamma)):
            self.reached[j] += 1.0
        for j in range(tau):
            self.accepted[j] += 1.0

    def rates(self, depth: int, prior: Sequence[float] | None = None) -> list[float]:
        """Conditional acceptance at positions 1..depth. With a prior (rates of the same
        length): shrunk toward it; without: positions never reached repeat the last known
        rate (UNSEEN_RATE when none is)."""
        out, last = [], UNSEEN_RATE
        for j in range(depth):
            reached = self.reached[j] if j < len(self.reached) else 0.0
            accepted = self.accepted[j] if j < len(self.accepted) else 0.0
            if prior is not None:
                last = (accepted + PRIOR_STEPS * prior[j]) / (reached + PRIOR_STEPS)
            elif reached > 0:
                last = accepted / reached
            out.append(last)
        return out


@dataclass
class AutoState:
    """What `auto` keeps of one request: its acceptance per arm, and its limits."""

    max_gamma: int  # the longest draft its context leaves room for
    remaining: int  # tokens still to generate
    arms: dict[Arm, Acceptance] = field(default_factory=dict)


FEATURES = 6  # of StepShape.features


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: its batch, the draft tokens of the requests whose
    configuration is fixed, and the prompt tokens prefilled for joining requests."""

    batch_size: int
    fixed_nodes: int = 0  # Σ K·γ over fixed-method requests
    fixed_multi_nodes: int = 0  # the same, over those with K > 1
    fixed_depth: int = 0  # their largest γ: the draft's sequential forwards
    prefill_tokens: int = 0

    @classmethod
    def of(cls, batch_size: int, fixed: Sequence[Arm], prefill_tokens: int) -> StepShape:
        """A batch's shape, given the arms of its requests that are not auto."""
        drafted = [arm for arm in fixed if arm.method != PLAIN]
        return cls(
            batch_size=batch_size,
            fixed_nodes=sum(arm.nodes for arm in drafted),
            fixed_multi_nodes=sum(arm.nodes for arm in drafted if arm.k > 1),
            fixed_depth=max((arm.gamma for arm in drafted), default=0),
            prefill_tokens=prefill_tokens,
        )

    def features(self, arm: Arm, n_auto: int) -> list[float]:
        """[1, batch, draft depth, tree nodes, multi-path nodes, prefill tokens] of the step
        with the auto requests on `arm`."""
        nodes = self.fixed_nodes + n_auto * arm.nodes
        multi = self.fixed_multi_nodes + (n_auto * arm.nodes if arm.k > 1 else 0)
        depth = max(self.fixed_depth, arm.gamma)
        return [1.0, self.batch_size, depth, nodes, multi, self.prefill_tokens]


class StepCost:
    """Predicted step seconds: least squares over the replica's recent steps (exponential
    forgetting) on `StepShape.features`, plus the arm's mean residual over its last
    RESIDUAL_STEPS steps, against the current fit."""

    def __init__(self):
        self.gram = torch.zeros(FEATURES, FEATURES, dtype=torch.float64)  # Σ w x xᵀ
        self.moment = torch.zeros(FEATURES, dtype=torch.float64)  # Σ w x y
        self.theta = torch.zeros(FEATURES, dtype=torch.float64)
        self.recent: dict[Arm, deque[tuple[torch.Tensor, float]]] = {}

    def predict(self, x: list[float], arm: Arm) -> float:
        line = float(self.theta @ torch.tensor(x, dtype=torch.float64))
        recent = self.recent.get(arm)
        if recent:
            xs = torch.stack([v for v, _ in recent])
            ys = torch.tensor([y for _, y in recent], dtype=torch.float64)
            line += float((ys - xs @ self.theta).mean())
        return max(line, 1e-6)

    def add(self, x: list[float], arm: Arm, seconds: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self.recent.setdefault(arm, deque(maxlen=RESIDUAL_STEPS)).append((v, seconds))
        self.gram.mul_(COST_DECAY).add_(torch.outer(v, v))
        self.moment.mul_(COST_DECAY).add_(v * seconds)
        # Ridge relative to each feature's own scale: a feature that never varied, or one
        # collinear with others so far (depth and nodes at batch 1), gets a small weight
        # rather than a wild one.
        damped = self.gram + torch.diag(RIDGE * self.gram.diagonal() + 1e-12)
        self.theta = torch.linalg.solve(damped, self.moment)


def expected_tokens(rates: Sequence[float], remaining: int) -> float:
    """1 + Σ_i Π_{j≤i} rates[j], counting at most `remaining` tokens in all."""
    total, run = 1.0, 1.0
    for rate in rates[: max(remaining - 1, 0)]:
        run *= rate
        total += run
    return total


class AutoPolicy:
    """Chooses each step's arm for the batch's auto requests (one arm for all of them) and
    learns from the step's outcome; one per engine, used on the engine's thread."""

    def __init__(
        self,
        arms: Iterable[str] = DEFAULT_ARMS,
        explore_steps: int = EXPLORE_STEPS,
        revisit: int = REVISIT,
    ):
        self.arms = [Arm.parse(a) for a in arms]
        if not self.arms:
            raise ValueError("auto_arms: at least one arm")
        self.explore_steps, self.revisit = explore_steps, revisit
        self.max_gamma = max(a.gamma for a in self.arms)
        self.cost = StepCost()
        self.replica: dict[Arm, Acceptance] = {}  # acceptance of every auto request, decayed
        self.runs: dict[Arm, int] = {}  # steps run
        self.last_run: dict[Arm, int] = {}  # choice count when last run
        self.choices = 0

    def choose(self, requests: Sequence[AutoState], shape: StepShape) -> Arm:
        """The arm for this step; `requests` are the batch's auto requests."""
        fits = min(r.max_gamma for r in requests)
        arms = [a for a in self.arms if a.gamma <= fits] or [Arm(PLAIN)]
        self.choices += 1
        unexplored = [a for a in arms if self.runs.get(a, 0) < self.explore_steps]
        if unexplored:
            return unexplored[0]
        if self.choices % self.revisit == 0:
            return min(arms, key=lambda a: self.last_run.get(a, 0))
        return max(arms, key=lambda a: self.goodput(a, requests, shape))

    def goodput(self, arm: Arm, requests: Sequence[AutoState], shape: StepShape) -> float:
        """Expected emitted tokens per second of `requests` with `arm`."""
        tokens = float(len(requests))
        if arm.method != PLAIN:
            prior = self.replica.get(arm, Acceptance()).rates(arm.gamma)
            tokens = sum(
                expected_tokens(r.arms.get(arm, Acceptance()).rates(arm.gamma, prior), r.remaining)
                for r in requests
            )
        return tokens / self.cost.predict(shape.features(arm, len(requests)), arm)

    def observe(
        self,
        arm: Arm,
        shape: StepShape,
        seconds: float,
        outcomes: Sequence[tuple[AutoState, int]],
    ) -> None:
        """Learn from a finished step: its wall time, and each auto request's accepted count τ."""
        self.cost.add(shape.features(arm, len(outcomes)), arm, seconds)
        self.runs[arm] = self.runs.get(arm, 0) + 1
        self.last_run[arm] = self.choices
        if arm.method == PLAIN:
            return
        replica = self.replica.setdefault(arm, Acceptance())
        for state, tau in outcomes:
            state.arms.setdefault(arm, Acceptance()).add(arm.gamma, tau)
            replica.add(arm.gamma, tau, decay=REPLICA_DECAY)
