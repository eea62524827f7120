"""`blockspec` command line.

- `methods`: the verification methods.
- `demo`: every verifier on the spec's toy instance, measured E[τ] next to the exact values.
- `generate --local`: speculative generation in-process on a local draft/target pair
  (default: SmolLM2-135M-Instruct and its trained draft, set up by scripts/setup.sh).
- `serve`: the distributed service (Ray actors, Ray Serve replicas, gRPC gateway) on a local
  Ray cluster on 127.0.0.1, or on the cluster at RAY_ADDRESS / --ray-address.
- `generate --address HOST:PORT`: stream a completion from a running service.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction

import torch
from rich.console import Console
from rich.table import Table

from service.policy import AUTO
from verification import VERIFIERS, verify

# Spec §12, toy instance (γ = 2, V = 2, context independent): exact E[τ] per method and K.
TOY_TARGET = (1 / 3, 2 / 3)
TOY_DRAFT = (2 / 3, 1 / 3)
TOY_EXACT = {
    "token": {1: "10/9"},
    "block": {1: "11/9"},
    "greedy_block": {1: "12/9"},
    "naive": {1: "52/81", 2: "82/81", 3: "8200/6561"},
    "specinfer": {1: "10/9", 2: "4/3", 3: "1087/729"},
    "spectr": {1: "10/9", 2: "1.405487", 3: "1.593306"},
    "gbv": {1: "11/9", 2: "131/81", 3: "1289/729"},
    "traversal": {1: "11/9", 2: "115/81", 3: "1136/729"},
    "spectr_gbv": {1: "4/3", 2: "40/27", 3: "386/243"},
}


def _exact(text: str) -> float:
    return float(Fraction(text)) if "/" in text else float(text)


def demo(trials: int, seed: int) -> None:
    console = Console()
    gamma, gen = 2, torch.Generator().manual_seed(seed)
    table = Table(title=f"toy instance (spec §12), γ = {gamma}, {trials:,} trials per cell")
    for col in ("method", "K", "E[τ] measured", "E[τ] exact", "ms per call"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for method, exact in TOY_EXACT.items():
        for k, value in exact.items():
            q = torch.tensor(TOY_DRAFT).expand(trials, k, gamma, 2)
            p = torch.tensor(TOY_TARGET).expand(trials, k, gamma + 1, 2)
            x = torch.multinomial(q.reshape(-1, 2), 1, generator=gen).view(trials, k, gamma)
            start = time.perf_counter()
            out = verify(method, x, q, p, generator=gen)
            ms = (time.perf_counter() - start) * 1e3
            measured = out.num_accepted.double().mean().item()
            table.add_row(
                method, str(k), f"{measured:.4f}", f"{_exact(value):.4f} ({value})", f"{ms:.1f}"
            )
    console.print(table)


def config_label(args, steps_by_config: dict[str, int]) -> str:
    """What ran: the fixed configuration asked for, or auto's steps per configuration."""
    if args.method == AUTO:
        ran = sorted(steps_by_config.items(), key=lambda kv: -kv[1])
        return "auto: " + ", ".join(f"{config} ×{n}" for config, n in ran)
    return f"{args.method} K={args.k} γ={args.gamma}"


def generate_local(args) -> None:
    from service.engine import GenerationRequest, build_engine
    from workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, render_chat, user_turn
    from workers.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    draft = args.draft or str(DEFAULT_DRAFT)
    target = args.target or str(DEFAULT_TARGET)
    engine, tokenizer = build_engine(
        draft, target, max_batch=1, max_len=args.max_len, tensor_parallel=args.tp
    )
    if args.chat:
        ids = render_chat(tokenizer, user_turn(args.prompt))
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    req = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=args.max_new_tokens,
        method=args.method,
        k=args.k,
        gamma=args.gamma,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        seed=args.seed,
        stop_token_ids=stop,
    )
    start = time.perf_counter()
    (result,) = engine.generate([req])
    seconds = time.perf_counter() - start
    answer = tokenizer.decode(result.token_ids, skip_special_tokens=args.chat)
    print(answer if args.chat else args.prompt + answer)
    stats = result.stats
    print(
        f"[{config_label(args, stats.steps_by_config)}] "
        f"{len(result.token_ids)} tokens in {seconds:.2f}s, "
        f"{stats.target_calls} target calls, {stats.tokens_per_call:.2f} tokens/call, "
        f"finish={result.finish_reason}",
        file=sys.stderr,
    )


def serve_settings(args):
    """One validated Settings: `blockspec serve` flags over env over the config file (nested
    sections merge, so --tp keeps the rest of the file's replica section)."""
    from service.config import Settings

    names = ("host", "port", "http_port", "metrics_port", "redis_url", "ray_address")
    names += ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file")
    flags = {k: getattr(args, k) for k in names}
    replica = {
        "tensor_parallel": args.tp,
        "max_batch": args.max_batch,
        "draft_dir": args.draft,
        "target_dir": args.target,
        "dtype": args.dtype,
    }
    flags["replica"] = {k: v for k, v in replica.items() if v is not None}
    if args.replicas:
        low, _, high = args.replicas.partition("-")
        flags["autoscaling"] = dict(min_replicas=int(low), max_replicas=int(high or low))
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def serve_forever(args) -> None:
    import asyncio
    import signal

    from ray import serve

    from service.app import run
    from workers.models import check_pair

    settings = serve_settings(args)
    # Before any Ray start: a pair that cannot work together is refused here, naming both.
    check_pair(settings.replica.draft_dir, settings.replica.target_dir)
    start = time.perf_counter()
    gateway = run(settings)
    address = gateway.address.remote().result()
    http = f"on {settings.host}:{settings.http_port}" if settings.http_port else "off"
    print(
        f"blockspec serving gRPC on {settings.host}:{address['port']}, OpenAI HTTP {http} "
        f"(metrics: {address['metrics_port'] or 'off'}; replicas "
        f"{settings.autoscaling.min_replicas}-{settings.autoscaling.max_replicas}; "
        f"sessions: {settings.redis_url or 'embedded'}) in {time.perf_counter() - start:.0f}s",
        flush=True,
    )
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    asyncio.run(wait())
    print("draining...", flush=True)
    gateway.drain.remote().result()
    serve.shutdown()


