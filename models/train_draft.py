"""Train the default draft for SmolLM2-135M-Instruct on this CPU, distilled from the target.

Why distil from the target's *own answers*: speculative decoding only ever asks the draft about
contexts the target itself writes (a chat prompt, then the target's answer so far), and the
acceptance rate is sum_x min(p, q) on exactly those contexts. So the training set is the
target's sampled answers (T = 1) to chat prompts, and the loss at each answer position is the
cross-entropy to the target's next-token distribution there (its top-k probabilities, recorded
while sampling: the teacher forward comes for free).

Prompts (models/prompts.py): a topic x task grid of everyday requests (questions,
explanations, how-tos, writing, lists, advice, maths, rewrites of prose), code in several
languages and the standard library's functions, then a second round built on the first's
answers (follow-up turns, rewrites of the target's own text). The held-out evaluation
(blockspec.models.eval_draft: loadtest.everyday and HumanEval) never appears here.

The draft: an EAGLE-style *feature draft*. Each position reads fc([f_{t-1}; e(x_t)]), f the
target's final-norm hidden state one position back, and its own output stands in for f deeper
in the draft (workers/feature_draft.py); then Llama layers initialised from the target's first
two layers, the final norm, and the target's output head restricted to the ``--head-vocab``
tokens that hold the most teacher mass (FR-Spec, ACL 2025): tokens outside get q = 0, which
verification handles exactly. Only the layers, the norm and fc are trained and committed.
``--arch layers`` trains a token-only draft instead (no fc, no features).

Stages (``--stage all`` runs them in order; each is resumable and time-boxed):
1. ``generate``: sample answers with the target (bf16), round 1 then round 2 (``--round``);
2. ``features``: the target's features at every sampled position;
3. ``train``: distil (two passes per batch: on the target's features, what depth 1 sees, and
   on the draft's own detached outputs, what deeper depths see), then choose the draft's
   logit scale on the validation answers (`calibration`);
4. ``export``: write ``models/smollm2-draft/``; set-up (scripts/fetch_models.py) assembles it.

The sampled answers outlive the machine that sampled them: ``pack`` writes a seed's prompts
and answers (token ids and chat turns, no teacher rows) to ``models/smollm2-draft-answers/``,
and ``unpack`` turns every committed file back into shards, so a later run (on another machine,
in another session) trains on every seed sampled so far and spends its time on new ones.
``features`` records the teacher's top-k rows from its forward for shards that lack them.

The committed draft (docs/model_card.md has the run; seeds 2 and 4-8 are committed, so on a
new machine ``unpack`` replaces the ``generate`` stages) is a chain of warm-started runs, each
cross-entropy plus the total-variation loss (``--alpha-weight``); the latest, once seed 8 was
sampled, trained on the four newest seeds only (an hour of this CPU sees each ~2.7 times):

    .venv/bin/python -m blockspec.models.train_draft --stage unpack --seeds 5,6,7,8
    .venv/bin/python -m blockspec.models.train_draft --stage features --feature-batch 16   # 20 min
    .venv/bin/python -m blockspec.models.train_draft --seed 8 --val-seed 8 --stage train --bf16 \
        --train-minutes 60 --lr 5e-4 --alpha-weight 4 --init-draft <previous models/smollm2-draft>
    .venv/bin/python -m blockspec.models.train_draft --stage export
    .venv/bin/python scripts/fetch_models.py && python -m blockspec.models.eval_draft

A new seed's answers: ``--seed N --stage generate --round 1 --batch 128 --gen-minutes 20``,
then ``--round 2 --round2-minutes 3``, then ``--seed N --stage pack``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from blockspec.models import prompts as draft_prompts
from blockspec.workers.models import (
    DEFAULT_TARGET,
    FEATURE_FC,
    HEAD_SCALE,
    SMOLLM2_DRAFT_WEIGHTS,
    render_chat,
)

TOPK = 32  # teacher probabilities kept per position (they hold ~all of the mass at T = 1)
REPO = Path(__file__).resolve().parents[1]  # the checkout (module doc)
PACKED = REPO / "models" / "smollm2-draft-answers"  # committed answers: xz JSON lines a seed


def teacher_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's stored rows at each position of `logits` [..., V]: its top-k next-token
    log-probs (fp16) and their token ids (int32), [..., TOPK] each."""
    lp, ix = logits.float().log_softmax(-1).topk(TOPK, dim=-1)
    return lp.half(), ix.int()


