"""Time to first token of a stateless chat, with and without automatic prefix caching.

    blockspec-bench conversation [--conversations 5] [--turns 5]

A stateless client sends the whole conversation every turn (as every OpenAI client does). Two
engines on the default pair run the same conversations side by side in one process, turn by
turn, alternating which goes first: one with prefix caching (the turn's prompt reuses the
parked KV of the previous turn), one without (every turn prefills its whole prompt). Each turn
is greedy `block`, γ = 4, 24 new tokens; its time to first token is from `add` to the first
emitted tokens (the prefill and the first step). Prints the median TTFT per turn of each engine
and their ratio, and the cached prompt tokens; docs/conversations.md holds the current table.
"""

from __future__ import annotations

import statistics
import time

from blockspec.loadtest.bench.harness import parser
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, render_chat
from blockspec.workers.sampling import SamplingParams

QUESTIONS = [
    "Explain what a hash map is in two sentences.",
    "How does it handle collisions?",
    "Write a short Python example of one.",
    "What is its time complexity for lookups?",
    "Summarise our conversation in one sentence.",
]
NEW_TOKENS = 24


def first_token_s(engine, req) -> tuple[float, list[int], int]:
    """(seconds to the first emitted tokens, the reply's tokens, cached prompt tokens)."""
    start, first = time.perf_counter(), []

    def on_tokens(_progress) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    request_id = engine.add(req, on_tokens=on_tokens)
    while True:
        for result in engine.step().finished:
            if result.request_id == request_id:
                return first[0], result.token_ids, result.cached_tokens


def main(argv: list[str] | None = None) -> None:
    ap = parser("conversation", __doc__)
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=len(QUESTIONS))
    args = ap.parse_args(argv)
    common = dict(max_batch=1, max_len=2048, max_sessions=4)
    cache, tokenizer = build_engine(str(DEFAULT_DRAFT), str(DEFAULT_TARGET), **common)
    no_cache, _ = build_engine(
        str(DEFAULT_DRAFT), str(DEFAULT_TARGET), prefix_caching=False, **common
    )
    engines = {"cache": cache, "no cache": no_cache}
    ttft = {name: [[] for _ in range(args.turns)] for name in engines}
    prompts, cached = [[] for _ in range(args.turns)], [[] for _ in range(args.turns)]
    greedy = SamplingParams(temperature=0.0)
    for c in range(args.conversations):
        history = [dict(role="system", content=f"You are assistant number {c}.")]
        for turn in range(args.turns):
            history.append(dict(role="user", content=QUESTIONS[turn % len(QUESTIONS)]))
            ids = render_chat(tokenizer, history)
            order = list(engines) if (c + turn) % 2 == 0 else list(engines)[::-1]
            for name in order:
                engine = engines[name]
                req = make_request(
                    engine.limits, ids, NEW_TOKENS, "block", gamma=4, sampling=greedy,
                    cache_scope="bench",
                )  # fmt: skip
                seconds, reply, hit = first_token_s(engine, req)
                ttft[name][turn].append(seconds)
                if name == "cache":
                    prompts[turn].append(len(ids))
                    cached[turn].append(hit)
                    text = tokenizer.decode(reply, skip_special_tokens=True)
            history.append(dict(role="assistant", content=text))
    print(f"{args.conversations} conversations, median per turn (seconds to first token)")
    print("| turn | prompt tokens | cached | TTFT cache | TTFT no cache | ratio |")
    print("|---|---|---|---|---|---|")
    for turn in range(args.turns):
        on = statistics.median(ttft["cache"][turn])
        off = statistics.median(ttft["no cache"][turn])
        print(
            f"| {turn + 1} | {statistics.median(prompts[turn]):.0f} "
            f"| {statistics.median(cached[turn]):.0f} | {on:.3f} | {off:.3f} | {on / off:.2f} |"
        )
