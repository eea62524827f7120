"""Load a draft/target pair of Hugging Face causal LMs from local directories (no hub access)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from blockspec.workers.llama import Llama, LlamaSpec

BUNDLED = Path(__file__).resolve().parents[1] / "models"
# The tiny pair (5.3M / 1.2M parameters, trained on the CPython stdlib) ships in the repository
# for fast tests; its output is not meant to be read.
TINY_DRAFT, TINY_TARGET = BUNDLED / "tiny" / "draft", BUNDLED / "tiny" / "target"
# The default pair: SmolLM2-135M-Instruct and the draft the project trained for it. The target
# is converted at set-up (scripts/fetch_models.py) into a cache outside the repository; the
# draft's trained weights ship in the repository and are assembled next to it.
MODEL_CACHE = Path(os.environ.get("BLOCKSPEC_MODEL_CACHE", Path.home() / ".cache" / "blockspec"))
DEFAULT_TARGET = MODEL_CACHE / "smollm2-135m-instruct"
DEFAULT_DRAFT = MODEL_CACHE / "smollm2-135m-draft"
SMOLLM2_DRAFT_WEIGHTS = BUNDLED / "smollm2-draft"
# The same pair's token-only draft (the default before it read the target's features): for
# consumers that cannot feed a draft the target's features, e.g. HF assisted generation.
TOKEN_ONLY_DRAFT = MODEL_CACHE / "smollm2-135m-draft-token-only"
SMOLLM2_TOKEN_ONLY_WEIGHTS = BUNDLED / "smollm2-draft-token-only"
# Set-up only: a committed draft's logit scale s (models/train_draft.py: `calibration`),
# which assembly folds into an untied head: q = softmax(s z / T) sharpens an under-confident
# draft. Verification reads q as the draft sampled it, so any s stays lossless.
HEAD_SCALE = "head_scale.json"
# A model's dtype by name: its activations, caches and unquantised weights. "int8": bfloat16
# with weight-only int8 projections and head (llama.Int8Linear); "int4": bfloat16 with the
# layers' projections weight-only int4 (llama.Int4Linear). Both CPU only.
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.bfloat16,
    "int4": torch.bfloat16,
}
ROUNDED = ("int8", "int4")  # weight-only rounded dtypes: torch's CPU kernels'
# int4 is rounded from the checkpoint's own values, not from their bfloat16 rounding: a
# checkpoint on Q4_1's grid then keeps its weights (llama.Int4Linear)
_LAYER_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


@dataclass
class LoadedModel:
    spec: LlamaSpec
    state: dict[str, torch.Tensor]  # HF parameter names -> tensors (on the target device/dtype)
    path: str
    head_vocab: torch.Tensor | None = None  # [Vh] int64: a draft's reduced output head, if any
    feature_fc: torch.Tensor | None = None  # [E, 2E]: a feature draft's input projection
    rounded: str | None = None  # "int8" / "int4": weights rounded as it is built (ROUNDED)

    def to(self, device: str | torch.device) -> LoadedModel:
        """The same weights on `device`."""
        moved = {name: t.to(device) for name, t in self.state.items()}
        head, fc = (None if t is None else t.to(device) for t in (self.head_vocab, self.feature_fc))
        return replace(self, state=moved, head_vocab=head, feature_fc=fc)

    def build(self, rank: int = 0, world: int = 1, group=None, packed: bool | None = None) -> Llama:
        """This rank's forward pass; ``packed``: see ``Llama`` (None: llama.packs_weights)."""
        return Llama(
            self.spec, self.state, rank, world, group,
            head_vocab=self.head_vocab, feature_fc=self.feature_fc, packed=packed,
            rounded=self.rounded,
        )  # fmt: skip


def _model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").exists():
        hint = ""
        if path.parent == MODEL_CACHE:
            hint = (
                " (the default pair is converted and assembled there by scripts/setup.sh; or "
                "serve your own pair: --draft/--target, BLOCKSPEC_REPLICA__DRAFT_DIR/__TARGET_DIR)"
            )
        elif path.parent.parent == BUNDLED:
            hint = (
                " (the tiny pair ships in the repository's models/, not in a wheel: run from a "
                "checkout or `pip install -e .`)"
            )
        raise ValueError(f"model directory {path} has no config.json{hint}")
    return path


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DRAFT_VOCAB = "draft_vocab.json"  # optional: a draft's reduced head (sorted unique token ids)
# Optional: a feature draft (EAGLE) reads the target's features through this projection,
# `weight` [E, 2E] ([feature; embedding] -> E). Transformers has no such model class, so the
# layers load as a Llama checkpoint and the projection from its own file.
FEATURE_FC = "feature_fc.safetensors"


