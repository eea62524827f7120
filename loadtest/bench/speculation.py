"""The speculation cache on a real pair: hit rate by fan-out F and verifier, and seeded output
with the cache on equal to the same draft law without hits (workers/speculation.py; issue 45).

For each verifier the same seeded requests (the everyday held-out prompts,
loadtest/everyday.py) run once with the cache off, then once per F with it on; a hit is a
drafted request whose real outcome had a prepared proposal. With a feature draft (the default
pair's) the cache on means the draft's own-feature law (it reads its own features after a
rejection, see workers/speculation.py), so one more run gives that law with nothing prepared
(`own law`: the cache's batch limit at 0), the output every F must reproduce, and its block
efficiency against `off` is what the law costs. With a token draft the cache changes no law
and every F must reproduce `off`. The draft phase's seconds include the preparing: in this
process it runs after the step's own draft, on the same cores, so on a CPU the cache only costs
(the wall-clock gain needs the draft and the target on separate devices or streams).

    blockspec-bench speculation --json docs/speculation_feature.json
    blockspec-bench speculation \
        --draft ~/.cache/blockspec/smollm2-135m-draft-token-only \
        --temperature 1.0 0.7 0.0 --downweight 1.0 0.5 --json docs/speculation.json
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from blockspec.loadtest.bench.harness import parser, save_json
from blockspec.loadtest.everyday import everyday_ids
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.speculation import speculation_cache


def run(
    engine, prompts, method, k, args, temperature, fanout: int, downweight=1.0, max_batch=None
) -> dict:
    cache = speculation_cache(engine.draft, fanout, downweight, max_batch)
    engine.executor.speculation = cache
    engine.reset_stats()
    sampling = SamplingParams(temperature)
    reqs = [
        make_request(engine.limits, p, args.new_tokens, method, k, args.gamma, sampling, seed=i)
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - start
    calls = sum(r.stats.target_calls for r in results)
    row = dict(
        outputs=[r.token_ids for r in results],
        wall_s=round(wall, 2),
        draft_s=round(engine.times.draft, 2),
        block_efficiency=round(sum(len(r.token_ids) for r in results) / calls, 3),
    )
    if cache is not None:
        row.update(
            hits=cache.hits,
            lookups=cache.lookups,
            hit_rate=round(cache.hits / max(cache.lookups, 1), 3),
            prepared_per_lookup=round(cache.prepared / max(cache.lookups, 1), 2),
        )
    return row


def main(argv: list[str] | None = None) -> None:
    ap = parser("speculation", __doc__)
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--methods", nargs="+", default=["block", "gbv"])
    ap.add_argument("--k", type=int, default=2, help="K of gbv (block: 1)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    ap.add_argument("--fanout", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument(
        "--downweight", type=float, nargs="+", default=[1.0],
        help="Saguaro factors: the draft's F likeliest tokens scaled by it (1: off)",
    )  # fmt: skip
    ap.add_argument("--per-kind", type=int, default=1, help="everyday prompts per kind")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tok = build_engine(args.draft, args.target, args.batch, 1024)
    prompts = [ids for _, ids in everyday_ids(tok, 1024 - args.new_tokens - 8, args.per_kind)]
    result = dict(prompts=len(prompts), new_tokens=args.new_tokens, rows={})
    started = time.time()
    for temperature, method in itertools.product(args.temperature, args.methods):
        k = args.k if method == "gbv" else 1
        off = run(engine, prompts, method, k, args, temperature, 0)
        key = f"{method} K={k} gamma={args.gamma} T={temperature}"
        rows = {"off": {n: v for n, v in off.items() if n != "outputs"}}
        print(key, "off", rows["off"], flush=True)
        if engine.draft.feed.reads_features:  # the law every F must reproduce: see the doc
            own = run(engine, prompts, method, k, args, temperature, 1, max_batch=0)
            same = own.pop("outputs")
            rows["own law"] = {n: v for n, v in own.items() if n not in ("hits", "hit_rate")}
            print(key, "own law", rows["own law"], flush=True)
        else:
            same = off["outputs"]
        for downweight in args.downweight:
            for fanout in args.fanout:
                on = run(engine, prompts, method, k, args, temperature, fanout, downweight)
                outputs = on.pop("outputs")
                if downweight == 1:  # Saguaro sampling is another draft law: other outputs
                    on["same_output"] = outputs == same
                name = f"F={fanout}" + ("" if downweight == 1 else f" downweight={downweight}")
                rows[name] = on
                print(key, name, on, flush=True)
        result["rows"][key] = rows
    result["minutes"] = round((time.time() - started) / 60, 1)
    save_json(args.json, "speculation", argv, result)