def generate_remote(args) -> None:
    import grpc

    from protos import blockspec_pb2 as pb
    from protos import blockspec_pb2_grpc as pb_grpc
    from service.auth import bearer, client_channel

    req = pb.GenerateRequest(
        prompt="" if args.chat else args.prompt,
        messages=[pb.ChatMessage(role="user", content=args.prompt)] if args.chat else [],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        method=args.method,
        k=args.k,
        gamma=args.gamma,
        session_id=args.session or "",
        stop=args.stop or [],
    )
    if args.seed is not None:
        req.seed = args.seed
    start = time.perf_counter()
    with client_channel(args.address, args.tls_ca) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        try:
            if not args.chat:
                print(args.prompt, end="", flush=True)
            token = args.token or os.environ.get("BLOCKSPEC_TOKEN")
            for chunk in stub.GenerateStream(req, timeout=args.timeout, metadata=bearer(token)):
                print(chunk.text, end="", flush=True)
                last = chunk
        except grpc.RpcError as err:
            raise SystemExit(f"\nblockspec generate: {err.code().name}: {err.details()}") from None
    print(flush=True)
    stats = last.stats
    print(
        f"[{config_label(args, stats.steps_by_config)}] {time.perf_counter() - start:.2f}s, "
        f"{stats.target_calls} target calls, {stats.tokens_per_call:.2f} tokens/call, "
        f"finish={pb.FinishReason.Name(last.finish_reason)}, replica={last.replica}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="blockspec", description="Lossless speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list the verification methods")
    d = sub.add_parser("demo", help="run every verifier on the spec's toy instance")
    d.add_argument("--trials", type=int, default=200_000)
    d.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("prompt")
    g.add_argument(
        "--chat", action="store_true", help="send the prompt as a user turn (chat template)"
    )
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the engine in-process")
    where.add_argument("--address", help="HOST:PORT of a running service (blockspec serve)")
    g.add_argument("--tls-ca", help="PEM CA that signed the server's certificate: use TLS")
    g.add_argument("--token", help="bearer token (default: $BLOCKSPEC_TOKEN)")
    g.add_argument("--session", help="session id: continue (or start) a conversation")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument("--method", default="block", help="verification method, none or auto")
    s = sub.add_parser("serve", help="run the service (Ray Serve + gRPC) until Ctrl-C")
    s.add_argument("--host", help="gRPC/metrics listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="gRPC port (default 50051; 0 = any free port)")
    s.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP port (8000; 0 = off)")
    s.add_argument("--metrics-port", type=int, help="Prometheus port (default 9464; 0 = off)")
    s.add_argument("--redis-url", help="session store (default: embedded, single node)")
    s.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    s.add_argument("--tls-cert-file", help="PEM certificate: serve gRPC over TLS")
    s.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    s.add_argument("--tls-client-ca-file", help="PEM CA: require client certificates (mTLS)")
    s.add_argument("--auth-tokens-file", help="'principal token' lines: require bearer tokens")
    s.add_argument("--replicas", help="N or MIN-MAX replicas (autoscaled between)")
    s.add_argument("--tp", type=int, help="tensor-parallel target shards per replica")
    s.add_argument("--max-batch", type=int, help="requests per decode step per replica")
    s.add_argument("--draft", help="draft model directory (default: the default pair's)")
    s.add_argument("--target", help="target model directory (default: the default pair's)")
    s.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="weights (default float32)"
    )
    g.add_argument("--k", type=int, default=1)
    g.add_argument("--gamma", type=int, default=4)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=1024)
    g.add_argument("--draft", help="draft model directory, with --local (default pair)")
    g.add_argument("--target", help="target model directory, with --local (default pair)")
    g.add_argument("--threads", type=int, default=1, help="torch threads per process")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for the target")
    sub.add_parser("loadtest", help="load-test a running service (python -m loadtest --help)")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["loadtest"]:  # its own parser: all of its options pass through
        from loadtest.cli import main as loadtest

        return loadtest(argv[1:])
    args = ap.parse_args(argv)
    if args.command == "methods":
        for v in VERIFIERS.values():
            paths = "K = 1" if v.single_path else "K >= 1"
            print(f"{v.name:13s} {paths:7s} {v.description}")
    elif args.command == "demo":
        demo(args.trials, args.seed)
    elif args.command == "serve":
        try:
            serve_forever(args)
        except ValueError as err:  # a model pair that cannot be served
            raise SystemExit(f"blockspec serve: {err}") from None
    elif args.address:
        generate_remote(args)
    else:
        try:
            generate_local(args)
        except ValueError as err:
            raise SystemExit(f"blockspec generate: {err}") from None


if __name__ == "__main__":
    main()
