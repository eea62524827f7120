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


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """`AutoModelForCausalLM.from_pretrained` on a local directory; only Llama-family models."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        hint = (
            " (the bundled pair ships in the repository's models/, not in a wheel: run from a "
            "checkout or `pip install -e .`, or set BLOCKSPEC_REPLICA__DRAFT_DIR/__TARGET_DIR)"
            if path.parent == BUNDLED
            else ""
        )
        raise ValueError(f"model directory {path} has no config.json{hint}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    if hf.config.model_type != "llama":
        raise ValueError(
            f"{path}: model_type {hf.config.model_type!r} is not supported (llama only)"
        )
    state = {k: v.detach().to(device) for k, v in hf.state_dict().items()}
    return LoadedModel(LlamaSpec.from_hf_config(hf.config), state, str(path))


def load_pair(draft: str | Path, target: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load both models and the shared tokenizer; refuse pairs whose vocabularies differ."""
    from transformers import AutoTokenizer

    d, t = load_model(draft, dtype, device), load_model(target, dtype, device)
    tok_d = AutoTokenizer.from_pretrained(draft, local_files_only=True)
    tok_t = AutoTokenizer.from_pretrained(target, local_files_only=True)
    if d.spec.vocab_size != t.spec.vocab_size or tok_d.get_vocab() != tok_t.get_vocab():
        raise ValueError(
            f"draft {draft} and target {target} do not share a vocabulary "
            f"(sizes {d.spec.vocab_size} vs {t.spec.vocab_size}): speculative decoding needs one"
        )
    return d, t, tok_t
