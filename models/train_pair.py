"""Train blockspec's tiny target/draft model pair (models/tiny/, for fast tests) offline on CPU.

Stages (run in order by ``--stage all``):

1. ``tokenizer``: byte-level BPE (HF ``tokenizers``) on the training split of the CPython
   standard library of the running interpreter; tokenizes train and held-out splits.
2. ``target``: a small Llama (``transformers.LlamaForCausalLM``) trained by next-token loss.
3. ``draft``: a smaller Llama distilled from the exported target (forward KL(p_target || q_draft)).

Everything is a function of ``--seed``: sorted file order, a seeded file split, and per-step
batch offsets drawn from a generator seeded with (seed, step), so a resumed or re-run job sees
exactly the same batches. ``--*-minutes`` time-boxes a stage by measuring the step time during
warm-up and fixing the step count then (the LR schedule only depends on the total after
warm-up); the steps actually run are recorded in ``train_meta.json`` next to the weights, and
``--*-steps`` reproduces them exactly. Checkpoints go to ``--cache-dir`` (keep it git-ignored).

Example::

    OMP_NUM_THREADS=1 nice -n 19 python -m blockspec.models.train_pair --stage all \
        --target-steps 1014 --draft-steps 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# One thread everywhere: the machine is shared, and single-threaded CPU kernels also keep the
# run bit-for-bit reproducible. Must be set before torch / tokenizers spin up their pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"

# Directory names that hold tests or non-code data; everything else under stdlib is used.
# site-packages is third-party code that differs per machine, so it is excluded too.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "encodings"}
)


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    layers: int
    heads: int
    intermediate: int


@dataclass
class TrainConfig:
    seed: int = 0
    vocab_size: int = 8192
    seq_len: int = 384  # training context; eval keeps prompt + continuation within it
    heldout_frac: float = 0.05  # fraction of files held out (split by file, not by token)
    # Sizes chosen from CPU prototypes: deeper/wider models learn slower per CPU-minute.
    target: ModelSpec = field(default_factory=lambda: ModelSpec(256, 4, 4, 688))
    draft: ModelSpec = field(default_factory=lambda: ModelSpec(128, 1, 2, 344))
    batch_size: int = 8  # small batches: more updates per CPU-minute in a short budget
    target_lr: float = 3e-3  # small models tolerate (and need) a high LR in a short budget
    draft_lr: float = 4e-3
    warmup_steps: int = 100
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    calib_steps: int = 30  # steps timed during warm-up to turn --minutes into a step count
    overrun: float = 1.3  # a time-boxed stage stops at this multiple of --minutes regardless
    ckpt_every: int = 100
    log_every: int = 50


# ----------------------------------------------------------------------------- data


def stdlib_files() -> list[Path]:
    """Sorted .py files of the running interpreter's stdlib, tests and data excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                out.append(Path(dirpath) / name)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path], cfg: TrainConfig) -> tuple[list[Path], list[Path]]:
    """Seeded file-level split: held-out files never contribute to tokenizer or training."""
    order = list(range(len(files)))
    random.Random(cfg.seed).shuffle(order)
    n_held = max(1, round(len(files) * cfg.heldout_frac))
    held = sorted(order[:n_held])
    train = sorted(order[n_held:])
    return [files[i] for i in train], [files[i] for i in held]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """One token stream: each file followed by EOS (documents are packed, not padded)."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer(read_text(path), verbose=False)["input_ids"])  # long files: no warning
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int16 if len(tokenizer) < 2**15 else torch.int32)


def batch_at(tokens: torch.Tensor, step: int, cfg: TrainConfig, salt: int) -> torch.Tensor:
    """Batch for `step`, a pure function of (seed, salt, step) so resuming replays exactly."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + salt * 7_919 + step)
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
    return torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