def round_chats(args, tok, rnd: int, count: int) -> list[tuple[str, list[dict]]]:
    """`count` (kind, chat) prompts of generation round `rnd` (models/prompts.py)."""
    if rnd == 1:
        return draft_prompts.round_one(args.seed, count)
    answered = [
        (s["kind"], s["turns"], tok.decode(s["answer"], skip_special_tokens=True).strip())
        for s in load_answers(args.work, pattern=f"r1-s{args.seed}-*.pt")  # this seed's round 1
        if s["prompt_round"] == 1 and s["answer"][-1] == tok.eos_token_id  # finished answers
    ]
    return draft_prompts.round_two(args.seed, answered, count)


def generate(args, rnd: int) -> None:
    """Round `rnd`: sample the target's answers; record its top-k next-token log-probs at every
    position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    out = args.work / "answers"
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    count, minutes = (
        (args.prompts, args.gen_minutes) if rnd == 1 else (args.round2_prompts, args.round2_minutes)
    )
    chats = [(k, t, render_chat(tok, t)) for k, t in round_chats(args, tok, rnd, count)]
    chats = [c for c in chats if len(c[2]) <= args.max_prompt]
    order = sorted(range(len(chats)), key=lambda i: len(chats[i][2]))  # little padding per batch
    batches = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    random.Random(args.seed).shuffle(batches)  # a time-boxed run keeps a random subset

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):  # scores [B, V]: the raw next-token logits
            self.steps.append(teacher_rows(scores))
            return scores

    t0, made = time.time(), 0
    for b, batch in enumerate(batches):
        shard = out / f"r{rnd}-s{args.seed}-{b:05d}.pt"  # runs with other seeds add shards
        if shard.exists():
            continue
        if time.time() - t0 > minutes * 60:
            break
        enc = tok.pad({"input_ids": [chats[i][2] for i in batch]}, return_tensors="pt")
        enc = {key: t.to(args.device) for key, t in enc.items()}
        rec = Record()
        rec.steps = []
        torch.manual_seed(args.seed * 100_003 + rnd * 7919 + b)
        with torch.no_grad():
            seqs = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new,
                logits_processor=[rec],
                pad_token_id=tok.pad_token_id,
            )
        P = enc["input_ids"].shape[1]
        seqs = seqs.cpu()
        lp = torch.stack([s[0] for s in rec.steps], 1).cpu()  # [B, G, TOPK]
        ix = torch.stack([s[1] for s in rec.steps], 1).cpu()
        samples = []
        for r, i in enumerate(batch):
            gen = seqs[r, P:]
            stop = (gen == tok.eos_token_id).nonzero()
            n = int(stop[0]) + 1 if len(stop) else gen.shape[0]
            kind, turns, ids = chats[i]
            samples.append(
                dict(
                    kind=kind,
                    turns=turns,
                    prompt_round=rnd,
                    prompt=torch.tensor(ids),
                    answer=gen[:n].clone(),
                    logp=lp[r, :n].clone(),
                    index=ix[r, :n].clone(),
                )
            )
            made += n
        torch.save(samples, shard)
        rate = made / (time.time() - t0)
        print(f"round {rnd} batch {b}: {made} answer tokens, {rate:.0f} tok/s", flush=True)


def load_answers(work: Path, features: bool = False, pattern: str = "*.pt") -> list[dict]:
    """The sampled answers (of the shards `pattern` names); with `features`, each also carries
    the target's features."""
    samples = []
    for f in sorted((work / "answers").glob(pattern)):
        shard = torch.load(f)
        for s in shard:
            s["shard"] = f.stem  # r{round}-s{seed}-{batch}
        if features:
            for s, feat in zip(shard, torch.load(work / "features" / f.name), strict=True):
                s["feat"] = feat
        samples += shard
    return samples


