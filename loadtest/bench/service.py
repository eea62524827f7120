"""What the distributed path costs: the service (gRPC → gateway → Serve → coordinator → Ray
actors) against the in-process engine, on the same requests, in one run, the two alternated.

    blockspec-bench service [--pairs tiny default] [--batch 1 8] \
        [--requests 16] [--rounds 3] \
        [--new-tokens 64] [--method block] [--gamma 4] [--dtype float32] \
        [--threads 1] [--json docs/service_benchmark.json]    # prints the table

Reports, per model pair and batch size (concurrent clients, closed loop): per-request latency,
tokens/s, the service / engine ratio, per-step time and its breakdown (draft / tree / target /
transfer / verify / overhead), and through the service every process's CPU a step (the gateway,
the replica, the actors, Ray's own: where the step's CPU goes). `--threads`: torch threads of
the in-process engine and of each actor (the replica's torch_threads); the actors of a step run
one after the other, so each may use every core. Also the bare gRPC round trip (Info) and a
session's second turn on its warm KV cache versus the same context prefilled cold.

The replica runs without automatic prefix caching, as the engine does: the rounds send the same
prompts, and with it on a repeated prompt's prefill would come from the KV its last round
parked, skipping prefills that the engine pays. Every reply is checked for cached tokens.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from blockspec.loadtest.bench.harness import (
    alternate,
    command,
    cpu_by_process,
    cpu_ms_per_step,
    median_run,
    parser,
    ratios,
    save_json,
    spread,
)
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.service.config import Settings
from blockspec.service.requests import make_request
from blockspec.service.results import StepTimes
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET
from blockspec.workers.sampling import SamplingParams

PHASES = StepTimes.PHASES


def in_process(args, engine, ids) -> dict:
    """Closed loop like the service's clients: engine.max_batch requests in flight, the next
    one added as soon as one finishes; latency from each request's own start."""
    params = SamplingParams(1.0)
    reqs = [
        make_request(engine.limits, p, args.new_tokens, args.method, 1, args.gamma, params, seed=i)
        for i, p in enumerate(ids)
    ]
    engine.generate([make_request(engine.limits, ids[0], 8, args.method, 1, args.gamma)])  # warm up
    engine.reset_stats()
    start = time.perf_counter()
    started, latencies = {}, []

    def add_next() -> None:
        if reqs:
            started[engine.add(reqs.pop(0))] = time.perf_counter()

    for _ in range(engine.max_batch):
        add_next()
    while engine.active or engine.waiting:
        for result in engine.step().finished:
            latencies.append(time.perf_counter() - started[result.request_id])
            add_next()
    wall = time.perf_counter() - start
    return _summary(wall, latencies, len(ids) * args.new_tokens, engine.steps, engine.times)


def _summary(wall, latencies, tokens, steps, times: StepTimes) -> dict:
    total = sum(getattr(times, p) for p in PHASES)
    return dict(
        tokens_per_s=tokens / wall,
        latency_s=statistics.median(latencies),
        step_ms=1e3 * total / max(steps, 1),
        phase_ms={p: 1e3 * getattr(times, p) / max(steps, 1) for p in PHASES},
        steps=steps,
    )


def through_service(args, ids, stub, replica, batch: int) -> dict:
    from blockspec.protos import blockspec_pb2 as pb

    def call(i_p):
        i, p = i_p
        req = pb.GenerateRequest(
            prompt_token_ids=p,
            max_new_tokens=args.new_tokens,
            method=args.method,
            gamma=args.gamma,
            seed=i,
            ignore_eos=True,
        )
        t = time.perf_counter()
        reply = stub.Generate(req)
        cached = reply.stats.cached_prompt_tokens
        if cached:  # the engine prefills every prompt: so must the service
            raise RuntimeError(f"request {i} found {cached} prompt tokens cached")
        return time.perf_counter() - t

    call((0, ids[0]))  # warm up
    before, cpu_before = replica.stats.remote().result(), cpu_by_process()
    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        latencies = list(pool.map(call, enumerate(ids)))
    wall = time.perf_counter() - start
    after, cpu_after = replica.stats.remote().result(), cpu_by_process()
    times = StepTimes(**{p: after.step_seconds[p] - before.step_seconds[p] for p in PHASES})
    steps = after.steps - before.steps
    summary = _summary(wall, latencies, len(ids) * args.new_tokens, steps, times)
    # every process's CPU, this one's too (the clients): where a step's CPU goes, beside it
    summary["cpu_ms"] = cpu_ms_per_step(cpu_before, cpu_after, steps)
    return summary


def session_reuse(stub, tokenizer, ids) -> dict:
    """Turn 2 of a session (KV of turn 1 parked on the replica) vs the same context cold."""
    from blockspec.protos import blockspec_pb2 as pb

    sid = f"bench-{time.time_ns()}"
    turn1 = pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=8, session_id=sid, seed=1)
    first = stub.Generate(turn1)
    context = list(ids) + list(first.token_ids)
    new = tokenizer("\n\n# next")["input_ids"]
    warm, cold = [], []
    for rep in range(5):
        t = time.perf_counter()
        warm_reply = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=new, max_new_tokens=1, session_id=sid)
        )
        warm.append(time.perf_counter() - t)
        context = context + new + list(warm_reply.token_ids)
        t = time.perf_counter()
        cold_reply = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=context, max_new_tokens=1, seed=rep)
        )
        cold.append(time.perf_counter() - t)
        if cold_reply.stats.cached_prompt_tokens:
            raise RuntimeError("the cold context found a cached prefix")
        cached = warm_reply.stats.cached_prompt_tokens
    return dict(
        warm_ms=1e3 * statistics.median(warm),
        cold_ms=1e3 * statistics.median(cold),
        cached_prompt_tokens=cached,
        context_tokens=len(context),
    )


