"""Ceilings this machine sets on the speed goals, measured: forward costs, two processes
computing at once, and the Ray floor of one distributed step.

    blockspec-bench bounds [--rounds 3] [--skip-ray] [--floor | --wake]

1. **Forward costs** of the default pair (float32, 1 thread, 200-token cache), medians over
   rounds: r(n), the target's pass over n new tokens ÷ its one-token pass, and c, the draft's
   one-token forward ÷ the target's. A batch-1 step of a single-path method with γ draft
   tokens costs at least γ draft forwards and one (γ+1)-token target pass, so its speedup over
   plain decoding is at most BE / (r(γ+1) + γ·c) for block efficiency BE (verification,
   sampling and bookkeeping only add). Printed per γ: that denominator, the BE a 1.5× speedup
   needs, and the per-token acceptance α at which token verification reaches that BE,
   (1 − α^(γ+1)) / (1 − α).
2. **Two processes at once**: the target's 5-token pass alone, and while another process
   loops the draft's forward (as a draft actor pre-drafting beside the target would), rounds
   alternating. On a machine whose cores are independent the ratio is 1.
3. **The floor of a distributed step** (unless --skip-ray): driver → actor A → actor B →
   driver with the tiny pair's batch-1 payloads (5 KB of arguments, a 128 KiB reply from A,
   5 KB from B), nothing computed, per transport: Ray's task calls (B reading A's reply by
   reference; and one bare call), a Ray Compiled Graph, a torch.distributed gloo group and
   the replica's links (workers/channel.py); with each, the machine's busy cores while the
   wired processes wait (`--floor`: this part alone).
4. **Where a step's CPU goes** (unless --skip-ray): the tiny pair at batch 1 (`block`, γ = 4,
   192 tokens), first in process, then through a draft actor and a target shard
   (`build_remote_engine`, no gRPC): wall and machine-wide busy CPU per step, and each
   process's CPU per step by thread name (Ray's I/O and polling threads apart from the main
   thread that computes).
5. **A forward after a wait** (`--wake`: this part alone): the tiny and default pairs'
   forwards as a step runs them (the target's 5-token pass, the draft's one-token forward;
   200-token cache, one process, 1 thread), back to back, and each after 3 ms spent
   spinning, sleeping, or blocked on a socket until another thread writes to it (as an actor
   waits on its link), the four alternating in rounds; the median of each. The in-process
   engine runs its phases back to back; through the actors each phase starts after its
   process waited for a message.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from blockspec.loadtest.bench.engine import forward_call, forward_ms
from blockspec.loadtest.bench.harness import command, machine, median_ms, parser
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    TINY_DRAFT,
    TINY_TARGET,
    load_model,
)
from blockspec.workers.sampling import SamplingParams

GAMMAS = (2, 3, 4, 6)


def forward_costs(rounds: int) -> tuple[dict[int, float], float, float]:
    """(r(n) for n in 1 + GAMMAS, c, the target's one-token ms): medians over rounds."""
    target = load_model(DEFAULT_TARGET, "float32").build()
    draft = load_model(DEFAULT_DRAFT, "float32").build()
    sizes = (1, *(g + 1 for g in GAMMAS))
    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for n in sizes:
            ms.setdefault(f"t{n}", []).append(forward_ms(target, n, repeats=7))
        ms.setdefault("d1", []).append(forward_ms(draft, 1, repeats=7))
    med = {k: statistics.median(v) for k, v in ms.items()}
    one = med["t1"]
    return {n: med[f"t{n}"] / one for n in sizes}, med["d1"] / one, one


def token_alpha_for(be: float, gamma: int) -> float:
    """α with (1 − α^(γ+1)) / (1 − α) = be (bisection; nan if be ≥ γ + 1)."""
    if be >= gamma + 1:
        return float("nan")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(gamma + 1)) < be else (lo, a)
    return (lo + hi) / 2


def draft_loop() -> None:  # the other process of part 2; killed by its parent
    draft = load_model(DEFAULT_DRAFT, "float32").build()
    while True:
        forward_ms(draft, 1, repeats=5)


