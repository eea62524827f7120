"""Load a draft/target pair of Hugging Face causal LMs from local directories (no hub access)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from workers.llama import Llama, LlamaSpec

BUNDLED = Path(__file__).resolve().parents[1] / "models"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    spec: LlamaSpec
    state: dict[str, torch.Tensor]  # HF parameter names -> tensors (on the target device/dtype)
    path: str

    def build(self, rank: int = 0, world: int = 1, group=None) -> Llama:
        return Llama(self.spec, self.state, rank, world, group)


def _model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").exists():
        hint = (
            " (the bundled pair ships in the repository's models/, not in a wheel: run from a "
            "checkout or `pip install -e .`, or set BLOCKSPEC_REPLICA__DRAFT_DIR/__TARGET_DIR)"
            if path.parent == BUNDLED
            else ""
        )
        raise ValueError(f"model directory {path} has no config.json{hint}")
    return path


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """`AutoModelForCausalLM.from_pretrained` on a local directory; only Llama-family models."""
    from transformers import AutoModelForCausalLM

    path = _model_dir(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    if hf.config.model_type != "llama":
        raise ValueError(
            f"{path}: model_type {hf.config.model_type!r} is not supported (llama only)"
        )
    state = {k: v.detach().to(device) for k, v in hf.state_dict().items()}
    return LoadedModel(LlamaSpec.from_hf_config(hf.config), state, str(path))


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
    context = min(cfg_d.max_position_embeddings, cfg_t.max_position_embeddings)
    return tok_t, cfg_t.vocab_size, context


def load_pair(draft: str | Path, target: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load both models and the shared tokenizer; refuse pairs whose vocabularies differ."""
    tokenizer, _, _ = check_pair(draft, target)
    return load_model(draft, dtype, device), load_model(target, dtype, device), tokenizer
