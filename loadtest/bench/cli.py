"""`blockspec-bench NAME [options]`: the benchmarks that docs pages cite, one subcommand each.

`blockspec-bench NAME --help` shows what a benchmark measures and its options. Those that
compare paths (the engine and the service, two layouts, two revisions) run them alternated
round by round and report medians (loadtest/bench/harness.py); those with `--json` write the
file a docs page reads, with the command and the machine.
"""

from __future__ import annotations

import importlib
import sys

# name: (module under blockspec.loadtest.bench, what it measures, the docs page it feeds).
BENCHMARKS = {
    "engine": ("engine", "the engine's methods side by side on a pair", "benchmarks.md"),
    "engine-gpu": ("engine_gpu", "parity, every verifier's speed on one GPU", "gpu.md"),
    "forward": ("forward", "weight layouts and dtypes, forwards and end to end", "benchmarks.md"),
    "llamacpp": ("llamacpp", "the engine against llama.cpp's plain decoding", "benchmarks.md"),
    "quality": ("quality", "what a dtype's rounding costs a model's text", "model_card.md"),
    "verify": ("verify", "every verifier's call at service shapes", "verification_benchmark.md"),
    "verify-ab": (
        "verify_ab",
        "verify() of this checkout against a revision's",
        "verification_benchmark.md",
    ),
    "service": ("service", "the service against the in-process engine", "service_benchmark.md"),
    "gpu-shaped": (
        "gpu_shaped",
        "the actors' path with GPU-timed forwards",
        "service_benchmark.md",
    ),
    "bounds": ("bounds", "forward costs, contention, a step's floor per transport", "bounds.md"),
    "admission": (
        "admission",
        "requests joining at once through the actors",
        "service_benchmark.md",
    ),
    "idle": ("idle", "the CPU an idle service uses", "service_benchmark.md"),
    "chaos": ("chaos", "streams and recovery while actors are killed", "reliability.md"),
    "conversation": ("conversation", "time to first token with prefix caching", "conversations.md"),
    "client-start": ("client_start", "how fast the blockspec client starts", "client.md"),
    "outcomes": ("outcomes", "how often a speculation cache would hit", "outcomes.md"),
    "speculation": ("speculation", "the speculation cache on and off", "outcomes.md"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [
        f"  {name:{width}}  {what} (docs/{page})" for name, (_, what, page) in BENCHMARKS.items()
    ]
    return (
        "usage: blockspec-bench NAME [options]\n\n" + __doc__ + "\nbenchmarks:\n" + "\n".join(rows)
    )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"error: no benchmark {name!r}; one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(f"blockspec.loadtest.bench.{BENCHMARKS[name][0]}")
    module.main(rest)