def pack(args) -> None:
    """Seed `args.seed`'s sampled answers -> ``{args.packed}/s{seed}.jsonl.xz``: per answer its
    kind, round, chat turns, prompt and answer token ids (`features` recomputes the teacher's
    rows: at 192 bytes a token they do not belong in the repository)."""
    import lzma

    shards = sorted((args.work / "answers").glob(f"r*-s{args.seed}-*.pt"))
    if not shards:
        raise SystemExit(f"no answers of seed {args.seed} under {args.work / 'answers'}")
    args.packed.mkdir(parents=True, exist_ok=True)
    out, count = args.packed / f"s{args.seed}.jsonl.xz", 0
    with lzma.open(out, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
        for shard in shards:
            for s in torch.load(shard):
                row = dict(
                    shard=shard.stem,
                    kind=s["kind"],
                    round=s["prompt_round"],
                    turns=s["turns"],
                    prompt=s["prompt"].tolist(),
                    answer=s["answer"].tolist(),
                )
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
                count += 1
    print(f"wrote {count} answers to {out} ({out.stat().st_size} bytes)")


def unpack(args) -> None:
    """Every committed seed (or those `--seeds` names) -> answer shards under `args.work` (the
    names they were sampled under, so `generate` skips their batches), without the teacher's
    rows."""
    import lzma

    out = args.work / "answers"
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(args.packed.glob("s*.jsonl.xz"))
    if args.seeds:  # a subset: a warm-started run on the newest seeds
        names = {f"s{seed}.jsonl.xz" for seed in args.seeds.split(",")}
        if missing := names - {f.name for f in files}:
            raise SystemExit(f"--seeds: no {sorted(missing)} under {args.packed}")
        files = [f for f in files if f.name in names]
    for packed in files:
        shards: dict[str, list[dict]] = {}
        with lzma.open(packed, "rt") as f:
            for line in f:
                row = json.loads(line)
                shards.setdefault(row["shard"], []).append(
                    dict(
                        kind=row["kind"],
                        turns=row["turns"],
                        prompt_round=row["round"],
                        prompt=torch.tensor(row["prompt"]),
                        answer=torch.tensor(row["answer"]),
                    )
                )
        new = [name for name in shards if not (out / f"{name}.pt").exists()]
        for name in new:
            torch.save(shards[name], out / f"{name}.pt")
        print(f"{packed.name}: {len(new)} of {len(shards)} shards written", flush=True)


def target_hidden(model, seqs: list[torch.Tensor], batch: int = 8) -> list[torch.Tensor]:
    """The target's last hidden state (after its final norm: what its head reads) [T_i, E] at
    every position of each sequence [T_i], teacher-forced `batch` sequences at a time, on
    the model's device (returned on the CPU)."""
    out = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch]
        T = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        attn = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, x in enumerate(chunk):
            ids[b, : len(x)], attn[b, : len(x)] = x, 1
        with torch.no_grad():
            h = model.model(
                input_ids=ids.to(model.device), attention_mask=attn.to(model.device)
            ).last_hidden_state.cpu()
        out += [h[b, : len(x)].clone() for b, x in enumerate(chunk)]
    return out


@torch.no_grad()
def features(args) -> None:
    """The target's features at every position of every sampled prompt + answer, bf16: a
    feature draft's input."""
    from transformers import AutoModelForCausalLM

    out = args.work / "features"
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    t0, done = time.time(), 0
    for f in sorted((args.work / "answers").glob("*.pt")):
        samples = torch.load(f)
        unread = "logp" not in samples[0]  # unpacked: the teacher's rows come from this forward
        if (out / f.name).exists() and not unread:
            continue
        seqs = [torch.cat([s["prompt"], s["answer"]]) for s in samples]
        hidden = target_hidden(model, seqs, args.feature_batch)
        if unread:
            for s, h in zip(samples, hidden, strict=True):
                P, G = len(s["prompt"]), len(s["answer"])
                # position P-1+j predicts answer token j: the row `generate` records there
                z = model.lm_head(h[P - 1 : P - 1 + G].to(model.device))  # [G, V]
                s["logp"], s["index"] = (t.cpu() for t in teacher_rows(z))
            torch.save(samples, f)
        torch.save(hidden, out / f.name)
        done += sum(len(x) for x in seqs)
        print(f"{f.name}: {done} tokens, {done / (time.time() - t0):.0f} tok/s", flush=True)


