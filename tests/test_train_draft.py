"""models/train_draft.py's answers survive the machine that sampled them: `pack` keeps a seed's
prompts and answers (no teacher rows), `unpack` restores the shards (of every seed, or of the
seeds `--seeds` names), and `features` recomputes the teacher's rows from its forward, equal to
the ones `generate` recorded while sampling. Run as its command runs, on the tiny target. And
`train` validates only on the seed `--val-seed` names, and `--alpha-weight` adds the
total-variation loss that raises α."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.workers.models import TINY_TARGET

REPO = Path(__file__).resolve().parents[1]


def train_draft(*flags: str) -> None:
    cmd = [sys.executable, "-m", "blockspec.models.train_draft", "--target", str(TINY_TARGET)]
    subprocess.run([*cmd, "--threads", "1", *flags], check=True, capture_output=True, cwd=REPO)


def test_packed_answers_unpack_to_the_sampled_ones_and_their_teacher_rows(tmp_path):
    sampled, restored, packed = tmp_path / "sampled", tmp_path / "restored", tmp_path / "packed"
    common = ("--seed", "5", "--packed", str(packed))
    train_draft("--stage", "generate", "--work", str(sampled), "--prompts", "12", "--max-new",
                "12", "--batch", "4", *common)  # fmt: skip
    train_draft("--stage", "pack", "--work", str(sampled), *common)
    assert [f.name for f in packed.iterdir()] == ["s5.jsonl.xz"]
    train_draft("--stage", "unpack", "--work", str(restored), *common)
    shards = sorted(f.name for f in (sampled / "answers").iterdir())
    assert len(shards) >= 2 and shards == sorted(f.name for f in (restored / "answers").iterdir())
    assert "logp" not in torch.load(restored / "answers" / shards[0])[0]

    train_draft("--stage", "features", "--work", str(restored), *common)
    agree, gaps = [], []
    for name in shards:
        before = torch.load(sampled / "answers" / name)
        after = torch.load(restored / "answers" / name)
        assert len(before) == len(after)
        for s, t in zip(before, after, strict=True):
            assert (s["kind"], s["turns"], s["prompt_round"]) == (
                t["kind"],
                t["turns"],
                t["prompt_round"],
            )
            assert torch.equal(s["prompt"], t["prompt"]) and torch.equal(s["answer"], t["answer"])
            # The teacher's rows: the sampler's incremental bf16 pass and the teacher-forced
            # one agree up to bf16 rounding (rows one position off would not agree at all).
            assert t["logp"].shape == s["logp"].shape and t["index"].dtype == s["index"].dtype
            agree.append((s["index"][:, 0] == t["index"][:, 0]).float())
            gaps.append((s["logp"][:, 0].float() - t["logp"][:, 0].float()).abs())
        assert len(torch.load(restored / "features" / name)) == len(after)
    agree, gaps = torch.cat(agree), torch.cat(gaps)
    assert len(agree) >= 40 and agree.mean() >= 0.9, agree.mean()
    assert gaps.median() < 0.05, gaps.median()


def load_module():
    from blockspec.models import train_draft

    return train_draft


def test_validation_comes_from_the_named_seed_only():
    module = load_module()
    samples = [dict(shard=f"r1-s{seed}-{i:05d}", n=i) for i in range(10) for seed in (2, 15, 5)]

    val, tr = module.split_validation(samples, 4)  # no seed: the first n, as before
    assert val == samples[:4] and tr == samples[4:]

    val, tr = module.split_validation(samples, 4, seed=5)
    assert len(val) == 4 and all("-s5-" in s["shard"] for s in val)
    assert len(tr) == len(samples) - 4 and not any(s in tr for s in val)  # disjoint, complete
    with pytest.raises(SystemExit, match="--val-seed 1"):  # "-s1-" is not in "-s15-"
        module.split_validation(samples, 4, seed=1)


def test_alpha_weight_adds_the_total_variation_and_raises_alpha():
    from transformers import AutoModelForCausalLM

    module = load_module()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    V, E = target.config.vocab_size, target.config.hidden_size
    kept = torch.arange(0, V, 2)  # a kept head of half the vocabulary: q = 0 on the rest
    vocab_pos = torch.full((V,), -1)
    vocab_pos[kept] = torch.arange(len(kept))
    draft = module.FeatureDraft(target, [0], kept, torch.ones(E))
    P, G = 6, 24
    teacher = (torch.randn(G, V) * 3).log_softmax(-1).topk(module.TOPK)  # [G, TOPK]
    sample = dict(
        prompt=torch.randint(1, V, (P,)),
        answer=torch.randint(1, V, (G,)),
        feat=torch.randn(P + G, E),  # [T, E]
        logp=teacher.values,
        index=teacher.indices,
    )

    def loss(weight):
        return module.losses(draft, [sample], vocab_pos, 0, 0.1, alpha_weight=weight)

    plain, alpha = loss(0.0)
    with_tv, again = loss(3.0)
    assert alpha == again and 0 < alpha[0] < 1
    assert torch.allclose(with_tv - plain, torch.tensor(3.0 * (2 - sum(alpha))), atol=1e-5)

    # The term's gradient reaches the draft: 10 steps on it (the weight drowns the
    # cross-entropy) raise α well beyond 10 steps on the cross-entropy alone from the same
    # start (0.0014 -> 0.014 against 0.0048 here; a detached term would give the latter).
    start = {k: v.clone() for k, v in draft.state_dict().items()}

    def alpha_after_descent(weight):
        draft.load_state_dict(start)
        opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(10):
            opt.zero_grad()
            loss(weight)[0].backward()
            opt.step()
        return loss(0.0)[1][0]

    cross_entropy_only, with_tv = alpha_after_descent(0.0), alpha_after_descent(1e3)
    assert with_tv > 2 * cross_entropy_only > 2 * alpha[0], (alpha, cross_entropy_only, with_tv)


def test_unpack_seeds_restores_only_the_named_seeds(tmp_path):
    import argparse
    import json
    import lzma

    module = load_module()
    packed, work = tmp_path / "packed", tmp_path / "work"
    packed.mkdir()
    for seed in (4, 5, 15):
        row = dict(kind="code", round=1, turns=[], prompt=[1, 2], answer=[3, seed])
        with lzma.open(packed / f"s{seed}.jsonl.xz", "wt") as f:
            f.write(json.dumps(dict(shard=f"r1-s{seed}-00000", **row)) + "\n")

    def unpack(seeds):
        module.unpack(argparse.Namespace(packed=packed, work=work, seeds=seeds))
        return sorted(f.name for f in (work / "answers").iterdir())

    assert unpack("5,15") == ["r1-s15-00000.pt", "r1-s5-00000.pt"]
    assert torch.load(work / "answers" / "r1-s5-00000.pt")[0]["answer"].tolist() == [3, 5]
    with pytest.raises(SystemExit, match=r"\['s6\.jsonl\.xz'\]"):
        unpack("4,6")
    assert unpack(None) == ["r1-s15-00000.pt", "r1-s4-00000.pt", "r1-s5-00000.pt"]
