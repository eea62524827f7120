"""scripts/train_draft.py's answers survive the machine that sampled them: `pack` keeps a seed's
prompts and answers (no teacher rows), `unpack` restores the shards, and `features` recomputes
the teacher's rows from its forward, equal to the ones `generate` recorded while sampling.
Run as the script runs, on the tiny target. And `train` validates only on the seed
`--val-seed` names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.models import TINY_TARGET

REPO = Path(__file__).resolve().parents[1]


def train_draft(*flags: str) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "train_draft.py"), "--target", str(TINY_TARGET)]
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


def test_validation_comes_from_the_named_seed_only():
    spec = importlib.util.spec_from_file_location("train_draft", REPO / "scripts/train_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    samples = [dict(shard=f"r1-s{seed}-{i:05d}", n=i) for i in range(10) for seed in (2, 15, 5)]

    val, tr = module.split_validation(samples, 4)  # no seed: the first n, as before
    assert val == samples[:4] and tr == samples[4:]

    val, tr = module.split_validation(samples, 4, seed=5)
    assert len(val) == 4 and all("-s5-" in s["shard"] for s in val)
    assert len(tr) == len(samples) - 4 and not any(s in tr for s in val)  # disjoint, complete
    with pytest.raises(SystemExit, match="--val-seed 1"):  # "-s1-" is not in "-s15-"
        module.split_validation(samples, 4, seed=1)