def head_vocab(samples: list[dict], size: int, vocab_size: int, eos: int) -> torch.Tensor:
    """The `size` tokens with the most teacher probability mass over all answer positions."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        mass.index_add_(0, s["index"].flatten().long(), s["logp"].float().exp().flatten().double())
    mass[eos] = math.inf
    return mass.topk(size).indices.sort().values


class Draft(torch.nn.Module):
    """Frozen embedding -> trained Llama layers -> norm -> frozen head over the kept vocabulary."""

    def __init__(self, target, layers: list[int], vocab: torch.Tensor):
        super().__init__()
        import copy

        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": len(layers)})
        cfg.torch_dtype = None
        self.hf = LlamaForCausalLM(cfg)
        self.hf.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.float())
        for mine, src in zip(self.hf.model.layers, layers, strict=True):
            mine.load_state_dict(copy.deepcopy(target.model.layers[src].float().state_dict()))
        self.hf.model.norm.load_state_dict(target.model.norm.float().state_dict())
        self.hf.model.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("vocab", vocab)
        self.register_buffer(
            "head", target.model.embed_tokens.weight.detach().float()[vocab].clone()
        )

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = self.hf.model(input_ids=ids, attention_mask=attn).last_hidden_state
        return h @ self.head.T  # [B, T, V_kept]


class FeatureDraft(Draft):
    """EAGLE-style: position t reads fc([f_{t-1}; e(x_t)]) (the target's feature one position
    back, and the token), runs trained Llama layers and a trained norm, and its output both
    predicts x_{t+1} through the frozen head and stands in for the target's feature f_t when
    the draft goes one token deeper (where the target has not run yet)."""

    def __init__(self, target, layers: list[int], vocab: torch.Tensor, feat_rms: torch.Tensor):
        super().__init__(target, layers, vocab)
        E = target.config.hidden_size
        # The target's features are ~16x the embeddings' scale, one dimension ~250x (RMS 34 vs
        # 0.14): fed raw, they drown the token after the layer's input norm. Training reads
        # them per dimension at the embeddings' scale; export folds the scale into fc.
        self.register_buffer("feat_rms", feat_rms)  # [E]
        emb_rms = target.model.embed_tokens.weight.detach().float().pow(2).mean().sqrt()
        self.register_buffer("feat_scale", emb_rms / feat_rms)  # [E]
        self.fc = torch.nn.Linear(2 * E, E, bias=False)
        # Start as the token-only draft (u = e(x)); training lets the features in.
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, E:].copy_(torch.eye(E))

    def forward(self, ids, attn, fin):  # fin [B, T, E]: the feature one position back
        u = self.fc(torch.cat([fin * self.feat_scale, self.hf.model.embed_tokens(ids)], dim=-1))
        h = self.hf.model(inputs_embeds=u, attention_mask=attn).last_hidden_state
        return h @ self.head.T, h  # [B, T, V_kept], [B, T, E]


def shifted(feats: torch.Tensor) -> torch.Tensor:
    """[..., T, E] -> the feature one position back (zeros at position 0, as in prefill)."""
    return torch.cat([torch.zeros_like(feats[..., :1, :]), feats[..., :-1, :]], dim=-2)


def batches_of(samples, batch_tokens: int, rng: random.Random):
    order = list(range(len(samples)))
    rng.shuffle(order)
    batch, size = [], 0
    for i in order:
        n = len(samples[i]["prompt"]) + len(samples[i]["answer"])
        if batch and (size + n > batch_tokens):
            yield batch
            batch, size = [], 0
        batch.append(samples[i])
        size += n
    if batch:
        yield batch


def collate(batch, vocab_pos: torch.Tensor, pad: int):
    """Right-padded ids, the target's features [B, T, E] (None without), and per answer
    position the teacher's log-probs on the kept vocab."""
    T = max(len(s["prompt"]) + len(s["answer"]) for s in batch)
    ids = torch.full((len(batch), T), pad, dtype=torch.long)
    attn = torch.zeros(len(batch), T, dtype=torch.long)
    feats = None
    if "feat" in batch[0]:
        feats = torch.zeros(len(batch), T, batch[0]["feat"].shape[-1])
    rows, cols, lp, ix = [], [], [], []
    for b, s in enumerate(batch):
        seq = torch.cat([s["prompt"], s["answer"]])
        ids[b, : len(seq)] = seq
        attn[b, : len(seq)] = 1
        if feats is not None:
            feats[b, : len(seq)] = s["feat"].float()
        P, G = len(s["prompt"]), len(s["answer"])
        # position P-1+j predicts answer token j; the teacher's row was recorded there
        rows.append(torch.full((G,), b))
        cols.append(torch.arange(P - 1, P - 1 + G))
        lp.append(s["logp"].float())
        ix.append(vocab_pos[s["index"].long()])  # -1: outside the kept vocabulary
    targets = (torch.cat(rows), torch.cat(cols), torch.cat(lp), torch.cat(ix))
    return ids, attn, feats, targets