def contention(rounds: int) -> tuple[list[float], list[float]]:
    target = load_model(DEFAULT_TARGET, "float32").build()
    alone, beside = [], []
    for _ in range(rounds):
        alone.append(forward_ms(target, 5, repeats=11))
        loop = subprocess.Popen(
            [sys.executable, "-m", "blockspec.loadtest.bench", "bounds", "--draft-loop"],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(8)  # loaded its weights and looping
        beside.append(forward_ms(target, 5, repeats=11))
        loop.kill()
        loop.wait()
    return alone, beside


# The floor's payloads, the tiny pair's at batch 1: 5 KB of step arguments (pending tokens, a
# generator's state), a 128 KiB proposal (q rows), a 5 KB verdict.
def _payloads():
    import numpy as np

    return np.zeros(1250, np.float32), np.ones(32 << 10, np.float32), np.ones(1250, np.float32)


def _idle_cores(seconds: float = 3.0) -> float:
    """Machine-wide busy cores while the driver sleeps (the paths' waiting readers)."""
    before = _busy_s()
    time.sleep(seconds)
    return (_busy_s() - before) / seconds


def _hop():
    """A Ray actor class whose every path answers each message with a fixed reply."""
    import threading

    import ray

    from blockspec.workers import channel

    @ray.remote
    class Hop:
        def __init__(self, reply):
            self.reply = reply

        def call(self, *_):
            return self.reply

        def links(self, host, key, to):  # serve: receive, send on
            listener = channel.listen(host, key)

            def serve():
                up = channel.accept(listener, {"up"})["up"]  # its hello read: one reply a step
                down = channel.dial(to, key, "up")
                while True:
                    up.recv()
                    down.send(self.reply)

            threading.Thread(target=serve, daemon=True).start()
            return listener.address

        def gloo(self, port, rank):  # serve over a 3-process gloo group (rank 0: the driver)
            def serve():
                group = _gloo_group(port, rank)
                while True:
                    _gloo_recv(group, rank - 1)
                    _gloo_send(group, self.reply, (rank + 1) % 3)

            threading.Thread(target=serve, daemon=True).start()

    return Hop


def _floor_ms(run, calls: int) -> float:
    return median_ms(run, calls, warm=10)


def ray_floor(calls: int = 200) -> dict[str, tuple[float, float]]:
    """The chain driver → A → B → driver with nothing computed, per transport: (median ms,
    idle busy cores once wired). Ray's task calls (and one bare call), Ray Compiled Graphs,
    a torch.distributed gloo group, and the replica's links (workers/channel.py)."""
    import ray
    from ray.dag import InputNode

    from blockspec.service.app import start_ray
    from blockspec.service.config import Settings
    from blockspec.workers import channel
    from blockspec.workers.tensor_parallel import loopback_store

    start_ray(Settings(ray_num_cpus=2))
    args, rows, verdict = _payloads()

    Hop = _hop()
    out = {}
    a, b = Hop.remote(rows), Hop.remote(verdict)
    out["Ray task calls, one bare call"] = (
        _floor_ms(lambda: ray.get(a.call.remote(args)), calls),
        0.0,
    )
    out["Ray task calls"] = (
        _floor_ms(lambda: ray.get(b.call.remote(a.call.remote(args))), calls), _idle_cores()
    )  # fmt: skip
    c, d = Hop.remote(rows), Hop.remote(verdict)
    with InputNode() as step:
        dag = d.call.bind(c.call.bind(step)).experimental_compile()
    out["Ray Compiled Graph"] = (
        _floor_ms(lambda: ray.get(dag.execute(args)), calls),
        _idle_cores(),
    )
    dag.teardown()
    key = channel.new_key()
    back = channel.listen(channel.LOOPBACK, key)
    at_b = ray.get(b.links.remote(channel.LOOPBACK, key, back.address))
    at_a = ray.get(a.links.remote(channel.LOOPBACK, key, at_b))
    to_a = channel.dial(at_a, key, "up")
    from_b = channel.accept(back, {"up"})["up"]

    def links():
        to_a.send(args)
        return from_b.recv()

    out["links (workers/channel.py)"] = (_floor_ms(links, calls), _idle_cores())
    e, f = Hop.remote(rows), Hop.remote(verdict)
    store = loopback_store(3, 60.0)  # the driver is rank 0
    ray.get([e.gloo.remote(store.port, 1), f.gloo.remote(store.port, 2)])
    group = _gloo_group(store, 0)

    def gloo():
        _gloo_send(group, args, 1)
        return _gloo_recv(group, 2)

    out["torch.distributed gloo send/recv"] = (_floor_ms(gloo, calls), _idle_cores())
    ray.shutdown()
    return out


def _gloo_group(store, rank: int):
    """A 3-process gloo group over `store` (rank 0's loopback store, or a port of it)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    if isinstance(store, int):
        store = dist.TCPStore("127.0.0.1", store, 3, False, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, 3, timeout)


def _gloo_send(group, obj, dst: int) -> None:  # a message: its length, then its pickle
    import pickle

    data = torch.frombuffer(bytearray(pickle.dumps(obj, 5)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()])], dst, 0).wait()
    group.send([data], dst, 1).wait()


def _gloo_recv(group, src: int):
    import pickle

    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], src, 1).wait()
    return pickle.loads(data.numpy().tobytes())


def _busy_s() -> float:
    """Machine-wide busy CPU seconds (user, nice, system, irq, softirq)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> Counter:
    """CPU seconds of each thread name of a process."""
    out: Counter = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[stat[stat.index("(") + 1 : stat.rindex(")")]] += int(fields[11]) + int(fields[12])
    return Counter({k: v / os.sysconf("SC_CLK_TCK") for k, v in out.items()})


def step_cpu(engine, pids: dict[str, int]) -> tuple[float, float, dict[str, Counter]]:
    """One request decoded to the end after its first step: (wall ms a step, busy CPU ms a
    step, per process: CPU ms a step by thread name)."""
    prompt = list(range(100, 160))
    engine.add(make_request(engine.limits, prompt, 192, "block", 1, 4, SamplingParams(1.0), seed=0))
    engine.step()  # admission
    before = {k: _thread_cpu_s(p) for k, p in pids.items()}
    busy, start, steps = _busy_s(), time.perf_counter(), 0
    while engine.active:
        engine.step()
        steps += 1
    wall, busy = time.perf_counter() - start, _busy_s() - busy
    after = {k: _thread_cpu_s(p) for k, p in pids.items()}
    per = {
        k: Counter({t: 1e3 * (after[k][t] - before[k][t]) / steps for t in after[k]}) for k in pids
    }
    return 1e3 * wall / steps, 1e3 * busy / steps, per


def cpu_split() -> None:
    import ray

    from blockspec.service.app import start_ray
    from blockspec.service.config import ReplicaConfig, Settings
    from blockspec.service.replica import build_remote_engine

    local, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), 1)
    rows = [("in process", *step_cpu(local, {"engine": os.getpid()}))]
    start_ray(Settings(ray_num_cpus=2))
    cfg = ReplicaConfig(draft_dir=str(TINY_DRAFT), target_dir=str(TINY_TARGET), max_batch=1)
    engine, _ = build_remote_engine(cfg)

    def pid(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))

    pids = {"coordinator": os.getpid(), "draft actor": pid(engine.draft.actors[0]),
            "target actor": pid(engine.target.actors[0])}  # fmt: skip
    rows.append(("actors", *step_cpu(engine, pids)))
    for actor in engine.draft.actors + engine.target.actors:
        ray.kill(actor)
    ray.shutdown()
    print("\n## 4. Where a step's CPU goes (tiny pair, batch 1)\n")
    for path, wall, busy, per in rows:
        print(f"{path}: {wall:.1f} ms a step, machine-wide busy CPU {busy:.1f} ms a step")
        for name, threads in per.items():
            top = ", ".join(f"{t} {ms:.2f}" for t, ms in threads.most_common() if ms >= 0.05)
            print(f"    {name} (CPU ms a step by thread): {top}")


