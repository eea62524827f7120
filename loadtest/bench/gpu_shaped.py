"""What the actors' path keeps of the engine's speed when forwards take a GPU's time: a
simulation on the CPU (no Ray runs on the lent GPU machines).

    blockspec-bench gpu-shaped [--draft-ms 1] [--target-ms 4] \
        [--batch 1 16] [--rounds 3] [--new-tokens 64] [--gamma 4] [--json OUT]

A pair of random micro Llamas with the tiny pair's vocabulary (8192 ids, so q rows weigh what
they do on the real pairs; 1 and 2 layers of width 64, so their arithmetic takes well under a
millisecond) whose every forward is padded by sleeping to a fixed wall time: `--draft-ms` for
the draft's, `--target-ms` for the target's. The same engine decodes the same seeded requests
in this process and through a draft actor and a target shard (`build_remote_engine`, the
replica's path without gRPC), alternated round by round; both give the same tokens, so the
ratio of tokens/s is the ratio of step times. Sleeping leaves the cores free, as a GPU would:
what is left is the host's work, the step's messages and the processes' wake-ups.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockspec.loadtest.bench.harness import alternate, parser, ratios, save_json, spread
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.service.results import StepTimes
from blockspec.workers.models import TINY_TARGET
from blockspec.workers.sampling import SamplingParams

PHASES = StepTimes.PHASES


def save_micro_pair(root: Path) -> tuple[str, str]:
    """(draft dir, target dir): random 1- and 2-layer Llamas of width 64, the tiny pair's
    vocabulary and tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((TINY_TARGET / "config.json").read_text())
    dirs = []
    for name, layers, seed in (("draft", 1, 1), ("target", 2, 2)):
        cfg = LlamaConfig(
            **dict(
                base,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=layers,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=32,
            )
        )
        torch.manual_seed(seed)
        path = root / name
        LlamaForCausalLM(cfg).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(TINY_TARGET / f, path / f)
        dirs.append(str(path))
    return dirs[0], dirs[1]


def sleep_forwards(ms_by_layers: dict[int, float]) -> None:
    """In this process: every Llama forward takes at least ms_by_layers[its layer count]."""
    from blockspec.workers.llama import Llama

    compute = getattr(Llama.forward, "__wrapped_compute__", Llama.forward)

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = compute(self, *args, **kwargs)
        left = ms_by_layers[self.spec.num_layers] / 1e3 - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return out

    forward.__wrapped_compute__ = compute
    Llama.forward = forward


def decode(engine, args, batch: int) -> dict:
    """2·batch seeded requests, batch at a time in flight: tokens/s and ms per step by phase."""
    reqs = [
        make_request(
            engine.limits,
            [(7 * i + j) % 8000 + 10 for j in range(32)],
            args.new_tokens,
            "block",
            1,
            args.gamma,
            SamplingParams(1.0),
            seed=i,
        )
        for i in range(2 * batch)
    ]
    engine.reset_stats()
    start = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - start
    steps = max(engine.steps, 1)
    return dict(
        tokens_per_s=sum(len(r.token_ids) for r in out) / wall,
        step_ms=1e3 * wall / steps,
        phase_ms={p: 1e3 * getattr(engine.times, p) / steps for p in PHASES},
        tokens=[r.token_ids for r in out],
    )


def measure(args, batch: int, draft: str, target: str, ms: dict[int, float]) -> dict:
    """Both paths at one batch size, alternated round by round."""
    import ray

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine

    local, _ = build_engine(draft, target, batch, max_len=256)
    cfg = ReplicaConfig(
        draft_dir=draft, target_dir=target, max_batch=batch, max_len=256, max_sessions=0
    )
    remote, _ = build_remote_engine(cfg)
    actors = remote.draft.actors + remote.target.actors
    ray.get([a.__ray_call__.remote(lambda _self: sleep_forwards(ms)) for a in actors])
    arms = {
        "engine": lambda: decode(local, args, batch),
        "actors": lambda: decode(remote, args, batch),
    }
    runs = alternate(arms, args.rounds)
    for a in actors:
        ray.kill(a)
    ray.util.remove_placement_group(remote.target.placement_group)
    engine, through_actors = runs["engine"], runs["actors"]
    return dict(
        same_tokens=all(
            e["tokens"] == a["tokens"] for e, a in zip(engine, through_actors, strict=True)
        ),
        ratios=ratios(
            [r["tokens_per_s"] for r in through_actors], [r["tokens_per_s"] for r in engine]
        ),
        **{
            path: dict(
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
                step_ms=statistics.median(r["step_ms"] for r in rs),
                phase_ms={p: statistics.median(r["phase_ms"][p] for r in rs) for p in PHASES},
            )
            for path, rs in runs.items()
        },
    )


def table(args, result: dict) -> None:
    print(
        f"draft forward {args.draft_ms} ms, target forward {args.target_ms} ms (slept), block "
        f"γ = {args.gamma}, {args.new_tokens} new tokens, {args.rounds} rounds alternated"
    )
    print(
        "\n| batch | path | tok/s | actors / engine (range) | step ms | "
        + " | ".join(PHASES)
        + " | same tokens |"
    )
    print("|" + "---|" * (6 + len(PHASES)))
    for batch in args.batch:
        row = result[f"batch_{batch}"]
        for path in ("engine", "actors"):
            r = row[path]
            ratio = "1.00×" if path == "engine" else spread(row["ratios"], "×")
            print(
                f"| {batch} | {path} | {r['tokens_per_s']:.0f} | {ratio} | {r['step_ms']:.2f} | "
                + " | ".join(f"{r['phase_ms'][p]:.2f}" for p in PHASES)
                + f" | {row['same_tokens']} |"
            )


def main(argv: list[str] | None = None) -> None:
    ap = parser("gpu-shaped", __doc__)
    ap.add_argument("--draft-ms", type=float, default=1.0)
    ap.add_argument("--target-ms", type=float, default=4.0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the raw result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import ray

    from blockspec.service.app import start_ray
    from blockspec.service.config import Settings

    ms = {1: args.draft_ms, 2: args.target_ms}
    sleep_forwards(ms)
    root = Path(tempfile.mkdtemp(prefix="blockspec-gpu-shaped-"))
    draft, target = save_micro_pair(root)
    start_ray(Settings(ray_num_cpus=2))
    result: dict = dict(draft_ms=args.draft_ms, target_ms=args.target_ms, gamma=args.gamma)
    for batch in args.batch:
        result[f"batch_{batch}"] = measure(args, batch, draft, target, ms)
    ray.shutdown()
    table(args, result)
    save_json(args.json, "gpu-shaped", argv, result)
    shutil.rmtree(root)