def to_device(obj, device: torch.device):
    """collate's tensors (nested in tuples; None stays) on `device`."""
    if isinstance(obj, tuple):
        return tuple(to_device(x, device) for x in obj)
    return obj if obj is None else obj.to(device, non_blocking=True)


def distill_loss(logits, rows, cols, lp, ix):
    """Cross-entropy to the teacher's top-k probabilities (mass outside the kept vocab can't be
    matched: q = 0 there), and the acceptance rate sum_x min(p, q) on the top-k."""
    logq = logits[rows, cols].float().log_softmax(-1)  # [N, V_kept]
    p = lp.exp() * (ix >= 0)
    q = logq.gather(1, ix.clamp_min(0)).exp() * (ix >= 0)
    ce = -(p * logq.gather(1, ix.clamp_min(0))).sum(-1).mean()
    return ce, torch.minimum(p, q).sum(-1).mean()


def losses(draft, batch, vocab_pos, pad: int, reg_weight: float, alpha_weight: float = 0.0):
    """(loss to minimise, acceptance on the top-k: [depth 1] or, for a feature draft,
    [depth 1, depth 2]). A feature draft runs twice: first on the target's features (depth 1,
    as after every verification), then on its own outputs one position back, detached (what
    it reads from depth 2 on); the first pass's outputs also regress onto the features.

    ``alpha_weight`` adds w (1 - α) per pass: the total-variation distance to the teacher's
    top-k, the quantity speculative decoding pays for (DistillSpec, ICLR 2024). Cross-entropy
    alone is mode-covering and leaves q flatter than α wants (see `calibration`)."""
    ids, attn, feats, targets = to_device(collate(batch, vocab_pos, pad), draft.head.device)
    if feats is None:
        ce, acc = distill_loss(draft(ids, attn), *targets)
        return ce + alpha_weight * (1 - acc), [acc.item()]
    logits, h = draft(ids, attn, shifted(feats))
    ce1, acc1 = distill_loss(logits, *targets)
    valid = attn.bool()
    rms = draft.feat_rms  # each dimension in its own units (see FeatureDraft)
    reg = torch.nn.functional.smooth_l1_loss(h[valid] / rms, feats[valid] / rms)
    logits2, _ = draft(ids, attn, shifted(h.detach()))
    ce2, acc2 = distill_loss(logits2, *targets)
    tv = (1 - acc1) + (1 - acc2)
    return ce1 + ce2 + reg_weight * reg + alpha_weight * tv, [acc1.item(), acc2.item()]


CALIBRATION_SCALES = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8)
CALIBRATION_TEMPERATURES = (1.0, 0.7)


