"""`blockspec` command line.

- `methods`: the verification methods.
- `demo`: every verifier on the spec's toy instance, measured E[τ] next to the exact values.
- `generate --local`: speculative generation in-process on a local draft/target pair
  (default: SmolLM2-135M-Instruct and its trained draft, set up by scripts/setup.sh).
- `serve`: the distributed service (Ray actors, Ray Serve replicas, gRPC gateway) on a local
  Ray cluster on 127.0.0.1, or on the cluster at RAY_ADDRESS / --ray-address.
- `generate --address HOST:PORT`: stream a completion from a running service.
- `chat --address HOST:PORT`: an interactive conversation in one server-side session.

This module imports only argparse and the standard library at the top: each command imports
what it needs when it runs (the client, service/client.py, needs grpc and the protos; serve,
demo and generate --local need torch, Ray, transformers), so `blockspec --help` and the client
commands start fast. tests/test_cli.py checks it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction

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
    import torch
    from rich.console import Console
    from rich.table import Table

    from blockspec.verification import verify

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


# workers.models.DTYPES' names (not imported: the client's commands load no torch)
DTYPES = ["float32", "bfloat16", "float16", "int8", "int4"]
DTYPE_HELP = (
    "weights (int8 / int4: weight-only int8 / int4 with bfloat16 activations, CPU; int4 keeps "
    "a checkpoint dequantized from Q4_1, as the default target is, as it is)"
)


def generate_local(args) -> None:
    import torch

    from blockspec.protos import blockspec_pb2 as pb
    from blockspec.service.build import build_engine
    from blockspec.service.client import Reply, stats_line
    from blockspec.service.detokenizer import TextStream
    from blockspec.service.requests import ChatTurn, RequestParams, RequestValidator
    from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET

    torch.set_num_threads(args.threads)
    draft = args.draft or str(DEFAULT_DRAFT)
    target = args.target or str(DEFAULT_TARGET)
    engine, tokenizer = build_engine(
        draft, target, 1, max_len=args.max_len, tensor_parallel=args.tp, dtype=args.dtype
    )
    chat = dict(messages=(ChatTurn("user", args.prompt),))
    prompt = chat if args.chat else dict(prompt=args.prompt)
    params = RequestParams(
        **prompt,
        max_new_tokens=args.max_new_tokens,
        method=args.method,
        k=args.k,
        gamma=args.gamma,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    validator = RequestValidator(engine.limits, tokenizer)  # the service's checks, and EOS
    req = validator.request(params, validator.prompt_ids(params))
    start = time.perf_counter()
    (result,) = engine.generate([req])
    seconds = time.perf_counter() - start
    text = TextStream(tokenizer, list(req.stop))  # the service's text: stop strings, no
    answer, ids = text.feed(list(result.token_ids))  # cut characters
    answer += text.flush()
    print(answer, end="" if answer.endswith("\n") else "\n", flush=True)
    if args.stats:
        stats = result.stats
        reply = Reply(
            text=answer,
            tokens=len(ids),
            seconds=seconds,
            finish="stop" if text.stopped else result.finish_reason,
            stats=pb.SpeculationStats(
                target_calls=stats.target_calls,
                accepted_tokens=stats.accepted,
                tokens_per_call=stats.tokens_per_call,
                steps_by_config=dict(stats.steps_by_config),
            ),
        )
        print(stats_line(reply), file=sys.stderr, flush=True)


def serve_settings(args):
    """One validated Settings: `blockspec serve` flags over env over the config file (nested
    sections merge, so --tp keeps the rest of the file's replica section)."""
    from blockspec.service.config import Settings

    names = ("host", "port", "http_port", "metrics_port", "redis_url", "ray_address")
    names += ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file")
    flags = {k: getattr(args, k) for k in names}
    replica = {
        "tensor_parallel": args.tp,
        "max_batch": args.max_batch,
        "draft_dir": args.draft,
        "target_dir": args.target,
        "dtype": args.dtype,
        "compiled": args.compiled,
    }
    flags["replica"] = {k: v for k, v in replica.items() if v is not None}
    if args.replicas:
        low, _, high = args.replicas.partition("-")
        flags["autoscaling"] = dict(min_replicas=int(low), max_replicas=int(high or low))
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def serve_forever(args) -> None:
    import asyncio
    import signal

    from blockspec.service.ports import check_free, listeners

    settings = serve_settings(args)
    # Before Ray is even imported: a port that is not ours alone is refused, named with its
    # flag (a cluster we join listens on its head node, not necessarily here).
    if not (settings.ray_address or os.environ.get("RAY_ADDRESS")):
        check_free(settings.host, listeners(settings))

    from ray import serve

    from blockspec.service.app import run
    from blockspec.workers.models import check_pair

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
    # Our application only: a cluster we joined keeps its other applications and Serve.
    serve.delete(settings.app_name)
    # A local cluster goes with us. ray.shutdown() ends it whole, Serve's controller with it;
    # serve.shutdown() would kill the controller while its own call waits on it, which Ray
    # reports as a failed task on every exit.
    import ray

    ray.shutdown()


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: `(default: X)` after its help unless the help
    names it already (options the server fills in say so there); None shows as none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if not action.option_strings or action.required or "default" in help:
            return help
        if default is argparse.SUPPRESS:
            return help
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif default is None:
            shown = "none"
        elif isinstance(default, list):
            shown = " ".join(map(str, default)) or "none"
        else:
            shown = "%(default)s"
        return f"{help} (default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors end as every error of this tool does: a line
    `error: ...` on stderr and exit status 1 (after the usage, for what the flags are)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise SystemExit(f"error: {self.prog}: {message}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"blockspec {version('blockspec')}"
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "blockspec (not installed)"


SERVER_DEFAULT = "default: the server's"


def _client_flags(p: argparse.ArgumentParser, local: bool) -> None:
    """Connection, sampling and method flags: what generate and chat share."""
    if not local:
        p.add_argument("--address", required=True, help="HOST:PORT of a running service")
    p.add_argument(
        "--tls-ca",
        help="PEM CA that signed the server's certificate: use TLS (default: plaintext)",
    )
    p.add_argument("--token", help="bearer token (default: $BLOCKSPEC_TOKEN)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline per reply, seconds")
    p.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the stats line on stderr after each reply",
    )
    s = p.add_argument_group(
        "sampling and speculation",
        "Unset flags are not sent: the server's defaults apply (Info lists them; "
        "`blockspec serve` ships method block, γ 4, 128 new tokens).",
    )
    s.add_argument("--method", help=f"verification method, none or auto ({SERVER_DEFAULT})")
    s.add_argument("--k", type=int, help="draft paths K (default: 1)")
    s.add_argument("--gamma", type=int, help=f"draft length γ ({SERVER_DEFAULT})")
    s.add_argument("--temperature", type=float, help="0 = greedy (default: 1.0)")
    s.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: 0 = off)")
    s.add_argument("--top-p", type=float, help="nucleus sampling (default: 1.0 = off)")
    s.add_argument("--seed", type=int, help="reproducible output (default: random)")
    s.add_argument("--max-new-tokens", type=int, help=f"output length cap ({SERVER_DEFAULT})")
    s.add_argument("--stop", action="append", help="stop string, repeatable (default: none)")


