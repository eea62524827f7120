"""Chaos and soak run: mixed streaming load on a live service while faults are injected.

    blockspec-bench chaos [--streams 64] [--soak-s 600] [--storm-size 1000]
        [--json docs/reliability.json] [--records FILE] [--plot FILE.png]

Starts a redis-server and the service (tiny pair by default, Ray on 127.0.0.1), then keeps
`--streams` closed-loop clients busy for `--soak-s` seconds: streams and unary calls of several
methods, half of them turns of a session. Faults, one every `--every-s` seconds after a warm-up:
kill the draft actor, kill a target shard, pause Redis (SIGSTOP) for 5 s, a cancel storm
(`--storm-size` streams, 1,000 by default, cancelled at their first chunk, 100 at a time), a
deadline storm (as many requests with a 50 ms deadline), slow readers (8 streams read one chunk
a second), kill the replica. Then the load stops and the run waits until every KV slot is free
again and the gateway's in-flight gauge is back to 0.

Prints a summary: per fault, errors by status code (explained or not: each fault has the
codes it is expected to cause), recovery time (from the fault to the first success of a
request sent after it) and p99 latency. Writes `--json` (docs/reliability.md's raw result: the
faults, RSS samples, final replica stats, request count and that summary), `--records` (also
every request) and `--plot` (RSS of the service's processes over time, faults marked).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from blockspec.loadtest.bench.harness import free_port, parser, save_json
from blockspec.protos import blockspec_pb2 as pb
from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.config import Settings
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET

METHODS = [("none", 1, 1), ("token", 1, 4), ("block", 1, 4), ("gbv", 2, 3), ("traversal", 2, 3)]
# Codes a fault may cause by design; anything else is unexplained.
EXPECTED = {
    "redis_pause": {"UNAVAILABLE"},  # session turns while the store does not answer
    "cancel_storm": {"CANCELLED"},
    "deadline_storm": {"DEADLINE_EXCEEDED"},
    "replica_kill": {"UNAVAILABLE"},  # streams that had sent chunks (unary calls are retried)
}


STORM_PARALLEL = 100  # storm requests in flight at once, beside the load's clients


@dataclass
class Record:
    kind: str  # load (the clients) | storm (a fault's own requests)
    start: float  # seconds since the run began
    end: float
    code: str
    tokens: int
    detail: str = ""


class Run:
    def __init__(self, address: str, seed: int):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.rng = random.Random(seed)
        self.t0 = time.perf_counter()
        self.records: list[Record] = []
        self.stop = False

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def one(self, kind: str, request, unary: bool, deadline_s: float = 120.0,
                  cancel_at_first: bool = False, slow_s: float = 0.0) -> None:  # fmt: skip
        start, tokens, code, detail = self.now(), 0, "OK", ""
        try:
            if unary:
                reply = await self.stub.Generate(request, timeout=deadline_s)
                tokens = len(reply.token_ids)
            else:
                call = self.stub.GenerateStream(request, timeout=deadline_s)
                async for chunk in call:
                    tokens += len(chunk.token_ids)
                    if cancel_at_first:
                        call.cancel()
                        code = "CANCELLED"
                        break
                    if slow_s:
                        await asyncio.sleep(slow_s)
        except grpc.aio.AioRpcError as err:
            code, detail = err.code().name, (err.details() or "")[:200]
        except asyncio.CancelledError:
            code = "CANCELLED"
        self.records.append(Record(kind, start, self.now(), code, tokens, detail))

    def request(self, session: str = "") -> pb.GenerateRequest:
        method, k, gamma = self.rng.choice(METHODS)
        prompt = f"def task_{self.rng.randrange(10**6)}(x):\n    "
        return pb.GenerateRequest(
            prompt=prompt, max_new_tokens=self.rng.choice([16, 32, 64]), method=method, k=k,
            gamma=gamma, session_id=session, ignore_eos=True,
        )  # fmt: skip

    async def client(self, index: int) -> None:
        """Closed loop; odd clients hold sessions of 3 turns (then start another: a session
        grows until it would not fit the context)."""
        turn = 0
        while not self.stop:
            session = f"soak-{index}-{turn // 3}" if index % 2 else ""
            await self.one("load", self.request(session), unary=self.rng.random() < 0.3)
            turn += 1

    async def storm(self, count: int, **how) -> None:
        """`count` requests of one kind, at most STORM_PARALLEL at a time (more at once would
        only meet the gateway's RESOURCE_EXHAUSTED, which is not what a storm tests)."""
        gate = asyncio.Semaphore(STORM_PARALLEL)

        async def one() -> None:
            async with gate:
                await self.one("storm", self.request(), False, **how)

        await asyncio.gather(*[one() for _ in range(count)])


def rss_mb() -> dict[str, float]:
    """Resident MB of the service's processes by kind (Ray workers by their actor class)."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2**20
        except (OSError, ValueError):
            continue
        for key in ("ray::", "raylet", "gcs_server"):
            if key in cmd:
                name = cmd.split()[0].removeprefix("ray::") if key == "ray::" else key
                out[name] = out.get(name, 0.0) + rss
    return out


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a unix socket (no TCP port at all)."""
    import redis as redis_client

    sock = f"{workdir}/redis.sock"
    cmd = [shutil.which("redis-server"), "--port", "0", "--unixsocket", sock]
    proc = subprocess.Popen(
        [*cmd, "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            redis_client.Redis(unix_socket_path=sock).ping()
            return proc, f"unix://{sock}"
        except redis_client.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def gateway_in_flight(port: int) -> float:
    """The gateway's blockspec_in_flight gauge, from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "blockspec_in_flight":
            return family.samples[0].value
    raise RuntimeError("no blockspec_in_flight gauge")


async def main_async(
    args, replica, redis: subprocess.Popen, address: str, metrics_port: int
) -> dict:
    run = Run(address, args.seed)
    faults: list[dict] = []
    rss: list[dict] = []

    async def sample_rss() -> None:
        while not run.stop:
            rss.append(dict(t=run.now(), **rss_mb()))
            await asyncio.sleep(2.0)

    async def kill_worker(kind: str) -> None:
        pids = await replica.worker_pids.remote()
        os.kill(pids[kind][-1], signal.SIGKILL)

    async def pause_redis() -> None:
        redis.send_signal(signal.SIGSTOP)
        await asyncio.sleep(5.0)
        redis.send_signal(signal.SIGCONT)

    async def kill_replica() -> None:
        os.kill((await replica.stats.remote()).pid, signal.SIGKILL)

    schedule = [
        ("draft_kill", lambda: kill_worker("draft")),
        ("target_kill", lambda: kill_worker("target")),
        ("redis_pause", pause_redis),
        ("cancel_storm", lambda: run.storm(args.storm_size, cancel_at_first=True)),
        ("deadline_storm", lambda: run.storm(args.storm_size, deadline_s=0.05)),
        ("slow_readers", lambda: run.storm(8, slow_s=1.0)),
        ("replica_kill", kill_replica),
    ]
    tasks = [asyncio.create_task(run.client(i)) for i in range(args.streams)]
    tasks.append(asyncio.create_task(sample_rss()))
    await asyncio.sleep(args.warmup_s)
    for name, inject in schedule:
        faults.append(dict(name=name, t=run.now()))
        await inject()
        await asyncio.sleep(args.every_s)
    await asyncio.sleep(max(0.0, args.soak_s - run.now()))
    run.stop = True
    await asyncio.gather(*tasks)
    free_at = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = await replica.stats.remote()
        if stats.in_flight == 0 and stats.active == 0:
            free_at = run.now()
            break
        await asyncio.sleep(0.5)
    gauge = None  # the gateway's in-flight gauge (what drain waits on), once back at 0
    while time.monotonic() < deadline:
        if gateway_in_flight(metrics_port) == 0:
            gauge = run.now()
            break
        await asyncio.sleep(0.5)
    await run.channel.close()
    return dict(
        records=[asdict(r) for r in run.records], faults=faults, rss=rss,
        slots_free_at=free_at, gauge_zero_at=gauge, final_stats=stats,
    )  # fmt: skip


def summarize(result: dict, args) -> list[str]:
    records, faults = result["records"], result["faults"]
    bounds = [f["t"] for f in faults] + [float("inf")]
    gauge = result.get("gauge_zero_at")
    lines = [
        f"{len(records)} requests over {args.soak_s:.0f} s, {args.streams} streams; "
        f"KV slots all free {result['slots_free_at']:.1f} s into the run"
        if result["slots_free_at"] is not None
        else "KV slots NOT all free 120 s after the load stopped",
        f"gateway in-flight gauge back to 0 at {gauge:.1f} s"
        if gauge is not None
        else "gateway in-flight gauge NOT back to 0",
        "",
        "| window | requests | errors by code (unexplained in bold) | recovery s | p99 s |",
        "|---|---|---|---|---|",
    ]
    windows = [("warm-up", 0.0, bounds[0])] + [
        (f["name"], f["t"], bounds[i + 1]) for i, f in enumerate(faults)
    ]
    for name, lo, hi in windows:
        inside = [r for r in records if lo <= r["end"] < hi]  # a failure shows when it ends
        codes: dict[str, int] = {}
        for r in inside:
            if r["code"] != "OK":
                codes[r["code"]] = codes.get(r["code"], 0) + 1
        expected = EXPECTED.get(name, set())
        shown = ", ".join(
            f"{c} {n}" if c in expected else f"**{c} {n}**" for c, n in sorted(codes.items())
        )
        later = [r["end"] for r in records if r["start"] >= lo and r["code"] == "OK"]
        recovery = f"{min(later) - lo:.1f}" if later and name != "warm-up" else "-"
        load = [r["end"] - r["start"] for r in inside if r["kind"] == "load" and r["code"] == "OK"]
        p99 = f"{statistics.quantiles(load, n=100)[98]:.2f}" if len(load) >= 2 else "-"
        lines.append(f"| {name} | {len(inside)} | {shown or 'none'} | {recovery} | {p99} |")
    rss = result["rss"]
    steady = faults[-1]["t"] + 60  # the replica killed last has reloaded and warmed up
    after = [s for s in rss if s["t"] >= steady]
    if len(after) >= 2:

        def total(sample):
            return sum(v for k, v in sample.items() if k != "t")

        first, last = total(after[0]), total(after[-1])
        lines.append("")
        lines.append(
            f"RSS of the service's processes from {after[0]['t']:.0f} s (60 s after the last "
            f"fault) to the end: {first:.0f} MB -> {last:.0f} MB ({(last - first) / first:+.1%})"
        )
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rss = result["rss"]
    t = [s["t"] for s in rss]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [sum(v for k, v in s.items() if k != "t") for s in rss], label="all")
    for f in result["faults"]:
        ax.axvline(f["t"], color="grey", lw=0.8, ls=":")
        ax.text(f["t"], ax.get_ylim()[1], f["name"], rotation=90, va="top", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS MB (Ray processes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = parser("chaos", __doc__)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--soak-s", type=float, default=600.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--every-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--storm-size", type=int, default=1000, help="requests per storm")
    ap.add_argument("--json", default="docs/reliability.json", help="docs/reliability.md's")
    ap.add_argument("--records", help="the run with every request's record (JSON)")
    ap.add_argument("--plot", help="RSS over time (PNG, needs matplotlib)")
    args = ap.parse_args(argv)
    from ray import serve

    from blockspec.service.app import run as run_service

    with tempfile.TemporaryDirectory() as workdir:
        redis, url = start_redis(workdir)
        try:
            metrics_port = free_port()
            settings = Settings(
                port=0, metrics_port=metrics_port, http_port=0, redis_url=url,
                replica=dict(
                    draft_dir=str(TINY_DRAFT), target_dir=str(TINY_TARGET), max_batch=16,
                    max_queued=args.streams + 120, max_sessions=args.streams,
                ),
            )  # fmt: skip
            gateway = run_service(settings, name="chaos")
            address = f"127.0.0.1:{gateway.address.remote().result()['port']}"
            replica = serve.get_deployment_handle("Replica", "chaos")
            result = asyncio.run(main_async(args, replica, redis, address, metrics_port))
            serve.shutdown()
        finally:
            redis.send_signal(signal.SIGCONT)
            redis.terminate()
    lines = summarize(result, args)
    print("\n".join(lines))
    if args.records:
        save_json(args.records, "chaos", argv, result)
    if args.plot:
        plot(result, args.plot)
    kept = {k: v for k, v in result.items() if k != "records"}
    kept.update(requests=len(result["records"]), summary=lines)
    save_json(args.json, "chaos", argv, kept)