def heldout_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows from the start of the held-out stream (same for every model)."""
    n = min(len(tokens) - 1, max_tokens) // seq_len
    return torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).long()


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(files: list[Path], cfg: TrainConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in files), trainer, length=len(files))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def stage_tokenizer(cfg: TrainConfig, cache: Path) -> None:
    tok_dir = cache / "tokenizer"
    if (cache / "tokens.pt").exists() and (tok_dir / "tokenizer.json").exists():
        print("tokenizer: cached", flush=True)
        return
    t0 = time.time()
    train_files, held_files = split_files(stdlib_files(), cfg)
    tokenizer = train_tokenizer(train_files, cfg)
    tokenizer.save_pretrained(tok_dir)
    data = {
        "train": encode_files(tokenizer, train_files),
        "heldout": encode_files(tokenizer, held_files),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_bytes": sum(p.stat().st_size for p in train_files),
        "minutes": (time.time() - t0) / 60,
    }
    torch.save(data, cache / "tokens.pt")
    print(
        f"tokenizer: {len(tokenizer)} tokens; train {len(train_files)} files "
        f"{len(data['train'])} tok, held-out {len(held_files)} files {len(data['heldout'])} tok; "
        f"{data['minutes']:.1f} min",
        flush=True,
    )


# ----------------------------------------------------------------------------- models


def llama_config(spec: ModelSpec, cfg: TrainConfig, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=cfg.seq_len,
        rope_theta=10000.0,
        tie_word_embeddings=True,  # the embedding is most of the params at this size
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def n_params(model) -> int:
    # Tied weights are counted once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def lr_at(step: int, total: int, base: float, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine to min_lr_frac; independent of `total` during warm-up."""
    if step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return base * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model, lr: float, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on norms (1-D); decaying the tied embedding is standard and harmless.
    params = list({id(p): p for p in model.parameters()}.values())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def save_tokenizer(tokenizer, out: Path, max_len: int) -> None:
    """Save, naming the generic fast class so that transformers 4.x loads it as well as 5.x."""
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    conf = json.loads(path.read_text())
    for machine_specific in ("is_local", "local_files_only"):
        conf.pop(machine_specific, None)
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    conf["model_max_length"] = max_len
    path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


def export(model, tokenizer, out: Path, meta: dict) -> None:
    """Half-precision safetensors + config + tokenizer, loadable by the Auto* classes."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    half = model.to(torch.float16)
    half.config.dtype = torch.float16
    half.save_pretrained(out)
    model.to(torch.float32)
    save_tokenizer(tokenizer, out, model.config.max_position_embeddings)
    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def train_step(model, teacher, opt, x: torch.Tensor, grad_clip: float) -> torch.Tensor:
    """One optimiser step on the batch x [B, T+1]: next-token cross-entropy for the target, the
    forward KL to the teacher for the draft. Returns the loss."""
    logits = model(input_ids=x[:, :-1]).logits
    if teacher is None:
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    else:
        with torch.no_grad():
            log_p = F.log_softmax(teacher(input_ids=x[:, :-1]).logits, dim=-1).flatten(0, 1)
        log_q = F.log_softmax(logits, dim=-1).flatten(0, 1)
        # Forward KL(p || q) per token: the draft must cover the target's mass, which is
        # what acceptance sum_x min(p, q) rewards.
        loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss


def stage_meta(name: str, cfg: TrainConfig, model, step: int, elapsed: float, val: float) -> dict:
    """What train_meta.json records of a finished stage (and how to reproduce it)."""
    is_draft = name == "draft"
    return {
        "role": name,
        "seed": cfg.seed,
        "steps": step,
        "train_minutes": round(elapsed / 60, 2),
        "params": n_params(model),
        "spec": asdict(cfg.draft if is_draft else cfg.target),
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "lr": cfg.draft_lr if is_draft else cfg.target_lr,
        "objective": "KL(target || draft)" if is_draft else "next-token cross-entropy",
        "heldout_loss_fp32": round(val, 4),
        "train_tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "reproduce": f"--{name}-steps {step} --seed {cfg.seed}",
    }


def stage_models(name: str, cfg: TrainConfig, out_dir: Path, eos_id: int, salt: int):
    """(the model a stage trains, freshly seeded; the draft's teacher or None)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    teacher = None
    if name == "draft":
        # Distil from the *exported* target, i.e. exactly the model that ships.
        teacher = AutoModelForCausalLM.from_pretrained(out_dir / "target", dtype=torch.float32)
        teacher.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed + salt)
    model = LlamaForCausalLM(llama_config(cfg.draft if teacher else cfg.target, cfg, eos_id))
    model.train()
    return model, teacher