@torch.no_grad()
def calibration(draft, val, vocab_pos, pad: int) -> dict:
    """Choose the draft's logit scale s, q = softmax(s z / T): a distilled draft comes out less
    confident than its teacher, and α = Σ min(p, q) rewards matching p's peaks (any q is
    lossless: verification reads the row the draft sampled from).

    On the validation answers (never trained on), from the teacher's recorded top-k: α of
    each s at T = 1 and 0.7 (p_T renormalised over the top-k), averaged over the draft's two
    feature sources (the target's: depth 1; its own: deeper). Keeps the s with the best mean
    over both temperatures; export writes it to head_scale.json and set-up folds it into the
    draft's head (scripts/fetch_models.py)."""
    draft.eval()
    sums = torch.zeros(len(CALIBRATION_TEMPERATURES), len(CALIBRATION_SCALES), dtype=torch.float64)
    count = 0
    for batch in batches_of(val, 4096, random.Random(0)):
        collated = to_device(collate(batch, vocab_pos, pad), draft.head.device)
        ids, attn, feats, (rows, cols, lp, ix) = collated
        if feats is None:
            passes = [draft(ids, attn)]
        else:
            first, h = draft(ids, attn, shifted(feats))
            passes = [first, draft(ids, attn, shifted(h))[0]]
        for logits in passes:
            z = logits[rows, cols].float()  # [N, V_kept]
            for t, temp in enumerate(CALIBRATION_TEMPERATURES):
                p = (lp / temp).softmax(-1) * (ix >= 0)  # [N, TOPK]
                for j, s in enumerate(CALIBRATION_SCALES):
                    q = (s * z / temp).softmax(-1).gather(1, ix.clamp_min(0)) * (ix >= 0)
                    sums[t, j] += torch.minimum(p, q).sum().item()
            count += len(rows)
    alpha = sums / count
    best = int(alpha.mean(0).argmax())
    draft.train()
    return dict(
        logit_scale=CALIBRATION_SCALES[best],
        alpha_by_scale={
            f"T={temp}": {
                f"{s}": round(float(a), 4) for s, a in zip(CALIBRATION_SCALES, row, strict=True)
            }
            for temp, row in zip(CALIBRATION_TEMPERATURES, alpha.tolist(), strict=True)
        },
    )


def split_validation(
    samples: list[dict], n_val: int, seed: int | None = None
) -> tuple[list[dict], list[dict]]:
    """(validation, training) of the shuffled `samples`: the first `n_val`, or with `seed` the
    first `n_val` of that seed's shards. Validation (and calibration) must be answers the
    warm-start draft never trained on, so `--val-seed` names a seed newer than that draft."""
    pool = [i for i, s in enumerate(samples) if seed is None or f"-s{seed}-" in s["shard"]]
    if not pool:
        raise SystemExit(f"--val-seed {seed}: no answers of that seed")
    held = set(pool[:n_val])
    return (
        [s for i, s in enumerate(samples) if i in held],
        [s for i, s in enumerate(samples) if i not in held],
    )


def head_of(tr: list[dict], size: int, target, tok) -> tuple:
    """The draft head's vocabulary over the training answers: (its ids [Vh], each id's place
    in it [V] (-1: not kept), the answers' tokens, the teacher's top-k mass the head keeps)."""
    vocab = head_vocab(tr, size, target.config.vocab_size, tok.eos_token_id)
    vocab_pos = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    vocab_pos[vocab] = torch.arange(len(vocab))
    tokens = sum(len(s["answer"]) for s in tr)
    covered = sum(
        float((s["logp"].float().exp() * (vocab_pos[s["index"].long()] >= 0)).sum()) for s in tr
    )
    print(
        f"{len(tr)} answers, {tokens} tokens; head keeps {len(vocab)} tokens holding "
        f"{covered / tokens:.3f} of the teacher's top-{TOPK} mass",
        flush=True,
    )
    return vocab, vocab_pos, tokens, covered


def validation_loss(draft, val: list[dict], loss, batch_tokens: int) -> tuple[float, list]:
    """The mean loss and α (top-k) per position over the validation answers."""
    draft.eval()
    total, accs = 0.0, None
    with torch.no_grad():
        for batch in batches_of(val, batch_tokens, random.Random(0)):
            c, a = loss(batch)
            total += c.item() * len(batch)
            accs = [x + y * len(batch) for x, y in zip(accs or [0.0] * len(a), a, strict=True)]
    draft.train()
    return total / len(val), [round(x / len(val), 4) for x in accs]


def new_draft(args, target, tr: list[dict], vocab: torch.Tensor) -> tuple:
    """(the draft to train, the target's layers it starts from): `--arch`'s kind, its layers
    copied from the target's `--init-layers`, on `--device`, warm-started from `--init-draft`."""
    layers = [int(x) for x in args.init_layers.split(",")]
    if args.arch == "features":
        feats = torch.cat([s["feat"] for s in tr[:200]]).float()
        draft = FeatureDraft(target, layers, vocab, feats.pow(2).mean(0).sqrt())
    else:
        draft = Draft(target, layers, vocab)
    draft = draft.to(args.device)
    if args.init_draft:
        warm_start(draft, args.init_draft, args.arch)
    return draft, layers