def _read_draft_vocab(file: Path, vocab_size: int) -> torch.Tensor:
    ids = json.loads(file.read_text())
    ok = isinstance(ids, list) and ids and all(type(i) is int for i in ids)
    if not ok or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(
            f"{file}: expected a non-empty sorted list of unique token ids in [0, {vocab_size})"
        )
    return torch.tensor(ids, dtype=torch.int64)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """`AutoModelForCausalLM.from_pretrained` on a local directory; only the families that
    `LlamaSpec.from_hf_config` accepts (refused from the config, before reading weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _model_dir(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype in ROUNDED and torch.device(device).type != "cpu":
        raise ValueError(f"dtype {dtype} runs on a CPU only (torch's weight-only {dtype} kernel)")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        spec = LlamaSpec.from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if not any((path / name).exists() for name in WEIGHT_FILES):
        raise ValueError(f"model directory {path} has no weights ({WEIGHT_FILES[0]})")
    wide = torch.float32 if dtype == "int4" else DTYPES[dtype]
    hf = AutoModelForCausalLM.from_pretrained(path, config=cfg, local_files_only=True, dtype=wide)
    state = {
        k: v.detach().to(device, wide if _LAYER_PROJECTION.fullmatch(k) else DTYPES[dtype])
        for k, v in hf.state_dict().items()
    }
    head_vocab = None
    if (path / DRAFT_VOCAB).exists():
        head_vocab = _read_draft_vocab(path / DRAFT_VOCAB, spec.vocab_size).to(device)
    feature_fc = None
    if (path / FEATURE_FC).exists():
        from safetensors.torch import load_file

        feature_fc = load_file(path / FEATURE_FC).get("weight")
        E = spec.hidden_size
        if feature_fc is None or tuple(feature_fc.shape) != (E, 2 * E):
            raise ValueError(
                f"{path / FEATURE_FC}: expected a tensor 'weight' of shape [{E}, {2 * E}]"
            )
        feature_fc = feature_fc.to(device=device, dtype=DTYPES[dtype])
    rounded = dtype if dtype in ROUNDED else None
    return LoadedModel(spec, state, str(path), head_vocab, feature_fc, rounded=rounded)


def render_chat(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Token ids of chat `turns` ({"role", "content"} each) in the tokenizer's chat template,
    ending with the assistant's generation prompt. (transformers 5 returns a BatchEncoding.)"""
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def check_pair(draft: str | Path, target: str | Path):
    """From the configs and tokenizers alone (no weights): refuse a pair whose vocabularies
    differ. Returns (target tokenizer, vocab size, the shorter of the two trained contexts)."""
    from transformers import AutoConfig, AutoTokenizer

    draft, target = _model_dir(draft), _model_dir(target)
    cfg_d, cfg_t = (AutoConfig.from_pretrained(p, local_files_only=True) for p in (draft, target))
    tok_d = AutoTokenizer.from_pretrained(draft, local_files_only=True)
    tok_t = AutoTokenizer.from_pretrained(target, local_files_only=True)
    if cfg_d.vocab_size != cfg_t.vocab_size or tok_d.get_vocab() != tok_t.get_vocab():
        raise ValueError(
            f"draft {draft} and target {target} do not share a vocabulary "
            f"(sizes {cfg_d.vocab_size} vs {cfg_t.vocab_size}): speculative decoding needs one"
        )
    if (draft / FEATURE_FC).exists() and cfg_d.hidden_size != cfg_t.hidden_size:
        raise ValueError(
            f"feature draft {draft} reads target features of its own width "
            f"({cfg_d.hidden_size}), but target {target} has hidden_size {cfg_t.hidden_size}"
        )
    context = min(cfg_d.max_position_embeddings, cfg_t.max_position_embeddings)
    return tok_t, cfg_t.vocab_size, context


def load_pair(draft: str | Path, target: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load both models and the shared tokenizer; refuse pairs whose vocabularies differ."""
    tokenizer, _, _ = check_pair(draft, target)
    return load_model(draft, dtype, device), load_model(target, dtype, device), tokenizer
