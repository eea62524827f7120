r"""`python -m blockspec.loadtest` / `blockspec-loadtest`: compare verifiers on a running service.

    python -m blockspec.loadtest --address 127.0.0.1:50051 --methods token block gbv --k 1 2 4 \
        --gamma 4 8 --temperature 0.6 1.0 --concurrency 1 2 4 8 16 32 --requests 32 \
        --out loadtest-results

For each method × K × γ × T (K > 1 only for multi-path methods; `none` = plain decoding) and
each load point — closed loop at each `--concurrency`, open loop at each `--rate` (Poisson,
requests/s) — it sends `--warmup` unrecorded requests, then `--requests` recorded ones (or as
many as fit in `--duration` seconds, closed loop). Method `auto` lets the service choose the
method, K and γ each step; the report compares it with every fixed configuration of the run.
`--compare A B` (each 'method:K:γ:T') interleaves two configurations request by request in the
same load points instead of a grid, and reports B/A ratios of each metric, which holds on a
noisy machine. `--slo ttft=..,tpot=..,e2e=..` adds goodput: requests/s that met every
threshold.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from blockspec.loadtest.driver import OWN_CHOICE, Client, Config, closed_loop, open_loop
from blockspec.loadtest.prompts import prompt_ids
from blockspec.loadtest.report import parse_slo, summarize, write_outputs
from blockspec.service.cli import HelpFormatter

# Fewer recorded requests than this per point give no interval (1) or a wide one: warned.
FEW_REQUESTS = 6
COMPARED = ("tokens_per_s", "latency_p50", "latency_p99", "ttft_p50", "block_efficiency")


def grid(args, single_path: set[str]) -> list[Config]:
    """single_path: the methods that take K = 1 only (the service's Info says which)."""
    configs = []
    for method in args.methods:
        for temperature in args.temperature:
            if method in OWN_CHOICE:
                configs.append(Config(method, 1, 1, temperature))
                continue
            for k in [1] if method in single_path else args.k:
                for gamma in args.gamma:
                    configs.append(Config(method, k, gamma, temperature))
    return configs


def load_prompts(args, max_context: int, configs: list[Config]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from blockspec.workers.models import DEFAULT_TARGET

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or DEFAULT_TARGET)
    # Each prompt's last tokens, so that it + max_new_tokens + a draft block fit the context.
    room = max_context - args.max_new_tokens - max(c.gamma for c in configs) - 2
    try:
        return prompt_ids(tokenizer, args.prompts, args.num_prompts, room)
    except ValueError:
        raise SystemExit("loadtest: --max-new-tokens leaves no room for a prompt") from None


async def run(args) -> None:
    from blockspec.protos import blockspec_pb2 as pb

    token = args.token or os.environ.get("BLOCKSPEC_TOKEN")
    client = Client(args.address, args.max_new_tokens, args.timeout, args.tls_ca, token)
    slo = parse_slo(args.slo)
    info = await client.stub.Info(pb.InfoRequest(), timeout=30)
    single_path = {m.name for m in info.methods if m.single_path}
    configs = (
        [Config.parse(text) for text in args.compare] if args.compare else grid(args, single_path)
    )
    prompts = load_prompts(args, info.limits.max_context, configs)
    rng = random.Random(args.seed)
    loads = [("c", c) for c in args.concurrency] + [("rate", r) for r in args.rate]
    groups = [configs] if args.compare else [[c] for c in configs]

    def picker(group: list[Config]):
        turns = itertools.cycle(group)  # --compare: the configurations alternate
        return lambda: (next(turns), rng.choice(prompts), rng.randrange(1 << 31))

    points, records = [], []
    total = len(configs) * len(loads) * args.requests
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not sys.stderr.isatty() and not args.progress,
    )
    with progress:
        task = progress.add_task("load test", total=total)
        # Load-major: the configurations of one load point run back to back, so a slow drift
        # of the machine moves them together rather than one configuration against another.
        for kind, level in loads:
            for group in groups:
                progress.update(
                    task, description=f"{' vs '.join(c.label for c in group)} {kind}={level:g}"
                )
                pick = picker(group)
                n = args.requests * len(group)
                warm = [client.one(*pick(), "warmup") for _ in range(args.warmup)]
                await asyncio.gather(*warm)
                start = time.perf_counter()
                if kind == "c":
                    recs = await closed_loop(
                        client,
                        pick,
                        int(level),
                        n,
                        args.duration,
                        lambda r: progress.advance(task),
                    )
                else:
                    recs = await open_loop(
                        client, pick, float(level), n, rng, lambda r: progress.advance(task)
                    )
                wall = time.perf_counter() - start
                batch = [asdict(r) for r in recs]
                records += batch
                for cfg in group:
                    mine = [r for r in batch if r["config"] == cfg.label]
                    point = summarize(mine, wall, slo)
                    points.append(dict(config=cfg.label, load=f"{kind}={level:g}", **point))
                    progress.console.print(
                        f"{cfg.label} {kind}={level:g}: {point['tokens_per_s']:.1f} tok/s "
                        f"({interval(point)}), "
                        f"p50 {point['latency_p50']:.2f} s, BE {point['block_efficiency']:.2f}, "
                        f"batch {point['mean_batch_size']:.1f}, errors {point['errors'] or 0}"
                    )
    await client.close()
    meta = dict(
        command="python -m blockspec.loadtest " + " ".join(sys.argv[1:]),
        environment=_environment(info),
        seed=args.seed,
        slo=args.slo,
    )
    if args.compare:
        meta["compare"] = _compare(points, [c.label for c in configs])
    write_outputs(Path(args.out), points, records, meta)
    print(f"wrote {args.out}/report.md, results.json, results.csv and plots")