WAITS = ("back to back", "spinning", "sleeping", "on a socket")


def wake_costs(
    models: dict[str, tuple[torch.nn.Module, int]],  # name: (model, new tokens a forward)
    rounds: int,
    calls: int = 100,
    gap_s: float = 0.003,
) -> dict[str, dict[str, float]]:
    """Per model and per WAITS: the median forward ms after that wait (module doc, part 5)."""
    import socket
    import threading

    mine, peer = socket.socketpair()

    def wake_after_gap() -> None:  # the other end of "on a socket"; ends when `mine` closes
        while peer.recv(1):
            time.sleep(gap_s)
            peer.send(b"x")
        peer.close()

    threading.Thread(target=wake_after_gap, daemon=True).start()

    def wait(how: str) -> None:  # "back to back": none
        if how == "spinning":
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        elif how == "sleeping":
            time.sleep(gap_s)
        elif how == "on a socket":
            mine.send(b"x")
            mine.recv(1)

    out = {}
    for name, (model, new) in models.items():
        forward = forward_call(model, new)
        timed: dict[str, list[float]] = {how: [] for how in WAITS}
        for _ in range(rounds):
            for how in WAITS:
                for _ in range(calls):
                    wait(how)
                    start = time.perf_counter()
                    forward()
                    timed[how].append(time.perf_counter() - start)
        out[name] = {how: statistics.median(ts) * 1e3 for how, ts in timed.items()}
    mine.close()
    return out