def build_parser() -> argparse.ArgumentParser:
    fmt = dict(formatter_class=HelpFormatter)
    ap = Parser(prog="blockspec", description="Lossless speculative decoding", **fmt)
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("methods", help="list the verification methods", **fmt)
    d = sub.add_parser("demo", help="run every verifier on the spec's toy instance", **fmt)
    d.add_argument("--trials", type=int, default=200_000, help="draws per cell")
    d.add_argument("--seed", type=int, default=0, help="random seed")

    g = sub.add_parser(
        "generate",
        help="generate one completion (from a service, or in-process with --local)",
        description="Stream one completion to stdout (the generated text only); the stats "
        "line and errors (`error: CODE: message`, nonzero exit status) go to stderr.",
        **fmt,
    )
    g.add_argument("prompt")
    g.add_argument(
        "--chat", action="store_true", help="send the prompt as a user turn (chat template)"
    )
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the engine in-process")
    where.add_argument("--address", help="HOST:PORT of a running service (blockspec serve)")
    g.add_argument("--session", help="session id: continue (or start) a conversation")
    _client_flags(g, local=True)
    loc = g.add_argument_group("--local only")
    loc.add_argument("--max-len", type=int, default=1024, help="cache positions")
    loc.add_argument("--draft", help="draft model directory (default: the default pair's)")
    loc.add_argument("--target", help="target model directory (default: the default pair's)")
    loc.add_argument("--threads", type=int, default=1, help="torch threads per process")
    loc.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for the target")
    loc.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)

    c = sub.add_parser(
        "chat",
        help="talk with a running service (one session: it keeps the history)",
        description="An interactive chat: each line you type is a user turn; the reply streams "
        "back. The server keeps the conversation (a session) and its KV cache. Commands: "
        "/new, /stats, /help, /exit (or Ctrl-D).",
        **fmt,
    )
    c.add_argument("--system", help="system prompt of each new conversation (default: none)")
    _client_flags(c, local=False)

    _serve_flags(
        sub.add_parser(
            "serve",
            help="run the service (Ray Serve + gRPC) until Ctrl-C",
            description="Flags override BLOCKSPEC_* environment variables, which override the "
            "config file (BLOCKSPEC_CONFIG); the defaults shown are the built-in ones.",
            **fmt,
        )
    )
    return ap