def warm_start(draft, init_draft: Path, arch: str) -> None:
    """An earlier draft's layers and norm (same shapes), and a feature draft's fc."""
    from safetensors.torch import load_file

    state = load_file(init_draft / "model.safetensors")
    mine = {k: v for k, v in state.items() if k.startswith(("model.layers.", "model.norm."))}
    missing, unexpected = draft.hf.load_state_dict(
        {k: v.float() for k, v in mine.items()}, strict=False
    )
    if unexpected or any(k.startswith("model.layers.") for k in missing):
        raise SystemExit(f"--init-draft does not fit: {missing=} {unexpected=}")
    if arch == "features" and (init_draft / FEATURE_FC).exists():
        # the committed fc has its feature scale folded in (export); unfold with ours
        fc = load_file(init_draft / FEATURE_FC)["weight"].float()  # [E, 2E]
        E = fc.shape[0]
        fc[:, :E] /= draft.feat_scale.cpu()
        draft.fc.weight.data.copy_(fc)


def learning_rate(peak: float, step: int, progress: float) -> float:
    """20 steps of warm-up, then a cosine to a tenth of the peak as progress goes to 1."""
    warm = min(1.0, (step + 1) / 20)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    samples = load_answers(args.work, features=args.arch == "features")
    rng = random.Random(args.seed)
    rng.shuffle(samples)
    val, tr = split_validation(samples, max(8, len(samples) // 40), args.val_seed)
    vocab, vocab_pos, tokens, covered = head_of(tr, args.head_vocab, target, tok)
    draft, layers = new_draft(args, target, tr, vocab)
    del target
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))

    def loss(batch):
        # bf16 autocast: the layers' matmuls in bf16 (AMX on recent Xeons, tensor cores on a
        # GPU), the weights, the optimiser and the losses' softmax in float32
        with torch.autocast(draft.head.device.type, torch.bfloat16, enabled=args.bf16):
            return losses(
                draft, batch, vocab_pos, tok.pad_token_id, args.reg_weight, args.alpha_weight
            )

    def evaluate():
        return validation_loss(draft, val, loss, args.batch_tokens)

    print("init: val loss {:.3f}, val alpha(top-k) {}".format(*evaluate()), flush=True)
    t0, step, total = time.time(), 0, None
    budget, done = args.train_minutes * 60, False  # seconds
    log = []
    for epoch in range(args.epochs):
        for batch in batches_of(tr, args.batch_tokens, random.Random(args.seed + epoch)):
            elapsed = time.time() - t0
            if total is None and step == 20:  # time-box: estimate the step count from the pace
                per_step = elapsed / 20
                total = int(budget / per_step)
                print(f"{per_step:.2f} s/step -> {total} steps", flush=True)
            # The pace of a shared CPU drifts (2.4 to 5 s a step within one run), so the
            # schedule follows whichever runs out first, steps or time, and the run stops
            # there with the cosine at its floor instead of overrunning its box.
            progress = max(step / (total or 10**9), elapsed / budget)
            done = total is not None and progress >= 1.0
            if done:
                break
            lr = learning_rate(args.lr, step, progress)
            for g in opt.param_groups:
                g["lr"] = lr
            ce, acc = loss(batch)
            opt.zero_grad()
            ce.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                print(
                    f"step {step} epoch {epoch} loss {ce.item():.3f} alpha {acc} "
                    f"lr {lr:.2e} {time.time() - t0:.0f}s",
                    flush=True,
                )
            if step % 400 == 0:
                vce, vacc = evaluate()
                log.append(dict(step=step, val_ce=vce, val_alpha=vacc))
                print(f"  val loss {vce:.3f} alpha(top-k) {vacc}", flush=True)
        if done:
            break
    vce, vacc = evaluate()
    log.append(dict(step=step, val_ce=vce, val_alpha=vacc))
    print(f"final: val loss {vce:.3f} alpha(top-k) {vacc}", flush=True)
    scales = calibration(draft, val, vocab_pos, tok.pad_token_id)
    print(f"calibration: {scales}", flush=True)
    meta = dict(
        steps=step, minutes=(time.time() - t0) / 60, answers=len(tr), answer_tokens=tokens,
        head_vocab=len(vocab), head_mass=covered / tokens, init_layers=layers,
        init_draft=str(args.init_draft or ""), arch=args.arch, calibration=scales,
        args={k: str(v) for k, v in vars(args).items()}, log=log,
    )  # fmt: skip
    state = {k: v.cpu() for k, v in draft.state_dict().items()}
    torch.save(dict(state=state, meta=meta), args.work / "draft.pt")


