"""The coordinator: scheduler and decode loop over one engine, fed from asyncio request handlers.

Engine steps block (they wait for the draft and target actors), so the loop runs on its own
thread and the request side talks to it through an inbox: `submit` queues a request, `cancel`
drops one (the engine frees its KV slot between two steps). Every step admits whatever arrived
(continuous batching of *all* concurrent requests), enforces deadlines, runs one engine step and
hands each request its new tokens through a thread-safe callback.

Admission control: at most max_batch requests run and max_queued wait; beyond that `submit`
raises `Overloaded` at once (the gateway answers RESOURCE_EXHAUSTED) rather than letting
latency grow without bound.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blockspec.service.engine import SpeculativeEngine
from blockspec.service.requests import GenerationRequest
from blockspec.service.results import GenerationResult, Progress, StepResult, StepTimes
from blockspec.workers.actors import WorkerLost

log = logging.getLogger(__name__)

# Worker actors lost in a row (no step succeeding in between) before the replica gives up.
MAX_RECOVERIES = 3


class Overloaded(Exception):
    """The replica's queue is full (RESOURCE_EXHAUSTED)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED)."""


class RequestLost(RuntimeError):
    """A worker restart lost state that the request's output law depends on (a feature draft's
    own features under a live greedy-block record): it ends with UNAVAILABLE, to be retried,
    rather than continue from a rebuilt state under another law."""


LOST_MESSAGE = "a worker restarted while the request's draft held state it cannot rebuild; retry"


class ReplicaFailed(RuntimeError):
    """A step failed (worker actors that could not be brought back, say); this replica serves
    no more (UNAVAILABLE)."""


# What a request's `deliver` callback receives, on the coordinator's thread: Emitted after each
# step it took part in, then one Done or Failed.
@dataclass
class Emitted:
    progress: Progress  # the step's new output tokens, and the request's stats so far


@dataclass
class Done:
    result: GenerationResult


@dataclass
class Failed:
    error: BaseException  # DeadlineExceeded, RequestLost or ReplicaFailed


Event = Emitted | Done | Failed
Deliver = Callable[[Event], None]


# The inbox: what the request side asks of the loop thread.
@dataclass
class _Add:
    request_id: str


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Job:
    request: GenerationRequest
    deliver: Deliver


@dataclass
class CoordinatorStats:
    """Cumulative counters since start (the replica's `stats` RPC; tests and load tests)."""

    steps: int = 0
    times: StepTimes | None = None
    batch_sizes: collections.Counter | None = None  # batch size -> steps that ran it
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    recoveries: int = 0  # times the worker actors were restarted after one died


class Coordinator:
    def __init__(
        self,
        engine: SpeculativeEngine,
        max_queued: int,
        on_step: Callable[[StepTimes, int], None] | None = None,
    ):
        self.engine = engine
        self.capacity = engine.max_batch + max_queued
        self.on_step = on_step  # metrics hook: (step times, queue depth after the step)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.stats = CoordinatorStats(times=StepTimes(), batch_sizes=collections.Counter())
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ request side (any thread)
    def submit(self, request_id: str, request: GenerationRequest, deliver: Deliver) -> None:
        """Queue a checked request (service/requests.py) under `request_id`, which must be
        unique among those in flight (RuntimeError otherwise: a bug of ours, not the
        client's); raises Overloaded or ReplicaFailed."""
        if self.failure is not None:
            raise ReplicaFailed(f"replica failed: {self.failure!r}")
        with self._lock:
            if request_id in self._jobs:  # the replica numbers its requests
                raise RuntimeError(f"request id {request_id!r} is already in flight")
            if len(self._jobs) >= self.capacity:
                self.stats.rejected += 1
                raise Overloaded(
                    f"queue full: {len(self._jobs)} requests in flight (limit {self.capacity})"
                )
            self._jobs[request_id] = _Job(request, deliver)
        self._inbox.put(_Add(request_id))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def healthy(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def close(self) -> None:
        self._inbox.put(_Stop())
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ loop (own thread)
    @staticmethod
    def _streamer(deliver: Deliver, read_at_end: bool) -> Callable[[Progress], None]:
        """The engine's on_tokens callback for a request: each step's progress as Emitted; for
        a request read at its end, only the first step's (its tokens come with Done: nothing
        crosses to the requester's thread in between)."""
        if not read_at_end:
            return lambda progress: deliver(Emitted(progress))
        first = []

        def first_only(progress: Progress) -> None:
            if progress.token_ids and not first:
                first.append(True)
                deliver(Emitted(progress))

        return first_only

    def _finish(self, request_id: str, event: Done | Failed) -> None:
        with self._lock:
            job = self._jobs.pop(request_id, None)
        if job is not None:
            job.deliver(event)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            match command:
                case _Stop():
                    return False
                case _Add(request_id):
                    job = self._jobs.get(request_id)
                    if job is not None:  # None: cancelled or expired before it was added
                        on_tokens = self._streamer(job.deliver, job.request.read_at_end)
                        self.engine.add(job.request, request_id, on_tokens)
                case _Cancel(request_id):  # the requester has gone: nobody to deliver to
                    if self.engine.cancel(request_id):
                        self.stats.cancelled += 1
                    with self._lock:
                        self._jobs.pop(request_id, None)

    def _expire(self) -> None:
        now = time.time()
        late = [
            rid
            for rid, job in list(self._jobs.items())
            if job.request.deadline and job.request.deadline < now
        ]
        for rid in late:
            if self.engine.cancel(rid):
                self.stats.cancelled += 1
            self._finish(rid, Failed(DeadlineExceeded("deadline exceeded")))

    def _run(self) -> None:
        engine = self.engine
        try:
            while self._drain_inbox(block=not (engine.active or engine.waiting)):
                self._expire()
                if not (engine.active or engine.waiting):
                    continue
                step = self._step()
                self._record(step.times)
                for result in step.finished:
                    self.stats.finished += 1
                    self._finish(result.request_id, Done(result))
                if self.on_step is not None:
                    self.on_step(step.times, len(engine.waiting))
        except BaseException as exc:  # a worker died or a step failed: fail everything
            self.failure = exc
            with self._lock:
                jobs, self._jobs = self._jobs, {}
            for job in jobs.values():
                job.deliver(Failed(ReplicaFailed(f"replica failed: {exc!r}")))

    def _step(self) -> StepResult:
        """One engine step; when a worker actor dies, restart the workers, rebuild their caches
        and redo the step (requests see a delay, not an error, and the same tokens)."""
        for attempt in range(1, MAX_RECOVERIES + 1):
            try:
                return self.engine.step()
            except WorkerLost as exc:
                log.warning("worker lost (%s); restarting (attempt %d)", exc, attempt)
                start = time.perf_counter()
                for request_id in self.engine.recover():
                    self.stats.cancelled += 1
                    self._finish(request_id, Failed(RequestLost(LOST_MESSAGE)))
                self.stats.recoveries += 1
                log.warning("workers back after %.1f s", time.perf_counter() - start)
        return self.engine.step()  # a failure now fails the replica

    def _record(self, times: StepTimes) -> None:
        self.stats.steps += 1
        self.stats.times.add(times)
        self.stats.batch_sizes[times.batch_size] += 1
