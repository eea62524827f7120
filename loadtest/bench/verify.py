"""Benchmark one `verify` call per method across batch, K and vocabulary sizes.

    blockspec-bench verify [--batch 1 8 32] [--k 1 2 4] [--gamma 8]
        [--vocab 32000 49152] [--repeats 7] [--threads 2] [--device cpu] [--json out.json]
        [--profile]  (CUDA only: kernel launches, GPU busy time and host waits per call; the
                      JSON also gets the kernels that took the most GPU time)
        [--graphs]   (CUDA only: also each call replayed from a CUDA graph, and whether it
                      gave the eager call's tokens; with --profile, the replay's profile too)

Prints a markdown table: median milliseconds per call (validate=False, the engine's hot path)
and the ratio to `token` at the same shape. `token` verifies one path, so for K > 1 its
baseline is token verification of all B·K paths as independent requests (the same tensors,
reshaped to [B·K, 1, γ, V]): the same bytes in, one pass. Inputs are realistic rows: target
logits ~ N(0, 3²), draft logits = target + N(0, 1) (per-position acceptance ≈ 0.6-0.7), draft
tokens sampled from the draft rows, the root row shared by all K paths.
"""

from __future__ import annotations

import functools
import time

import torch

from blockspec.loadtest.bench.harness import command, machine, median_ms, parser, save_json
from blockspec.verification import METHODS, VERIFIERS, VerifyGraphs, verify


def make_inputs(b: int, k: int, gamma: int, vocab: int, device: str, seed: int = 0):
    gen = torch.Generator(device).manual_seed(seed)  # made where they are used: big on a GPU
    logits = torch.randn(b, k, gamma + 1, vocab, generator=gen, device=device) * 3
    logits[:, 1:, 0] = logits[:, :1, 0]  # every path starts at the same root node
    noise = torch.randn(b, k, gamma, vocab, generator=gen, device=device)
    q = (logits[:, :, :gamma] + noise).softmax(-1)
    p = logits.softmax(-1)
    tokens = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, k, gamma)
    return tokens, q, p


def device_ms(fn, repeats: int, device: str) -> float:
    """Median ms of `fn` after a warm call, synchronised on an accelerator."""
    sync = None if device == "cpu" else torch.cuda.synchronize
    return median_ms(fn, repeats, sync=sync)


# The profile keeps this many kernels by GPU time per call (in the JSON: where the time goes).
TOP_KERNELS = 8


def profile_call(fn, top: int = TOP_KERNELS) -> dict:
    """One call under torch.profiler: GPU kernels launched, their summed busy time, the host
    waits on the GPU (cudaStreamSynchronize: .item(), nonzero, masked indexing), and the `top`
    kernels (and copies) that took the most GPU time. Many kernels and waits with little busy
    time means the call is bound by launches and syncs, not memory.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    waits = [e for e in prof.events() if e.name == "cudaStreamSynchronize"]
    by_name: dict[str, list] = {}  # kernel name (templates cut) -> [calls, busy µs]
    for e in gpu:
        entry = by_name.setdefault(e.name.removeprefix("void ")[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return dict(
        kernels=len(kernels),
        gpu_ms=sum(e.device_time for e in gpu) / 1e3,
        waits=len(waits),
        top_kernels=[dict(name=n, calls=c, ms=round(us / 1e3, 4)) for n, (c, us) in ranked],
    )


def bench_shape(b: int, k: int, vocab: int, args) -> list[dict]:
    """Time every applicable method at one shape; prints one table row per method."""
    x, q, p = make_inputs(b, k, args.gamma, vocab, args.device)
    gen = torch.Generator(device=args.device).manual_seed(1)
    flat = (x.view(b * k, 1, -1), q.view(b * k, 1, args.gamma, vocab), p.view(b * k, 1, -1, vocab))

    def time_call(method: str, inputs, validate: bool = False, graphs=None) -> float:
        return device_ms(
            lambda: verify(method, *inputs, generator=gen, validate=validate, graphs=graphs),
            args.repeats,
            args.device,
        )

    def same_tokens(method: str, graphs) -> bool:
        eager, graphed = (
            verify(method, x, q, p, torch.Generator(args.device).manual_seed(s), graphs=g)
            for s, g in ((2, None), (2, graphs))
        )
        fields = ("tokens", "num_tokens", "path")
        return all(torch.equal(getattr(eager, f), getattr(graphed, f)) for f in fields)

    base = time_call("token", flat)
    rows = []
    for method in args.methods:
        if VERIFIERS[method].single_path and k > 1:
            continue
        ms = time_call(method, (x, q, p))
        row = dict(vocab=vocab, batch=b, k=k, method=method, ms=ms, ratio=ms / base)
        line = f"| {vocab} | {b} | {k} | {method} | {ms:.2f} | {ms / base:.2f} |"
        if args.profile:
            row.update(
                profile_call(lambda m=method: verify(m, x, q, p, generator=gen, validate=False))
            )
            line += f" {row['kernels']} | {row['gpu_ms']:.2f} | {row['waits']} |"
        if args.graphs:
            graphs = VerifyGraphs()
            replay = functools.partial(verify, method, x, q, p, gen, validate=False, graphs=graphs)
            start = time.perf_counter()
            replay()  # the capture
            row.update(graph_capture_s=time.perf_counter() - start)
            if args.profile:
                row.update({f"graph_{k}": v for k, v in profile_call(replay).items()})
            row.update(
                graph_ms=time_call(method, (x, q, p), graphs=graphs),
                graph_same=same_tokens(method, graphs),
                graph_captured=graphs.eager_shapes == 0,
            )
            same = row["graph_same"] if row["graph_captured"] else "capture failed"
            line += f" {row['graph_ms']:.2f} | {row['graph_ms'] / base:.2f} | {same} |"
            line += f" {row['graph_capture_s']:.1f} |"
            if args.profile:
                line += f" {row['graph_kernels']} | {row['graph_gpu_ms']:.2f} |"
        rows.append(row)
        print(line, flush=True)
    check = time_call("token", flat, validate=True) - base
    rows.append(dict(vocab=vocab, batch=b, k=k, method="(input validation)", ms=check, ratio=None))
    print(f"| {vocab} | {b} | {k} | (input validation) | {check:.2f} | |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = parser("verify", __doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--profile", action="store_true", help="CUDA: kernels, GPU busy ms and host waits per call"
    )
    ap.add_argument(
        "--graphs", action="store_true", help="CUDA: also replay each call from a CUDA graph"
    )
    args = ap.parse_args(argv)
    if (args.profile or args.graphs) and not args.device.startswith("cuda"):
        ap.error("--profile and --graphs are CUDA measurements: they need --device cuda")
    torch.set_num_threads(args.threads)

    print(f"# verify() median ms, γ={args.gamma}, device={args.device}, threads={args.threads}")
    print(f"# {command('verify', argv)}; {machine()}")
    head, rule = "| V | B | K | method | ms | × token |", "|---|---|---|---|---|---|"
    if args.profile:
        head, rule = head + " kernels | GPU busy ms | host waits |", rule + "---|---|---|"
    if args.graphs:
        head += " graph ms | graph × token | same tokens | capture s |"
        rule += "---|---|---|---|"
        if args.profile:
            head, rule = head + " graph kernels | graph busy ms |", rule + "---|---|"
    print(head)
    print(rule)
    rows = [
        row
        for vocab in args.vocab
        for b in args.batch
        for k in args.k
        for row in bench_shape(b, k, vocab, args)
    ]
    meta = dict(gamma=args.gamma, device=args.device, threads=args.threads)
    save_json(args.json, "verify", argv, dict(meta, rows=rows))