def export(args) -> None:
    """Commit only what the draft trained (layers, norm) in bf16, its config and kept vocab."""
    from safetensors.torch import save_file

    ckpt = torch.load(args.work / "draft.pt", map_location="cpu")
    state = {
        k.removeprefix("hf."): v.to(torch.bfloat16).contiguous()
        for k, v in ckpt["state"].items()
        if k.startswith("hf.model.") and "embed_tokens" not in k
    }
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.target)
    cfg.num_hidden_layers = len(ckpt["meta"]["init_layers"])
    cfg.save_pretrained(out)
    vocab = ckpt["state"]["vocab"].tolist()
    (out / "draft_vocab.json").write_text(json.dumps(vocab))
    (out / FEATURE_FC).unlink(missing_ok=True)
    if "fc.weight" in ckpt["state"]:
        fc = ckpt["state"]["fc.weight"].clone()  # [E, 2E]; the feature scale folded in
        fc[:, : fc.shape[0]] *= ckpt["state"]["feat_scale"]
        fc = fc.to(torch.bfloat16).contiguous()
        save_file({"weight": fc}, out / FEATURE_FC, metadata={"format": "pt"})
    (out / "train_meta.json").write_text(json.dumps(ckpt["meta"], indent=1))
    scale = ckpt["meta"]["calibration"]
    (out / HEAD_SCALE).write_text(json.dumps(scale, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--stage",
        choices=["generate", "features", "train", "export", "pack", "unpack", "all"],
        default="all",
    )
    ap.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/blockspec/draft-train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packed", type=Path, default=PACKED, help="pack/unpack: the answers' files")
    ap.add_argument("--seeds", help="unpack: only these seeds, e.g. 5,6,7,8 (default: every one)")
    ap.add_argument("--round", type=int, default=1, choices=[1, 2], help="generate: which round")
    ap.add_argument("--prompts", type=int, default=4000, help="round 1: prompts built")
    ap.add_argument("--gen-minutes", type=float, default=30, help="round 1: time box")
    ap.add_argument("--round2-prompts", type=int, default=600)
    ap.add_argument("--round2-minutes", type=float, default=6)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--head-vocab", type=int, default=8192)
    ap.add_argument(
        "--arch",
        choices=["layers", "features"],
        default="features",
        help="layers: a small LM on tokens alone; features: EAGLE-style, also reads the "
        "target's last hidden state (needs --stage features first)",
    )
    ap.add_argument("--reg-weight", type=float, default=0.1, help="features: regression weight")
    ap.add_argument("--init-layers", default="0,1")
    ap.add_argument(
        "--init-draft",
        type=Path,
        help="start the layers, norm (and fc) from this draft's committed tensors instead",
    )
    ap.add_argument(
        "--val-seed", type=int, help="train: draw the validation answers from this seed only"
    )
    ap.add_argument(
        "--alpha-weight",
        type=float,
        default=0.0,
        help="train: weight of the total-variation loss 1 - α beside the cross-entropy",
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--train-minutes", type=float, default=35)
    ap.add_argument(
        "--bf16", action="store_true", help="train: bf16 autocast (float32 weights and losses)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="where the target and the draft run")
    ap.add_argument("--feature-batch", type=int, default=8, help="features: sequences a forward")
    ap.add_argument(
        "--out", type=Path, default=SMOLLM2_DRAFT_WEIGHTS, help="export: the draft's directory"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.stage in ("unpack", "all"):  # a full run starts from every committed seed
        unpack(args)
    if args.stage in ("generate", "all"):
        for rnd in [args.round] if args.stage == "generate" else [1, 2]:
            generate(args, rnd)
    if args.stage == "pack":
        pack(args)
    for stage in ("features", "train", "export"):
        if stage == "features" and args.stage == "all" and args.arch != "features":
            continue
        if args.stage in (stage, "all"):
            globals()[stage](args)


if __name__ == "__main__":
    main()
