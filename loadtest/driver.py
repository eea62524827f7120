"""Async gRPC load: closed-loop concurrency and open-loop Poisson arrivals, one record per request.

Every request streams (GenerateStream), so time to first token is measured where the client
sees it. Randomness (prompt order, arrival times, request seeds) comes from one seeded
`random.Random`, so a run is repeatable up to the service's own timing.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.auth import bearer, client_channel

OWN_CHOICE = ("none", "auto")  # methods with no K or γ of their own (auto picks them itself)


@dataclass(frozen=True)
class Config:
    """One point of the grid: a verification method with its K, γ and temperature."""

    method: str
    k: int
    gamma: int
    temperature: float

    @property
    def label(self) -> str:
        if self.method in OWN_CHOICE:
            return f"{self.method} T={self.temperature}"
        return f"{self.method} K={self.k} γ={self.gamma} T={self.temperature}"

    @staticmethod
    def parse(text: str) -> Config:
        """'method:K:γ:T', e.g. 'gbv:2:4:1.0' (K, γ, T optional: 1, 4, 1.0)."""
        parts = text.split(":")
        method, rest = parts[0], [*parts[1:], "", "", ""][:3]
        return Config(method, int(rest[0] or 1), int(rest[1] or 4), float(rest[2] or 1.0))


@dataclass
class Record:
    config: str
    load: str  # "c=8" (closed loop) or "rate=2.0" (open loop, requests/s)
    start: float  # seconds since the run started
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks with tokens
    tokens: int = 0
    target_calls: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    mean_batch_size: float = 0.0
    step_ms: dict[str, float] = field(default_factory=dict)
    steps_by_config: dict[str, int] = field(default_factory=dict)  # what ran (method auto)
    code: str = "OK"
    detail: str = ""  # the error message, if any
    replica: str = ""


class Client:
    def __init__(
        self,
        address: str,
        max_new_tokens: int,
        timeout_s: float,
        tls_ca: str | None = None,
        token: str | None = None,
    ):
        self.channel = client_channel(address, tls_ca, aio=True)
        self.metadata = bearer(token)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.max_new_tokens, self.timeout_s = max_new_tokens, timeout_s
        self.t0 = time.perf_counter()

    async def close(self) -> None:
        await self.channel.close()

    async def one(self, cfg: Config, prompt: list[int], seed: int, load: str) -> Record:
        req = pb.GenerateRequest(
            prompt_token_ids=prompt,
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.temperature,
            method=cfg.method,
            k=cfg.k if cfg.method != "none" else 1,
            gamma=cfg.gamma,
            seed=seed,
            ignore_eos=True,  # every request produces max_new_tokens: comparable work
        )
        start = time.perf_counter()
        rec = Record(cfg.label, load, start - self.t0)
        last = None
        try:
            stream = self.stub.GenerateStream(req, timeout=self.timeout_s, metadata=self.metadata)
            async for chunk in stream:
                if chunk.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                rec.tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    s = chunk.stats
                    rec.target_calls = s.target_calls
                    rec.accepted_per_position = list(s.accepted_per_position)
                    rec.mean_batch_size = s.mean_batch_size
                    rec.step_ms = {
                        f.name: getattr(s.step_ms, f.name)
                        for f in pb.StepBreakdown.DESCRIPTOR.fields
                    }
                    rec.steps_by_config = dict(s.steps_by_config)
                    rec.replica = chunk.replica
        except grpc.aio.AioRpcError as err:
            rec.code, rec.detail = err.code().name, err.details() or ""
        rec.latency_s = time.perf_counter() - start
        return rec


async def closed_loop(
    client: Client,
    pick: Callable[[], tuple[Config, list[int], int]],
    concurrency: int,
    requests: int,
    duration_s: float | None,
    on_done: Callable[[Record], None],
) -> list[Record]:
    """`concurrency` workers, each sending its next request when the last one finished, until
    `requests` have been sent (or `duration_s` passed)."""
    records: list[Record] = []
    sent = 0
    end = time.perf_counter() + duration_s if duration_s else None

    async def worker() -> None:
        nonlocal sent
        while sent < requests and (end is None or time.perf_counter() < end):
            sent += 1
            cfg, prompt, seed = pick()
            rec = await client.one(cfg, prompt, seed, f"c={concurrency}")
            records.append(rec)
            on_done(rec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def open_loop(
    client: Client,
    pick: Callable[[], tuple[Config, list[int], int]],
    rate: float,
    requests: int,
    rng: random.Random,
    on_done: Callable[[Record], None],
) -> list[Record]:
    """Poisson arrivals at `rate` requests/s, independent of how fast the service answers."""

    async def send(cfg, prompt, seed) -> Record:
        rec = await client.one(cfg, prompt, seed, f"rate={rate:g}")
        on_done(rec)
        return rec

    tasks = []
    for i in range(requests):
        if i:  # the first goes at once; no wait after the last (it would count in the wall time)
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(send(*pick())))
    return list(await asyncio.gather(*tasks))
