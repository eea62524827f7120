"""Warm-up: capture the CUDA graphs a deployment's decode steps meet, or compile the forwards
they run (workers/compiled.py), before it serves.

Why: a graph captured while serving stalls the whole batch (a device sync, then the capture,
tens of milliseconds), and a capture that fails there leaves a slow path found mid-stream;
a compile while serving stalls it for seconds to minutes.
So an engine whose decode step replays from graphs (workers/graphs.py, verification/graphs.py)
is driven through every shape its declared work can meet, with each graph cache `strict` (a
failed capture raises: an error at start); then the caches are `sealed`: a shape met later
runs eagerly (counted in each cache's ``eager_calls``) and nothing captures while serving.
The caches are reached through the engine's executor (`StepExecutor.graphs`): in this
process, or in the draft and target actors (a replica warms up when it starts).

What a step's graphs are keyed by, and how the warm-up meets each:

- the batch bucket (a power of two within the slots): a run of n requests for the largest n
  of each bucket; as they finish at different steps the batch shrinks through the smaller ones
  (compiled forwards without graphs: runs of 1 and 2 requests, `_compiled_sizes`);
- the prefix window (`window_bucket`): prompts just past the window below, so that a few
  steps stay within the window;
- K and γ: the target's tree pass by the batch's largest Kγ, the verify calls by each group's
  own (method, K, γ), the draft's proposal and the tree's build by the batch's largest K and
  largest γ: runs of each declared shape alone, and mixed runs of two shapes for each such
  pair of maxima no shape has itself;
- the draft's law (which sampling steps run: `workers.sampling.Law.steps`): one run per
  distinct set of steps that batches of the declared `samplings` give;
- the draft's pending run: one width with graphs (`workers.draft.GRAPHED_PENDING`).

A plain request (``none``) is always served, so its shape is always warmed.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from blockspec.service.policy import PLAIN
from blockspec.service.requests import GenerationRequest, make_request
from blockspec.workers import graphs as worker_graphs
from blockspec.workers.sampling import SamplingParams, law_of
from blockspec.workers.step import GraphCounts

log = logging.getLogger(__name__)

Shape = tuple[str, int, int]  # (method, K, γ)
STEPS_PER_RUN = 3  # decode steps each run makes at least
# The samplings whose batches' laws are warmed by default: T = 1, greedy, another temperature
# (and their mixes). A batch with top-k or top-p runs its draft's proposal eagerly.
SAMPLINGS = (SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7))


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: requests' runs through the engine, graphs held after, seconds."""

    runs: int
    graphs: int
    seconds: float


def warm_up(
    engine,
    shapes: list[Shape],
    samplings: list[SamplingParams] | None = None,
    max_context: int | None = None,
    compiles: bool = False,
) -> WarmUp:
    """Capture every graph `engine`'s steps meet serving `shapes` (and ``none``) with batches
    of `samplings` (default: SAMPLINGS) in contexts of up to `max_context` tokens (default:
    the engine's), then seal the caches; with `compiles` (its forwards go through
    torch.compile), run those steps even where no graphs are on, so that each kind of call
    compiles here. Raises RuntimeError when a capture fails, or when the graphs outgrow a
    cache's bounds (a later call would recapture)."""
    graphs = engine.executor.graphs  # wherever the step's graphs live: here or in actors
    before = graphs()
    if not before and not compiles:  # nothing to capture or compile
        return WarmUp(0, 0, 0.0)
    start, runs = time.perf_counter(), 0
    graphs(strict=True, sealed=False)
    try:
        sizes = _batch_sizes(engine) if before else _compiled_sizes(engine)
        for prompt_len in _prompt_lengths(min(max_context or engine.max_len, engine.max_len)):
            for n in sizes:
                for batch in _batches(shapes, n, list(samplings or SAMPLINGS)):
                    engine.generate(_requests(engine, batch, prompt_len))
                    runs += 1
                    _check_kept(before, graphs())
    finally:
        graphs(strict=False)
    after = graphs(sealed=True)
    engine.reset_stats()
    report = WarmUp(runs, sum(c.held for c in after), time.perf_counter() - start)
    log.info("warm-up: %d runs, %d graphs held, in %.1f s", *vars(report).values())
    return report


def _check_kept(before: list[GraphCounts], now: list[GraphCounts]) -> None:
    """Raises RuntimeError when a cache dropped a graph the warm-up captured."""
    for i, (was, now_) in enumerate(zip(before, now, strict=True)):
        captured, kept = now_.captures - was.captures, now_.held - was.held
        if captured > kept:
            raise RuntimeError(
                f"warm-up: graph cache {i} captured {captured} graphs and kept {kept}: "
                "the declared shapes need more than its bounds"
            )


def _prompt_lengths(max_context: int) -> list[int]:
    """A prompt length per prefix window that contexts of up to `max_context` tokens reach:
    short in the first, just past the one below in the others."""
    lengths, window = [4], worker_graphs.MIN_WINDOW
    while window < max_context:
        lengths.append(window + 2)
        window *= 2
    return lengths


def _batch_sizes(engine) -> list[int]:
    """The largest batch of each bucket the engine's active slots reach."""
    slots = engine.max_batch + engine.max_sessions
    by_bucket = {worker_graphs.batch_bucket(n, slots): n for n in range(1, engine.max_batch + 1)}
    return sorted(by_bucket.values())


def _compiled_sizes(engine) -> list[int]:
    """Batches that meet every compiled graph without CUDA graphs: dynamo specializes a size
    of 1 and keeps one graph for every size above it (workers/compiled.py)."""
    return [1, 2] if engine.max_batch > 1 else [1]


def _batches(shapes: list[Shape], n: int, samplings: list[SamplingParams]):
    """The runs of `n` requests at one window: (shape, sampling) per request."""
    laws = _law_mixes(samplings)
    for shape in [(PLAIN, 0, 0), *shapes]:
        for mix in laws[:1] if shape[0] == PLAIN else laws:  # only a draft reads its law
            yield [(shape, mix[i % len(mix)]) for i in range(n)]
    if n < 2:
        return
    alone = {(k, gamma) for _, k, gamma in shapes}
    for a, b in itertools.combinations(shapes, 2):
        maxima = (max(a[1], b[1]), max(a[2], b[2]))
        if maxima not in alone:
            alone.add(maxima)
            for mix in laws:
                yield [((a, b)[i % 2], mix[i % len(mix)]) for i in range(n)]


def _law_mixes(samplings: list[SamplingParams]) -> list[list[SamplingParams]]:
    """One mix of the samplings for each distinct set of law steps their batches run."""
    mixes: dict[tuple, list[SamplingParams]] = {}
    for size in range(1, len(samplings) + 1):
        for mix in itertools.combinations(samplings, size):
            mixes.setdefault(law_of(list(mix), 1 << 16, "cpu").steps, list(mix))
    return list(mixes.values())


def _requests(engine, batch: list, prompt_len: int) -> list[GenerationRequest]:
    """Seeded requests of `prompt_len` tokens that decode at least STEPS_PER_RUN steps."""
    reqs = []
    for i, ((method, k, gamma), sampling) in enumerate(batch):
        prompt = [(7 * i + 3 * j + 1) % engine.vocab_size for j in range(prompt_len)]
        new = STEPS_PER_RUN * (gamma + 1)
        k, gamma = (None, None) if method == PLAIN else (k, gamma)
        reqs.append(make_request(engine.limits, prompt, new, method, k, gamma, sampling, seed=i))
    return reqs