def run_stage(name: str, cfg: TrainConfig, cache: Path, out_dir: Path, args) -> None:
    """Train `name` ('target' or 'draft'); resumable from cache/<name>/ckpt.pt."""
    tokenizer = load_tokenizer(cache / "tokenizer")
    data = torch.load(cache / "tokens.pt")
    train, held = data["train"], data["heldout"]
    val = heldout_windows(held, cfg.seq_len, 16 * cfg.seq_len)  # cheap progress metric
    eos_id = tokenizer.convert_tokens_to_ids(EOS)

    is_draft = name == "draft"
    base_lr = cfg.draft_lr if is_draft else cfg.target_lr
    steps = args.draft_steps if is_draft else args.target_steps
    minutes = args.draft_minutes if is_draft else args.target_minutes
    salt = 2 if is_draft else 1  # the draft sees a different batch order than the target

    model, teacher = stage_models(name, cfg, out_dir, eos_id, salt)
    opt = make_optimizer(model, base_lr, cfg)

    (cache / name).mkdir(parents=True, exist_ok=True)
    ckpt_path = cache / name / "ckpt.pt"
    step, total, elapsed, history = 0, steps, 0.0, []
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, history, total = (
            ck["step"],
            ck["elapsed"],
            ck["history"],
            total or ck["total"],
        )
        print(f"{name}: resumed at step {step} ({elapsed / 60:.1f} min done)", flush=True)
    if total is None and minutes is None:
        raise SystemExit(f"{name}: give --{name}-steps or --{name}-minutes")

    def save() -> None:
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
        state |= {"total": total, "elapsed": elapsed, "history": history}
        torch.save(state, ckpt_path.with_suffix(".tmp"))
        ckpt_path.with_suffix(".tmp").replace(ckpt_path)  # atomic: a kill never corrupts it

    spec = asdict(cfg.draft if is_draft else cfg.target)
    print(f"{name}: {n_params(model) / 1e6:.2f}M params, spec {spec}", flush=True)
    calib_t0 = None
    t_last = time.time()
    while total is None or step < total:
        if total is None and step == 5:
            calib_t0 = elapsed  # skip the first steps (allocator warm-up)
        if total is None and step == 5 + cfg.calib_steps:
            per_step = (elapsed - calib_t0) / cfg.calib_steps
            total = max(cfg.warmup_steps + 1, int(minutes * 60 / per_step))
            print(f"{name}: {per_step:.2f} s/step -> {total} steps in {minutes} min", flush=True)
            if total <= step:
                break
        if minutes is not None and steps is None and elapsed > cfg.overrun * minutes * 60:
            print(f"{name}: over time, stopping at step {step} of {total}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, base_lr, cfg)
        loss = train_step(model, teacher, opt, batch_at(train, step, cfg, salt), cfg.grad_clip)
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % cfg.log_every == 0 or step == total:
            val_loss = heldout_loss(model, val)
            t_last = time.time()  # validation time is not training time
            history.append({"step": step, "loss": loss.item(), "val": val_loss})
            print(
                f"{name} step {step}/{total or '?'} loss {loss.item():.3f} val {val_loss:.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {elapsed / 60:.1f} min",
                flush=True,
            )
        if step % cfg.ckpt_every == 0:
            save()
    save()

    full_val = heldout_loss(model, heldout_windows(held, cfg.seq_len, 10**9))
    meta = stage_meta(name, cfg, model, step, elapsed, full_val)
    export(model, tokenizer, out_dir / name, meta)
    print(f"{name}: done, {step} steps, {elapsed / 60:.1f} min, held-out {full_val:.3f}")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stage", choices=["tokenizer", "target", "draft", "all"], default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int)
    ap.add_argument("--target-minutes", type=float)
    ap.add_argument("--draft-steps", type=int)
    ap.add_argument("--draft-minutes", type=float)
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "train")
    ap.add_argument("--out-dir", type=Path, default=REPO / "models" / "tiny")
    ap.add_argument("--fresh", action="store_true", help="delete cached state of these stages")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    cfg = TrainConfig(seed=args.seed)
    cache = args.cache_dir / f"seed{cfg.seed}"
    cache.mkdir(parents=True, exist_ok=True)
    stages = ["tokenizer", "target", "draft"] if args.stage == "all" else [args.stage]
    if args.fresh:
        for s in stages:
            for p in [cache / s] if s != "tokenizer" else [cache / s, cache / "tokens.pt"]:
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, config {asdict(cfg)}")
    for s in stages:
        if s == "tokenizer":
            stage_tokenizer(cfg, cache)
        else:
            run_stage(s, cfg, cache, args.out_dir, args)


if __name__ == "__main__":
    main()