PAIRS = {
    "tiny": (str(TINY_DRAFT), str(TINY_TARGET)),
    "default": (str(DEFAULT_DRAFT), str(DEFAULT_TARGET)),
}


def bench_pair(args, name: str) -> dict:
    """Engine and service side by side on one model pair, at every batch size, alternated
    round by round (both warm: the engines stay built, the service up)."""
    from ray import serve

    from blockspec.protos import blockspec_pb2 as pb
    from blockspec.protos import blockspec_pb2_grpc as pb_grpc
    from blockspec.service.app import run

    draft, target = PAIRS[name]
    most = max(args.batch)
    replica_cfg = dict(
        draft_dir=draft, target_dir=target, dtype=args.dtype, max_batch=most, max_queued=most,
        torch_threads=args.threads, prefix_caching=False,  # as the engine: see the module doc
    )  # fmt: skip
    settings = Settings(port=0, metrics_port=0, http_port=0, replica=replica_cfg)  # gRPC only
    engines, tokenizer, ids = {}, None, None
    for batch in args.batch:
        engines[batch], tokenizer = build_engine(draft, target, batch, dtype=args.dtype)
        ids = ids or prompt_ids(tokenizer, "humaneval", args.requests, room=200)

    start = time.perf_counter()
    gateway = run(settings, name="bench")
    startup = time.perf_counter() - start
    port = gateway.address.remote().result()["port"]
    replica = serve.get_deployment_handle("Replica", "bench")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GeneratorStub(channel)
    arms = {}
    for batch in args.batch:  # the two paths alternate: the machine drifts
        arms[f"engine_b{batch}"] = lambda b=batch: in_process(args, engines[b], ids)
        arms[f"service_b{batch}"] = lambda b=batch: through_service(args, ids, stub, replica, b)
    runs = alternate(
        arms, args.rounds, on_run=lambda arm, r, row: print(f"{name} {arm} round {r}: {row}")
    )
    rows = {key: median_run(rs, "tokens_per_s") for key, rs in runs.items()}
    for batch in args.batch:
        engine, service = runs[f"engine_b{batch}"], runs[f"service_b{batch}"]
        rows[f"service_b{batch}"]["ratios"] = ratios(
            [s["tokens_per_s"] for s in service], [e["tokens_per_s"] for e in engine]
        )

    info_ms = []
    for _ in range(50):
        t = time.perf_counter()
        stub.Info(pb.InfoRequest())
        info_ms.append(1e3 * (time.perf_counter() - t))
    session = session_reuse(stub, tokenizer, ids[0])
    channel.close()
    serve.shutdown()
    return dict(
        rows=rows,
        startup_s=startup,
        info_rpc_ms=statistics.median(info_ms),
        session=session,
    )


def main(argv: list[str] | None = None) -> None:
    ap = parser("service", __doc__)
    ap.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=["tiny", "default"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="engine and service alternated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--method", default="block")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: engine, each actor")
    ap.add_argument(
        "--json",
        default="docs/service_benchmark.json",
        help="the raw result (docs/service_benchmark.md's)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs = {name: bench_pair(args, name) for name in args.pairs}
    meta = dict(
        requests=args.requests,
        rounds=args.rounds,
        new_tokens=args.new_tokens,
        method=args.method,
        gamma=args.gamma,
        dtype=args.dtype,
        threads=args.threads,
    )
    save_json(args.json, "service", argv, dict(meta, pairs=pairs))
    lines = [
        f"Command: `{command('service', argv)}`  ",
        f"{args.requests} HumanEval prompts (last 200 tokens) × {args.new_tokens} new tokens, "
        f"method {args.method}, γ = {args.gamma}, T = 1, {args.dtype}; torch "
        f"{torch.__version__}, {args.threads} torch thread(s) for the engine and each actor; "
        "batch = concurrent clients (closed loop); engine and service alternated over "
        f"{args.rounds} rounds: the median round's row, the median of the rounds' ratios.",
        "",
        "| pair | path | batch | tok/s | service / engine (range) | median request s | step ms | "
        + " | ".join(PHASES)
        + " | transfer share |",
        "|" + "---|" * (8 + len(PHASES)),
    ]
    for name, result in pairs.items():
        for batch in args.batch:
            for path in ("engine", "service"):
                r = result["rows"][f"{path}_b{batch}"]
                ratio = spread(r["ratios"], "×") if path == "service" else "1.00×"
                lines.append(
                    f"| {name} | {path} | {batch} | {r['tokens_per_s']:.1f} | {ratio} | "
                    f"{r['latency_s']:.2f} | {r['step_ms']:.1f} | "
                    + " | ".join(f"{r['phase_ms'][p]:.1f}" for p in PHASES)
                    + f" | {r['phase_ms']['transfer'] / r['step_ms']:.0%} |"
                )
    lines.append("")
    for name, result in pairs.items():
        session = result["session"]
        lines.append(
            f"- {name}: service startup (Ray + Serve + actors) {result['startup_s']:.0f} s; "
            f"gRPC round trip to the gateway (Info) {result['info_rpc_ms']:.2f} ms; session "
            f"turn on a warm KV cache {session['warm_ms']:.0f} ms "
            f"({session['cached_prompt_tokens']} of {session['context_tokens']} context tokens "
            f"cached) vs the same context cold {session['cold_ms']:.0f} ms (median of 5)."
        )
        for batch in args.batch:
            row = result["rows"][f"service_b{batch}"]  # the median round's
            busiest = ", ".join(f"{n} {ms:.2f}" for n, ms in list(row["cpu_ms"].items())[:6])
            lines.append(f"  - {name}, batch {batch}, service: CPU ms a step by process: {busiest}")
    print("\n".join(lines))