def _serve_flags(s: argparse.ArgumentParser) -> None:
    """`blockspec serve`'s flags: each one a Settings field (None: leave it to the config)."""
    s.add_argument("--host", help="listen address of gRPC, HTTP and metrics (default: 127.0.0.1)")
    s.add_argument("--port", type=int, help="gRPC port (default: 50051; 0 = any free port)")
    s.add_argument(
        "--http-port", type=int, help="OpenAI-compatible HTTP port (default: 8000; 0 = off)"
    )
    s.add_argument("--metrics-port", type=int, help="Prometheus port (default: 9464; 0 = off)")
    s.add_argument("--redis-url", help="session store (default: embedded, single node)")
    s.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    s.add_argument("--tls-cert-file", help="PEM certificate: serve gRPC over TLS (default: off)")
    s.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file (default: none)")
    s.add_argument(
        "--tls-client-ca-file", help="PEM CA: require client certificates, mTLS (default: off)"
    )
    s.add_argument(
        "--auth-tokens-file",
        help="'principal token' lines: require bearer tokens (default: no tokens)",
    )
    s.add_argument("--replicas", help="N or MIN-MAX replicas, autoscaled between (default: 1)")
    s.add_argument("--tp", type=int, help="tensor-parallel target shards per replica (default: 1)")
    s.add_argument(
        "--max-batch", type=int, help="requests per decode step per replica (default: 8)"
    )
    s.add_argument("--draft", help="draft model directory (default: the default pair's)")
    s.add_argument("--target", help="target model directory (default: the default pair's)")
    s.add_argument("--dtype", choices=DTYPES, help=f"{DTYPE_HELP} (default: float32)")
    s.add_argument(
        "--compiled",
        action="store_true",
        default=None,  # unset: the config file's or the environment's
        help="decode forwards through torch.compile: faster on a CPU in bfloat16 and int4 (not "
        "float32), minutes of compiling at start and after an actor restarts",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "methods":
        from blockspec.verification import VERIFIERS

        for v in VERIFIERS.values():
            paths = "K = 1" if v.single_path else "K >= 1"
            print(f"{v.name:13s} {paths:7s} {v.description}")
    elif args.command == "demo":
        demo(args.trials, args.seed)
    elif args.command == "serve":
        from blockspec.service.ports import PortTaken

        try:
            serve_forever(args)
        except (ValueError, PortTaken) as err:  # a model pair or a port that cannot be served
            raise SystemExit(f"error: {err}") from None
    elif args.command == "chat":
        raise SystemExit(client_command(args))
    elif status := client_command(args):
        raise SystemExit(status)


def client_command(args) -> int:
    """generate and chat: every way they can fail ends as one `error: ...` line on stderr and
    exit status 1, never a traceback (an unforeseen failure says its type)."""
    from blockspec.service import client

    try:
        client.check_args(args)
        if args.command == "chat":
            return client.chat(args)
        if args.local:
            generate_local(args)
        else:
            client.generate(args)
    except client.UsageError as err:
        print(err, file=sys.stderr)
        return 1
    except ValueError as err:  # --local: InvalidArgument names its field; a bad pair does not
        code = "INVALID_ARGUMENT: " if hasattr(err, "field") else ""
        print(f"error: {code}{err}", file=sys.stderr)
        return 1
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    main()