def interval(point: dict) -> str:
    """The tokens/s interval as the console line shows it."""
    spread = point["tokens_per_s_ci"]
    if math.isnan(spread):
        return f"no interval from {point['ok']} request{'s' * (point['ok'] != 1)}"
    return f"±{spread:.0%}"


def _compare(points: list[dict], labels: list[str]) -> list[dict]:
    a_label, b_label = labels[:2]
    rows = []
    by = {(p["config"], p["load"]): p for p in points}
    for (config, load), a in by.items():
        if config != a_label or (b_label, load) not in by:
            continue
        b = by[(b_label, load)]
        for metric in COMPARED:
            ratio = b[metric] / a[metric] if a[metric] else float("nan")
            rows.append(dict(load=load, metric=metric, a=a[metric], b=b[metric], ratio=ratio))
    return rows


def _environment(info) -> dict:
    import grpc
    import torch

    try:
        from importlib.metadata import version

        blockspec = version("blockspec")
    except Exception:
        blockspec = "unknown"
    return {
        "service": f"draft {info.draft_model}, target {info.target_model} "
        f"(vocab {info.vocab_size}, context {info.limits.max_context}, "
        f"tensor parallel {info.tensor_parallel}, "
        f"max batch {info.limits.max_batch} per replica)",
        "client machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.processor() or 'cpu'}; GPU: "
        + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"),
        "versions": f"blockspec {blockspec}, python {platform.python_version()}, torch "
        f"{torch.__version__}, grpcio {grpc.__version__}",
    }


class Help(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The description as written (its example command), every option's default shown."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="loadtest", description=__doc__, formatter_class=Help)
    ap.add_argument("--address", default="127.0.0.1:50051", help="the service's gRPC HOST:PORT")
    ap.add_argument("--tls-ca", help="PEM CA that signed the server's certificate: use TLS")
    ap.add_argument("--token", help="bearer token (default: $BLOCKSPEC_TOKEN)")
    methods = ["none", "token", "block", "gbv"]
    ap.add_argument("--methods", nargs="+", default=methods, help="verifiers, none, auto")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4], help="draft paths K")
    ap.add_argument("--gamma", type=int, nargs="+", default=[4, 8], help="draft lengths γ")
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="temperatures")
    levels = [1, 2, 4, 8, 16, 32]
    ap.add_argument("--concurrency", type=int, nargs="*", default=levels, help="closed loops")
    ap.add_argument("--rate", type=float, nargs="*", default=[], help="open-loop requests/s")
    ap.add_argument("--requests", type=int, default=32, help="recorded requests per point")
    ap.add_argument("--duration", type=float, help="closed loop: stop sending after S seconds")
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded requests per point")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--prompts", default="humaneval", help="'humaneval' or a JSONL file")
    ap.add_argument("--num-prompts", type=int, default=164, help="prompts drawn from")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the default target's)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' and seeds' draws")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="'method:K:γ:T' each")
    ap.add_argument("--slo", help="goodput thresholds, seconds: 'ttft=0.5,tpot=0.1,e2e=10'")
    ap.add_argument("--progress", action="store_true", help="progress bar even when not a tty")
    ap.add_argument("--out", default="loadtest-results", help="report folder")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.requests < FEW_REQUESTS and not args.duration:
        print(
            f"warning: {args.requests} recorded requests per point are too few for a stable "
            f"median, and give {'no' if args.requests < 2 else 'a wide'} interval on tokens/s; "
            f"use --requests {FEW_REQUESTS} or more (default 32)",
            file=sys.stderr,
        )
    asyncio.run(run(args))