def print_wake(rounds: int) -> None:
    models = {}
    for pair, target, draft in (
        ("tiny", TINY_TARGET, TINY_DRAFT),
        ("default", DEFAULT_TARGET, DEFAULT_DRAFT),
    ):
        models[f"{pair} target, 5 tokens"] = (load_model(target, "float32").build(), 5)
        models[f"{pair} draft, 1 token"] = (load_model(draft, "float32").build(), 1)
    print("\n## 5. A forward after a wait of 3 ms (one process, 1 thread)\n")
    head = [f"{how} ms" for how in WAITS] + ["on a socket − back to back ms", "÷"]
    print("| forward | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(head))
    for name, ms in wake_costs(models, rounds).items():
        cells = [f"{ms[how]:.3f}" for how in WAITS]
        cost = ms["on a socket"] - ms[WAITS[0]]
        cells += [f"{cost:.3f}", f"{ms['on a socket'] / ms[WAITS[0]]:.2f}"]
        print(f"| {name} | {' | '.join(cells)} |")


def print_floor() -> None:
    print("\n## 3. One distributed step's floor: driver → A → B → driver, nothing computed\n")
    print("| transport | median ms | idle busy cores, wired |")
    print("|---|---|---|")
    for name, (ms, idle) in ray_floor().items():
        print(f"| {name} | {ms:.2f} | {idle:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = parser("bounds", __doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--floor", action="store_true", help="part 3 alone")
    ap.add_argument("--wake", action="store_true", help="part 5 alone")
    ap.add_argument("--draft-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.draft_loop:
        return draft_loop()
    print(f"{command('bounds', argv)}; {machine()}")

    if args.floor:
        return print_floor()
    if args.wake:
        return print_wake(args.rounds)
    r, c, one = forward_costs(args.rounds)
    print(f"\n## 1. Forward costs (float32, 1 thread): target one token {one:.1f} ms, c = {c:.3f}")
    print()
    print("| γ | r(γ+1) | r(γ+1) + γc | BE for 1.5× | token-verification α for it |")
    print("|---|---|---|---|---|")
    for g in GAMMAS:
        denom = r[g + 1] + g * c
        be = 1.5 * denom
        print(f"| {g} | {r[g + 1]:.2f} | {denom:.2f} | {be:.2f} | {token_alpha_for(be, g):.2f} |")

    alone, beside = contention(args.rounds)
    ratio = statistics.median(beside) / statistics.median(alone)
    print("\n## 2. The target's 5-token pass, alone and beside a draft loop in another process\n")
    print(f"alone ms: {', '.join(f'{x:.1f}' for x in alone)}")
    print(f"beside ms: {', '.join(f'{x:.1f}' for x in beside)}")
    print(f"median beside ÷ alone: {ratio:.2f}")

    if not args.skip_ray:
        print_floor()
        cpu_split()
    print_wake(args.rounds)
