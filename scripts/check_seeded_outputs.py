"""Check that a refactor left every verifier's seeded outputs bit-identical.

    python scripts/check_seeded_outputs.py --against REV   # this tree vs commit REV
    python scripts/check_seeded_outputs.py --record FILE   # only record this tree's outputs

The check records the same seeded runs in a clean worktree of REV and in this tree, each in its
own process, and compares every token. On one machine the outputs of a seeded run are a pure
function of the code, so any difference is a behaviour change; across machines float rounding
may differ (another CPU's vector width), which is why the check compares two trees on this
machine instead of a committed file.

The runs cover every code path a CPU reaches, for every method:
- the verifier library in a decode loop over conditional tables (tests/harness.py): float32 on
  the CPU (the numba kernels), float64 on the CPU (the torch ops with host reads), float32 on
  the fake accelerator (tests/fake_device.py: the fixed-shape torch ops), on a narrow vocabulary
  and on a wide one whose draft keeps a third of the ids (the support-restricted ranking);
- the engine on the tiny token pair (models/tiny) at T = 1 and T = 0.7 / top-p 0.9, on the CPU
  and on the fake accelerator, and on a feature draft (random tiny models with a feature fc);
- the default pair, a few tokens per method, where it is installed (skipped otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _verify():
    # The library's home moved out of service/; ask the tree being recorded where it lives (an
    # installed package of the other layout may be importable too).
    if (ROOT / "verification").is_dir():
        from blockspec.verification import METHODS, VERIFIERS, verify
    else:
        from blockspec.service.verification import METHODS, VERIFIERS, verify  # older trees
    return METHODS, VERIFIERS, verify


def verifier_runs() -> dict[str, list]:
    import harness
    import numpy as np
    import torch
    from fake_device import FakeCuda

    METHODS, VERIFIERS, verify = _verify()

    def on_fake_device(verify, method):  # the loop's tables stay on the CPU, as in the engine
        def step(x, q, p, gen, carry):
            dev = torch.device("cuda", 0)
            out = verify(method, x.to(dev), q.to(dev), p.to(dev), generator=gen, carry=carry)
            fields = [f.name for f in dataclasses.fields(out) if f.name != "carry"]
            return dataclasses.replace(out, **{f: getattr(out, f).cpu() for f in fields})

        return step

    narrow = (
        harness.WindowModel.from_fn(5, 2, harness.random_rows(5, 1, 2.0)),
        harness.WindowModel.from_fn(5, 2, harness.random_rows(5, 2, 1.5)),
    )

    def support_rows(prefix):  # q = 0 outside a third of the ids
        row = np.array(harness.random_rows(300, 4, 2.0)(prefix))
        row[np.arange(300) % 3 != 0] = 0
        return list(row / row.sum())

    wide = (
        harness.WindowModel.from_fn(300, 1, harness.random_rows(300, 3, 2.0)),
        harness.WindowModel.from_fn(300, 1, support_rows),
    )
    out = {}
    for method in METHODS:
        k = 1 if VERIFIERS[method].single_path else 3
        for name, (target, draft), gamma in (("narrow", narrow, 3), ("wide", wide, 4)):
            for backend, dtype in (("f32", torch.float32), ("f64", torch.float64)):
                seq = harness.decode_loop(
                    harness.method_step(method), target, draft, 200, k, gamma, 8, 7, dtype
                )
                out[f"verify/{method}/{name}/{backend}"] = seq.tolist()
            with FakeCuda():
                seq = harness.decode_loop(
                    on_fake_device(verify, method), target, draft, 200, k, gamma, 8, 7
                )
            out[f"verify/{method}/{name}/device"] = seq.tolist()
    return out


def engine_runs() -> dict[str, list]:
    from fake_device import FakeCuda
    from test_engine import make_engine, tiny_pair
    from test_feature_draft import random_fc

    from blockspec.service.build import build_engine
    from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET
    from blockspec.workers.sampling import SamplingParams

    METHODS, VERIFIERS, _ = _verify()

    def request(engine, prompt: list[int], new: int, method: str, k: int, sampling, seed: int):
        try:  # requests are built by the validator (service/requests.py) since it exists
            from blockspec.service.requests import make_request
        except ImportError:  # older trees: the engine checked the request itself
            from blockspec.service.engine import GenerationRequest

            return GenerationRequest(prompt, new, method, k, 3, sampling, seed=seed)
        return make_request(engine.limits, prompt, new, method, k, 3, sampling, seed=seed)

    def requests(engine, method: str, n: int, new: int, prompt_len: int) -> list:
        k = 1 if VERIFIERS[method].single_path else 2
        sampling = (SamplingParams(), SamplingParams(0.7, 0, 0.9))
        return [
            request(
                engine,
                [(7 * i + j) % 40 + 1 for j in range(prompt_len)],
                new,
                method,
                k,
                sampling[i % 2],
                seed=100 + i,
            )
            for i in range(n)
        ]

    def tokens(engine, reqs) -> list:
        return [r.token_ids for r in engine.generate(reqs)]

    out = {}
    tiny = dict(max_batch=8, max_len=64)
    cpu, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), packed=False, **tiny)
    with FakeCuda():
        fake, _ = build_engine(
            str(TINY_DRAFT), str(TINY_TARGET), device="cuda", packed=False, **tiny
        )
    _, target, draft = tiny_pair(vocab=48, draft_fc=random_fc(64, scale=0.1))
    featured = make_engine(target, draft, 8, 64)
    for method in METHODS:
        out[f"engine/tiny/{method}"] = tokens(cpu, requests(cpu, method, 12, 12, 5))
        with FakeCuda():
            out[f"engine/tiny-device/{method}"] = tokens(fake, requests(fake, method, 12, 12, 5))
        out[f"engine/feature/{method}"] = tokens(featured, requests(featured, method, 12, 12, 5))
    if Path(DEFAULT_TARGET).is_dir() and Path(DEFAULT_DRAFT).is_dir():
        default, _ = build_engine(str(DEFAULT_DRAFT), str(DEFAULT_TARGET), max_batch=4, max_len=64)
        for method in METHODS:
            out[f"engine/default/{method}"] = tokens(default, requests(default, method, 2, 6, 6))
    return out


def record(path: Path) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    os.chdir(ROOT)
    runs = verifier_runs()
    runs.update(engine_runs())
    path.write_text(json.dumps(runs))


def record_in(tree: Path, path: Path) -> None:
    """Run this script's recorder on the code of `tree`, in a fresh process (this script's:
    an older tree's own copy may not know the layout of a newer one)."""
    from blockspec.loadtest.bench.harness import package_view

    text = Path(__file__).read_text().replace("parents[1]", "parents[0]")
    paths = [str(tree)]
    if '"blockspec.service"' in (tree / "pyproject.toml").read_text():
        paths.insert(0, str(package_view(tree)))
    else:  # a tree from before its folders installed as blockspec.*: its modules import each
        # other by the folders' names, so the recorder does too (one copy of each module)
        text = text.replace("from blockspec.", "from ")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    script = tree / "_check_seeded_outputs.py"
    script.write_text(text)
    try:
        subprocess.run([sys.executable, str(script), "--record", str(path)], env=env, check=True)
    finally:
        script.unlink()


def compare(before: dict, after: dict) -> list[str]:
    problems = [f"{case}: missing after" for case in before if case not in after]
    problems += [f"{case}: new case" for case in after if case not in before]
    for case in sorted(set(before) & set(after)):
        if before[case] != after[case]:
            rows = sum(a != b for a, b in zip(before[case], after[case], strict=False))
            problems.append(f"{case}: {rows} of {len(before[case])} sequences differ")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--against", metavar="REV", help="compare this tree with commit REV")
    group.add_argument("--record", metavar="FILE", type=Path, help="record this tree's outputs")
    args = parser.parse_args()
    if args.record:
        record(args.record)
        return 0
    from blockspec.loadtest.bench.harness import worktree

    with tempfile.TemporaryDirectory() as tmp, worktree(args.against) as base:
        record_in(base, Path(tmp) / "before.json")
        record_in(ROOT, Path(tmp) / "after.json")
        before = json.loads((Path(tmp) / "before.json").read_text())
        after = json.loads((Path(tmp) / "after.json").read_text())
    problems = compare(before, after)
    for line in problems:
        print(line)
    print(f"{len(before)} seeded runs at {args.against}: ", end="")
    print("bit-identical" if not problems else f"{len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
