"""A Llama forward pass readable in one sitting, fed with a Hugging Face checkpoint's weights.

Why not call the HF module directly: speculative decoding needs three things HF's cache API does
not give cheaply: attention of many rows (K draft paths, or a draft tree) against one shared
per-request prefix cache without copying it, tree attention masks over ragged batches, and
committing an arbitrary subset of new KV entries (the accepted path). This module does exactly
that and nothing more; weights come from ``AutoModelForCausalLM.from_pretrained`` (see
``workers/models.py``) and tests pin its logits to the HF model's.

The model reads top-down as nanoGPT's: ``Llama`` embeds the tokens, runs its
``DecoderLayer``s (``RMSNorm``, ``Attention``, residual; ``RMSNorm``, ``MLP``, residual), a
final ``RMSNorm`` and the head. ``CheckpointShard`` slices the checkpoint as each module is
built. The attention proper is one function, ``tree_attention``: new tokens attend to two parts,
softmaxed jointly:
- *prefix*: the request's committed cache, shared by all of the request's rows (read in place:
  no copy per row; with one row, in a 16-bit dtype, copied once beside the new keys);
- the new tokens of each row (a draft path, or a flattened tree), after the row's earlier
  draft-path tokens if any (the forward's `suffix`), with an explicit boolean mask saying
  which new token sees which.

Tensor parallelism (Megatron style) shards heads and the MLP's inner dimension over the ranks
of a ``torch.distributed`` group: q/k/v and gate/up are column-parallel, o and down are
row-parallel followed by an all-reduce. With one rank the group is None.

Families (``LlamaSpec.from_hf_config`` refuses anything else, naming the field): Llama with
default, linear or Llama 3.x RoPE and optional attention/MLP biases; Mistral (when its sliding
window covers the whole context); Qwen2/2.5 (biased q/k/v); Qwen3 (RMSNorm on each q/k head).
A draft may keep only part of the vocabulary in its output head (``head_vocab``): the head's
matmul shrinks to the kept rows, and the ids it drops get logit -inf (probability exactly 0).
A *feature draft* (EAGLE, ``feature_fc``) reads at each position fc([feature; embedding]),
where the feature is the target's final-norm hidden state one position back (the forward
returns those hidden states for every new token).

Every projection is a ``Linear``: on a CPU in float32 a weight of 1 MiB or more is packed once
at load for oneDNN, which runs the few-row products of decoding and of a tree pass much closer
to the memory bandwidth they are bound by than F.linear's MKL GEMM (see ``Linear``). With
``int8`` (``--dtype int8``) every projection and the head is an ``Int8Linear`` instead; with
``int4`` (``--dtype int4``) every decoder layer's projection is an ``Int4Linear``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {  # what each rope_type reads from rope_parameters besides rope_theta
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    # RoPE frequency scaling (see inv_freq): "default" none; "linear" all frequencies / factor;
    # "llama3" only the long wavelengths / factor (Llama 3.1+; also reads the rope_*_freq_factor
    # and rope_original_max_positions fields, unused otherwise).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (head_dim features), pre-RoPE

    @staticmethod
    def from_hf_config(cfg) -> LlamaSpec:
        """The one place that reads a Hugging Face config: raises ValueError naming any field
        whose value this forward pass would not reproduce exactly."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: expected one of {MODEL_TYPES}"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (a SwiGLU MLP)")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}: expected one of {ROPE_TYPES}")
        missing = [key for key in _ROPE_KEYS[rope_type] if key not in rope]
        if missing:
            raise ValueError(f"rope_parameters of rope_type {rope_type!r} lack {missing}")
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {partial!r}: only 1.0")
        _refuse_sliding_window(cfg)
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        heads = cfg.num_attention_heads
        return LlamaSpec(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=cfg.num_key_value_heads or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_positions=cfg.max_position_embeddings,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(rope.get("original_max_position_embeddings", 8192)),
            qk_norm=model_type == "qwen3",
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [D/2] float32 on the CPU, computed as
        transformers.modeling_rope_utils does (same operations, same order, same device: the
        same bits as HF's buffer)."""
        d = self.head_dim
        steps = torch.arange(0, d, 2, dtype=torch.int64).float()
        inv = 1.0 / (self.rope_theta ** (steps / d))
        if self.rope_type == "linear":  # positions / factor, folded into the frequencies
            return inv / self.rope_factor
        if self.rope_type != "llama3":
            return inv
        # Llama 3.1: wavelengths longer than the pre-training context / low_freq_factor are
        # stretched by `factor`, those shorter than context / high_freq_factor are kept, and the
        # band between is interpolated linearly in context / wavelength.
        factor, low, high = self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor
        context = self.rope_original_max_positions
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > context / low, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) & ~(wavelen > context / low)
        return torch.where(medium, smoothed, scaled)

    def check_divisible(self, world: int) -> None:
        """Raise ValueError unless `world` ranks can share heads, kv heads and the MLP evenly
        (tensor parallelism: see ``CheckpointShard``)."""
        if world < 1:
            raise ValueError(f"tensor parallelism needs at least 1 rank, got {world}")
        sizes = {
            "attention heads": self.num_heads,
            "kv heads": self.num_kv_heads,
            "intermediate size": self.intermediate_size,
        }
        bad = [f"{name} ({size})" for name, size in sizes.items() if size % world]
        if bad:
            raise ValueError(
                f"cannot split the model over {world} ranks: {', '.join(bad)} not divisible by "
                f"{world}"
            )


def _refuse_sliding_window(cfg) -> None:
    """Sliding-window attention is not implemented. HF lets a query at position p see keys
    > p - window, so a window of at least max_position_embeddings never masks anything and is
    accepted. A smaller one is refused rather than capping max_positions at the window (exact
    too, but replicas take their context from the config's max_position_embeddings)."""
    window, context = getattr(cfg, "sliding_window", None), cfg.max_position_embeddings
    if cfg.model_type == "mistral":  # Mistral windows every layer whenever sliding_window is set
        if window is not None and window < context:
            raise ValueError(
                f"unsupported sliding_window {window} < max_position_embeddings {context}: "
                "sliding-window attention is not implemented"
            )
        return
    # Qwen2/3: the layers marked "sliding_attention" (use_sliding_window, from max_window_layers).
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(layer_types)}")
    if "sliding_attention" in layer_types and window is not None and window < context:
        raise ValueError(
            f"unsupported use_sliding_window=True with sliding_window {window} < "
            f"max_position_embeddings {context}: sliding-window attention is not implemented"
        )


class KVCache:
    """Committed keys/values of up to `max_batch` requests (slots), `max_len` positions each.

    k, v: [L, max_batch, H_kv, max_len, D]; lengths: [max_batch] int64 (committed positions).
    A forward works on a contiguous slot range: active requests stay compacted in [0, n).

    Off the CPU the cache also keeps the lengths on the host while it knows them there: a
    forward's prefix length and the overflow check then read no device memory (each read is a
    wait for the device). Appends whose counts arrive on the host keep them known; counts that
    arrive on the device make the next read refresh them, one wait. Off the CPU, change the
    lengths through these methods only (`append`, `move`, `truncate`).
    """

    def __init__(self, spec: LlamaSpec, kv_heads: int, max_batch: int, max_len: int, dtype, device):
        shape = (spec.num_layers, max_batch, kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._host_lengths: list[int] | None = [0] * max_batch  # None: refresh from lengths

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def on_cpu(self) -> bool:
        """Reading the lengths is free (the host mirror is not used)."""
        return self.lengths.device.type == "cpu"

    def host_lengths(self) -> list[int]:
        """The committed lengths on the host (off the CPU: one wait when they are stale)."""
        if self.on_cpu:
            return self.lengths.tolist()
        if self._host_lengths is None:
            self._host_lengths = self.lengths.tolist()
            if max(self._host_lengths, default=0) > self.max_len:  # an append counted there
                raise ValueError(f"KV cache full: a request exceeds max_len={self.max_len}")
        return self._host_lengths

    def prefix_length(self, slot0: int, n: int) -> int:
        """The longest committed length of slots [slot0, slot0 + n) (0 when n = 0)."""
        if not n:
            return 0
        if self.on_cpu:
            return int(self.lengths[slot0 : slot0 + n].max())
        return max(self.host_lengths()[slot0 : slot0 + n])

    def truncate(self, slot0: int, keep: list[int]) -> None:
        """Slot slot0 + i keeps its first keep[i] committed entries (no more than it holds)."""
        n = len(keep)
        kept = torch.tensor(keep, dtype=torch.int64).to(self.lengths.device, non_blocking=True)
        if self.on_cpu:
            over = bool((kept > self.lengths[slot0 : slot0 + n]).any())
        else:
            over = any(k > held for k, held in zip(keep, self.host_lengths()[slot0:], strict=False))
        if over:
            raise ValueError("prefill: cannot keep more tokens than a slot holds")
        self.lengths[slot0 : slot0 + n] = kept
        if self._host_lengths is not None:
            self._host_lengths[slot0 : slot0 + n] = keep

    def append(
        self,
        new_k: torch.Tensor,  # [L, n, H_kv, T, D]
        new_v: torch.Tensor,  # [L, n, H_kv, T, D]
        index: torch.Tensor | None,  # [n, C] int64 into T; None: the T entries in order
        count: torch.Tensor,  # [n] int64 <= C
        slot0: int = 0,
    ) -> None:
        """Slot slot0 + b appends new entries index[b, :count[b]] after its committed ones.
        `count` may arrive on the host (off the CPU, the host lengths then stay known)."""
        n, c = (new_k.shape[1], new_k.shape[3]) if index is None else index.shape
        if c == 0:
            return
        lengths = self.lengths[slot0 : slot0 + n]
        host = None if self.on_cpu or count.device.type != "cpu" else count.tolist()
        last = self.max_len - 1  # entries past count land beyond the new length: never read
        if host is not None:  # no wait: the lengths before, and the counts, are on the host
            held = self.host_lengths()[slot0 : slot0 + n]
            full = any(m > 0 and held[b] + min(m, c) > self.max_len for b, m in enumerate(host))
            # positions, counts and slots made here and copied at once: on a GPU each op that
            # would make them there is a launch
            rows = [
                [*(min(h + j, last) for j in range(c)), m, slot0 + b]
                for b, (h, m) in enumerate(zip(held, host, strict=True))
            ]
            made = torch.tensor(rows).to(lengths.device, non_blocking=True)  # [n, C + 2]
            pos, count, slots = made[:, :c], made[:, c], made[:, c + 1 :]
        else:  # on the CPU, or counted on the device (then checked when the lengths are next
            # read, host_lengths)
            count = count.to(lengths.device, non_blocking=True)
            steps = torch.arange(c, device=lengths.device)
            pos = lengths[:, None] + steps  # [n, C]
            full = False
            if self.on_cpu:
                valid = steps[None, :] < count[:, None]  # [n, C]
                full = bool((valid & (pos >= self.max_len)).any())
            pos = pos.clamp_max(last)
            slots = torch.arange(slot0, slot0 + n, device=lengths.device)[:, None]
        if full:
            raise ValueError(f"KV cache full: a request exceeds max_len={self.max_len}")
        layers, _, heads, _, dim = new_k.shape
        for cache, new in ((self.k, new_k), (self.v, new_v)):
            if index is not None:  # (in order, the entries are read where they are)
                new = new.gather(3, index[None, :, None, :, None].expand(layers, n, heads, c, dim))
            cache[:, slots, :, pos, :] = new.permute(1, 3, 0, 2, 4)  # [n, C, L, H, D]
        lengths += count
        if host is None:
            self._host_lengths = None
        elif self._host_lengths is not None:
            for b, m in enumerate(host):
                self._host_lengths[slot0 + b] += m

    def copy_slots(self, src: KVCache, rows: list[int], slots: list[int]) -> None:
        """Slot slots[i] takes a copy of src's slot rows[i] (its committed entries; src may be
        this cache): how the speculation cache forks a request's draft state and adopts one
        (workers/draft.py)."""
        held = src.host_lengths()
        lengths = [held[r] for r in rows]
        longest = max(lengths, default=0)
        if longest > self.max_len:
            raise ValueError(f"KV cache full: a request exceeds max_len={self.max_len}")
        dev = self.k.device
        index = torch.tensor(rows).to(src.k.device, non_blocking=True)
        into = torch.tensor(slots).to(dev, non_blocking=True)
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            mine[:, into, :, :longest] = theirs[:, index, :, :longest].to(dev)
        self.lengths[into] = src.lengths[index].to(dev)
        if self._host_lengths is not None:
            for slot, length in zip(slots, lengths, strict=True):
                self._host_lengths[slot] = length

    def move(self, src: int, dst: int) -> None:
        """Copy slot src into slot dst (compaction when a request leaves)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.lengths[dst] = self.lengths[src]
        if self._host_lengths is not None:
            self._host_lengths[dst] = self._host_lengths[src]


# ------------------------------------------------------------------------------ building blocks
def fused_kernels(device: torch.device) -> bool:
    """Whether forwards on `device` run RMSNorm and attention as fused kernels (F.rms_norm,
    scaled_dot_product_attention): on a GPU a decode step is bound by kernel launches; on a
    CPU the composed ops read the prefix in place (tree_attention) and are measured faster."""
    return device.type == "cuda"


def joins_keys(dtype: torch.dtype) -> bool:
    """Whether a forward in `dtype` with one row a request joins the prefix's keys to the new
    ones before attending (tree_attention): where a product would copy the strided prefix
    anyway (oneDNN's 16-bit products take contiguous operands; MKL's float32 ones read it in
    place, and there the copy costs more than the products it saves at large batches)."""
    return dtype != torch.float32


def rope_tables(
    inv_freq: torch.Tensor,  # [D/2] float32
    positions: torch.Tensor,  # [...] int64
    dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [..., D] in dtype
    """RoPE's cos/sin at every position, once a forward: every layer rotates by the same."""
    ang = positions.float()[..., None] * inv_freq  # [..., D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(
    x: torch.Tensor,  # [..., D]
    cos: torch.Tensor,  # [..., D], broadcast against x
    sin: torch.Tensor,  # [..., D]
) -> torch.Tensor:
    """x rotated by its position, in HF's layout (the two halves of D are the pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """x / rms(x) · weight over the last dimension, the statistics in float32 as HF's."""

    def __init__(self, weight: torch.Tensor, eps: float):  # weight [X]
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., X]
        xf = x.float()
        if fused_kernels(x.device):  # one kernel (aten._fused_rms_norm) where these launch five
            normed = F.rms_norm(xf, xf.shape[-1:], eps=self.eps)
        else:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class Linear(nn.Module):
    """y = x @ weight.T + bias over the last dimension; weight [out, in], bias [out] or None.

    Why not ``nn.Linear``: with ``packed`` the weight is reordered once into oneDNN's blocked
    layout (``mkldnn._reorder_linear_weight``, the pre-packing torch.compile's CPU backend does)
    and multiplied by oneDNN. In float32 on a CPU without AMX, MKL's GEMM behind F.linear runs a
    2-9-row product well above the cost of one row although both read the same weights
    once; oneDNN on the packed weight stays near the one-row cost (docs/benchmarks.md, "Packed
    weights"). The packed tensor replaces the dense one: no extra memory. The products differ
    from F.linear's in the last bits only (another summation order).

    The weights are buffers, not parameters: inference only, and fused/sharded at load, so
    they are no checkpoint either (non-persistent: ``state_dict`` leaves them out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed=False):
        super().__init__()
        self.packed = packed
        if packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def shape(self) -> torch.Size:  # [out, in]; a packed tensor keeps its logical shape
        return self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class _WeightOnly(nn.Module):
    """What the weight-only rounded layers share: their kernels take rows [m, in + pad] whose
    padding meets zero weights, and return [m, out]; the bias is added after."""

    packed = True  # (DraftProposer.use_compiled: nothing to pack again)
    pad: int  # zero input features the kernel reads past `in`
    bias: torch.Tensor | None  # [out]

    def _multiply(self, rows: torch.Tensor) -> torch.Tensor:  # [m, in + pad] -> [m, out]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])
        rows = F.pad(rows, (0, self.pad)) if self.pad else rows.contiguous()  # read densely
        y = self._multiply(rows)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


class Int8Linear(_WeightOnly):
    """y = x @ (weight · scale).T + bias with int8 weights and one scale per output feature
    (weight-only quantisation, `--dtype int8`): each weight is rounded once at load to
    q = round(w / s), s = max|w_row| / 127, and multiplied by torch's weight-only int8 kernel
    (`aten._weight_int8pack_mm`) in bfloat16. It reads half the bytes of a bfloat16 weight,
    which pays where a step multiplies one row per weight (plain decoding at batch 1); with
    more rows the kernel's dequantizing makes it slower than packed bfloat16
    (docs/benchmarks.md, "int8").

    The rounded weights are the model: an int8 target's laws are its own, not the float one's
    (the verifiers are lossless with respect to it; the model card reports what the rounding
    costs)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None = None,  # [out]
        scale: torch.Tensor | None = None,  # [out]: given for a shard of a row-parallel weight
    ):
        super().__init__()
        scale = int8_scale(weight) if scale is None else scale
        q = torch.round(weight.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        # The kernel reads the input features 16 at a time (past the end where their count is
        # not a multiple of 16: a crash), so they are padded with zero weights.
        self.pad = -q.shape[1] % 16
        self.register_buffer("weight", F.pad(q, (0, self.pad)), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def shape(self) -> torch.Size:  # [out, in]
        return torch.Size((self.weight.shape[0], self.weight.shape[1] - self.pad))

    def _multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.weight, self.scale)


INT4_GROUP = 32  # input features per int4 scale and zero: Q4_0/Q4_1's blocks


class Int4Linear(_WeightOnly):
    """y = x @ w.T + bias with w in 4 bits, asymmetric, in groups of INT4_GROUP input features
    (`--dtype int4`; Q4_1's layout): per group lo = min w, s = (max w - lo) / 15, q = round((w -
    lo) / s) in [0, 15], multiplied by torch's weight-only int4 kernel
    (`aten._weight_int4pack_mm_for_cpu`) in bfloat16, which reads w = (q - 8) · s + (lo + 8 s)
    with s and its zero in bfloat16. It reads a quarter of the bytes of a bfloat16 weight.

    A checkpoint dequantized from Q4_0/Q4_1 (the default target's, from its GGUF) already lies
    on that grid: rounding it changes nothing but the bfloat16 rounding of s and the zero.
    Elsewhere the rounded weights are another model, as with int8: the verifiers are lossless
    with respect to it, and the model card reports what the rounding costs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # [out, in], [out]
        super().__init__()
        out, width = weight.shape
        self.out, self.width = out, width
        self.pad = -width % INT4_GROUP  # zero weights, read against zero inputs
        # the packing takes output features 16 at a time: zero rows, whose outputs are dropped
        padded = F.pad(weight.float(), (0, self.pad, 0, -out % 16))
        groups = padded.reshape(padded.shape[0], -1, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)  # [out, groups]
        step = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round((groups - lo[..., None]) / step[..., None]).clamp(0, 15)
        q = q.to(torch.int32).reshape(padded.shape[0], -1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        zero = lo + 8 * step
        scale_and_zero = torch.stack([step, zero], -1).transpose(0, 1)  # [groups, out, 2]
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer(
            "scale_and_zero", scale_and_zero.contiguous().to(torch.bfloat16), persistent=False
        )
        self.register_buffer("bias", bias, persistent=False)

    @property
    def shape(self) -> torch.Size:  # [out, in]
        return torch.Size((self.out, self.width))

    def _multiply(self, rows: torch.Tensor) -> torch.Tensor:
        op = torch.ops.aten._weight_int4pack_mm_for_cpu
        return op(rows, self.weight, INT4_GROUP, self.scale_and_zero)[:, : self.out]


def int8_scale(weight: torch.Tensor) -> torch.Tensor:
    """[out]: each output feature's int8 step, max |w| / 127 over its whole row (computed in
    float32, kept in the weight's dtype)."""
    scale = weight.float().abs().amax(dim=1) / 127
    return scale.clamp_min(torch.finfo(torch.float32).tiny).to(weight.dtype)


# oneDNN's fixed cost per call is more than a weight under 1 MiB takes to stream from memory,
# so small weights stay on F.linear (docs/benchmarks.md, "Packed weights").
PACK_MIN_ELEMENTS = 1 << 18


def packs_weights(weight: torch.Tensor) -> bool:
    """Whether ``Llama`` packs this weight by default: on a CPU with oneDNN, at least
    PACK_MIN_ELEMENTS, float32, or bfloat16 where the CPU computes bfloat16 itself (a GPU has
    cuBLAS)."""
    return (
        weight.device.type == "cpu"
        and weight.numel() >= PACK_MIN_ELEMENTS
        and torch.backends.mkldnn.is_available()
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16()))
    )


@functools.cache
def native_bf16() -> bool:
    """This CPU has bfloat16 instructions (AVX-512 BF16 or AMX). There oneDNN's packed bfloat16
    products beat float32 ones, where F.linear's did not (docs/benchmarks.md, "bfloat16");
    elsewhere oneDNN would convert every product to float32, and bfloat16 stays dense."""
    cpu = torch.cpu
    try:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    except AttributeError:  # private helpers: a torch without them packs no bfloat16
        return False


class RowParallel(nn.Module):
    """A projection whose input features are split over the ranks: each rank multiplies its
    shard, the all-reduce sums the parts, and the bias is added once (not once a rank)."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None, world: int, group):
        super().__init__()
        self.linear, self.world, self.group = linear, world, group
        self.register_buffer("bias", bias, persistent=False)  # [out], unsharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / world] -> [..., out]
        y = self.linear(x)
        if self.world > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class CheckpointShard:
    """This rank's slices of a Hugging Face state dict (Megatron): a column-parallel projection
    keeps its share of the output features (heads, MLP inner dimension), a row-parallel one its
    share of the input features. With one rank the slices are whole."""

    state: dict[str, torch.Tensor]  # HF parameter names -> tensors
    rank: int = 0
    world: int = 1
    group: object = None  # torch.distributed group of the ranks (None: the default group)
    packed: bool | None = None  # oneDNN-packed projections (Linear); None: packs_weights
    # "int8": every projection and the head weight-only int8 (Int8Linear); "int4": the decoder
    # layers' projections weight-only int4 (Int4Linear); None: as they come
    rounded: str | None = None

    def linear(
        self,
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None = None,  # [out]
        scale=None,  # [out]: an int8 weight's, where `weight` is a slice of its input features
        in_layer: bool = True,  # False: the head or a feature draft's fc, which int4 leaves be
    ) -> Linear | Int8Linear | Int4Linear:
        if self.rounded == "int8":
            return Int8Linear(weight, bias, scale)
        if self.rounded == "int4" and in_layer:
            return Int4Linear(weight, bias)
        return Linear(weight, bias, packs_weights(weight) if self.packed is None else self.packed)

    def _rows(self, w: torch.Tensor, per_rank: int) -> torch.Tensor:  # [out, ...] -> this rank's
        return w[self.rank * per_rank : (self.rank + 1) * per_rank].contiguous()

    def column_parallel(self, prefix: str, names: list[str], rows: list[int]) -> Linear:
        """Column-parallel projections run as one matmul: this rank's `rows` of each named
        weight and, when the checkpoint has them (Qwen2's q/k/v, Llama's attention_bias/
        mlp_bias), the same entries of their biases, concatenated."""
        parts = list(zip(names, rows, strict=True))
        w = torch.cat([self._rows(self.state[f"{prefix}{m}.weight"], r) for m, r in parts])
        if f"{prefix}{names[0]}.bias" not in self.state:
            return self.linear(w)
        bias = torch.cat([self._rows(self.state[f"{prefix}{m}.bias"], r) for m, r in parts])
        return self.linear(w, bias)

    def row_parallel(self, name: str, cols: int) -> RowParallel:
        """This rank's `cols` input features of weight `name`; its bias stays whole."""
        w = self.state[f"{name}.weight"]
        scale = int8_scale(w) if self.rounded == "int8" else None  # the whole row's: any world
        if self.rounded == "int4" and self.world > 1 and cols % INT4_GROUP:
            raise ValueError(
                f"{name}: int4 groups {INT4_GROUP} input features, and {self.world} ranks would "
                f"give each {cols}; pick a world size that divides them into whole groups"
            )
        linear = self.linear(
            w[:, self.rank * cols : (self.rank + 1) * cols].contiguous(), None, scale
        )
        return RowParallel(linear, self.state.get(f"{name}.bias"), self.world, self.group)


# ------------------------------------------------------------------------------ tree attention
@dataclass(frozen=True)
class SeenKeys:
    """What one layer's new tokens attend to besides each other, and which of it each sees."""

    prefix_k: torch.Tensor  # [n, H_kv, P, D]: the committed cache, a strided view (no copy)
    prefix_v: torch.Tensor  # [n, H_kv, P, D]
    prefix_hidden: torch.Tensor  # [n, 1, 1, 1, 1, P] bool: past the request's committed length
    suffix_k: torch.Tensor | None  # [n, R, H_kv, S, D]: the row's earlier (draft-path) tokens
    suffix_v: torch.Tensor | None  # [n, R, H_kv, S, D]
    new_hidden: torch.Tensor  # [n, R, 1, 1, T, S+T] bool: new token t does not see token s
    # On CUDA: both masks as one additive bias [n·R, 1, T, P+S+T] (0 seen, -inf hidden) for
    # scaled_dot_product_attention (see tree_attention); None elsewhere
    bias: torch.Tensor | None = None
    # Elsewhere, with one row a request (R = 1): both masks joined, [n, 1, 1, 1, T, P+S+T]
    # bool, for the keys joined in one matrix (see tree_attention); None otherwise
    hidden: torch.Tensor | None = None


def _per_kv_head(x: torch.Tensor) -> torch.Tensor:
    """[n, R, Hkv, g, T, X] -> [n, Hkv, R·g·T, X]: every row's grouped queries under a kv head."""
    n, R, kv_heads, g, T, X = x.shape
    return x.permute(0, 2, 1, 3, 4, 5).reshape(n, kv_heads, R * g * T, X)


def _per_row(x: torch.Tensor, R: int, g: int) -> torch.Tensor:
    """The inverse view: [n, Hkv, R·g·T, X] -> [n, R, Hkv, g, T, X]."""
    n, kv_heads, M, X = x.shape
    return x.view(n, kv_heads, R, g, M // (R * g), X).permute(0, 2, 1, 3, 4, 5)


def tree_attention(
    q: torch.Tensor,  # [n, R, H_kv, g, T, D]: new tokens' queries, grouped under their kv head
    k: torch.Tensor,  # [n, R, H_kv, T, D]: new tokens' keys (RoPE applied)
    v: torch.Tensor,  # [n, R, H_kv, T, D]
    seen: SeenKeys,
) -> torch.Tensor:  # [n, R, H_kv, g, T, D]
    """Attention of each row's new tokens (a draft path, or a flattened draft tree) over the
    request's cached prefix and the row's suffix and new tokens, masked, with one softmax over
    both parts.

    The prefix is shared by the request's R rows and read in place: against the queries of
    every row and grouped head as the rows of one matrix per (request, kv head). Broadcast
    over rows and heads instead, matmul copied the prefix R·g times a layer (14% of a batch-8
    step on the default pair). The new part is small and per row: its keys are concatenated.

    With one row a request (R = 1: the target's tree pass, every pending run, a one-path
    draft) in a 16-bit dtype, nothing is shared and a product would copy the strided prefix
    anyway, so its keys are copied once beside the new ones and both parts take one product
    (`_joined_tree_attention`)."""
    if seen.bias is not None:
        return _fused_tree_attention(q, k, v, seen)
    if seen.hidden is not None:
        return _joined_tree_attention(q, k, v, seen)
    _, R, _, group, _, d = q.shape
    scale = d**-0.5
    plen = seen.prefix_k.shape[2]
    s_prefix = _per_row(_per_kv_head(q) @ seen.prefix_k.transpose(-1, -2), R, group) * scale
    s_prefix = s_prefix.masked_fill(seen.prefix_hidden, -torch.inf)  # [n, R, Hkv, g, T, P]
    keys, values = [k], [v]
    if seen.suffix_k is not None:
        keys.insert(0, seen.suffix_k)
        values.insert(0, seen.suffix_v)
    kk = torch.cat(keys, dim=3)[:, :, :, None]  # [n, R, Hkv, 1, S+T, D]
    vv = torch.cat(values, dim=3)[:, :, :, None]
    s_new = (q @ kk.transpose(-1, -2)) * scale  # [n, R, Hkv, g, T, S+T]
    s_new = s_new.masked_fill(seen.new_hidden, -torch.inf)
    probs = torch.cat([s_prefix, s_new], dim=-1).float().softmax(-1).to(q.dtype)
    out_prefix = _per_row(_per_kv_head(probs[..., :plen]) @ seen.prefix_v, R, group)
    return out_prefix + probs[..., plen:] @ vv


def _joined_tree_attention(
    q: torch.Tensor,  # [n, 1, H_kv, g, T, D]
    k: torch.Tensor,  # [n, 1, H_kv, T, D]
    v: torch.Tensor,  # [n, 1, H_kv, T, D]
    seen: SeenKeys,
) -> torch.Tensor:  # [n, 1, H_kv, g, T, D]
    """tree_attention for one row a request: keys and values joined as [prefix; suffix; new]
    (one copy of the prefix's window a layer), then one product for the scores and one for
    the output, every grouped head's queries as rows of one matrix per kv head. On a CPU a
    small product costs ~20 µs whatever its size, and oneDNN's bfloat16 one clones a strided
    operand first: the default target's bfloat16 forward (eager, 1 thread, 200 cached
    tokens) ran 1.13x as fast at one token and at 9, 1.23x at batch 8 over 1,000
    (docs/benchmarks.md, "Joined keys")."""
    n, _, kv_heads, group, T, d = q.shape
    keys, values = [seen.prefix_k[:, None], k], [seen.prefix_v[:, None], v]
    if seen.suffix_k is not None:
        keys.insert(1, seen.suffix_k)
        values.insert(1, seen.suffix_v)
    kk = torch.cat(keys, dim=3)  # [n, 1, H_kv, P+S+T, D]
    vv = torch.cat(values, dim=3)
    scores = q.reshape(n, 1, kv_heads, group * T, d) @ kk.transpose(-1, -2) * d**-0.5
    scores = scores.view(n, 1, kv_heads, group, T, -1).masked_fill(seen.hidden, -torch.inf)
    probs = scores.float().softmax(-1).to(q.dtype).view(n, 1, kv_heads, group * T, -1)
    return (probs @ vv).view(n, 1, kv_heads, group, T, d)


def _fused_tree_attention(
    q: torch.Tensor,  # [n, R, H_kv, g, T, D]
    k: torch.Tensor,  # [n, R, H_kv, T, D]
    v: torch.Tensor,  # [n, R, H_kv, T, D]
    seen: SeenKeys,
) -> torch.Tensor:  # [n, R, H_kv, g, T, D]
    """tree_attention on CUDA: one scaled_dot_product_attention call per layer (a fused
    kernel with the masks as an additive bias) where the matmuls, masks and softmax launch
    ~15 kernels. The keys are copied once into [prefix; suffix; new] per row and grouped
    head (one cat each for k and v): on a GPU a decode step is bound by launches, not by
    copying a bucketed window of the prefix (workers/graphs.py)."""
    n, R, kv_heads, group, T, d = q.shape
    plen = seen.prefix_k.shape[2]

    def rows(x: torch.Tensor) -> torch.Tensor:  # [n, R, H_kv, X, D] -> [n, R, H_kv, g, X, D]
        return x[:, :, :, None].expand(n, R, kv_heads, group, x.shape[3], d)

    def joined(prefix, suffix, new) -> torch.Tensor:  # [n·R, H, P+S+T, D]
        parts = [rows(prefix[:, None].expand(n, R, kv_heads, plen, d))]
        parts += [rows(suffix)] if suffix is not None else []
        parts.append(rows(new))
        return torch.cat(parts, dim=4).view(n * R, kv_heads * group, -1, d)

    keys = joined(seen.prefix_k, seen.suffix_k, k)
    values = joined(seen.prefix_v, seen.suffix_v, v)
    out = F.scaled_dot_product_attention(
        q.reshape(n * R, kv_heads * group, T, d), keys, values, attn_mask=seen.bias
    )
    return out.view(n, R, kv_heads, group, T, d)


# ------------------------------------------------------------------------------ the model
class Attention(nn.Module):
    """Grouped-query self-attention: fused q/k/v (column-parallel: this rank's heads), RoPE,
    tree attention, o (row-parallel)."""

    def __init__(self, spec: LlamaSpec, shard: CheckpointShard, prefix: str):
        super().__init__()
        d = self.head_dim = spec.head_dim
        self.heads, self.kv_heads = spec.num_heads // shard.world, spec.num_kv_heads // shard.world
        self.qkv = shard.column_parallel(
            prefix, ["q_proj", "k_proj", "v_proj"], [self.heads * d] + [self.kv_heads * d] * 2
        )
        # Qwen3: RMSNorm over each q and k head. Per head_dim, the same for every head: whole on
        # every rank.
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(shard.state[prefix + "q_norm.weight"], spec.rms_norm_eps)
            self.k_norm = RMSNorm(shard.state[prefix + "k_norm.weight"], spec.rms_norm_eps)
        self.o = shard.row_parallel(prefix + "o_proj", self.heads * d)

    def forward(
        self,
        x: torch.Tensor,  # [n, R, T, E]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [n, R, 1, T, D]
        seen: SeenKeys,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (output [n, R, T, E], the new tokens' k and v [n, R, H_kv, T, D])."""
        n, R, T, _ = x.shape
        d, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        qk, v = self.qkv(x).split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        qk = qk.view(n, R, T, heads + kv_heads, d)
        if self.q_norm is not None:  # each head normalized on its own, before RoPE
            q, k = qk.split([heads, kv_heads], dim=3)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=3)
        # q's and k's heads rotated together: the same elementwise work in half the launches
        qk = apply_rope(qk.transpose(2, 3), *rope)  # [n, R, H + Hkv, T, D]
        q, k = qk.split([heads, kv_heads], dim=2)  # [n, R, H, T, D], [n, R, Hkv, T, D]
        v = v.view(n, R, T, kv_heads, d).transpose(2, 3)
        grouped = q.view(n, R, kv_heads, heads // kv_heads, T, d)  # GQA: under their kv head
        out = tree_attention(grouped, k, v, seen)
        out = out.reshape(n, R, heads, T, d).transpose(2, 3).reshape(n, R, T, -1)
        return self.o(out), k, v


class MLP(nn.Module):
    """SwiGLU: fused gate/up (column-parallel: this rank's inner features), down (row-parallel)."""

    def __init__(self, spec: LlamaSpec, shard: CheckpointShard, prefix: str):
        super().__init__()
        inner = spec.intermediate_size // shard.world
        self.gate_up = shard.column_parallel(prefix, ["gate_proj", "up_proj"], [inner, inner])
        self.down = shard.row_parallel(prefix + "down_proj", inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E]
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attention(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, spec: LlamaSpec, shard: CheckpointShard, prefix: str):
        super().__init__()
        eps = spec.rms_norm_eps
        self.attn_norm = RMSNorm(shard.state[prefix + "input_layernorm.weight"], eps)
        self.attn = Attention(spec, shard, prefix + "self_attn.")
        self.mlp_norm = RMSNorm(shard.state[prefix + "post_attention_layernorm.weight"], eps)
        self.mlp = MLP(spec, shard, prefix + "mlp.")

    def forward(
        self,
        h: torch.Tensor,  # [n, R, T, E]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [n, R, 1, T, D]
        seen: SeenKeys,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (h [n, R, T, E], the new tokens' k and v [n, R, H_kv, T, D])."""
        attended, k, v = self.attn(self.attn_norm(h), rope, seen)
        h = h + attended
        h = h + self.mlp(self.mlp_norm(h))
        return h, k, v


class Llama(nn.Module):
    """Causal LM forward over (shared prefix cache, per-row new tokens with a mask).

    Built from a checkpoint's tensors, not trained: every weight is a non-persistent buffer
    (fused and sharded at load), which Module machinery may move but neither trains nor saves.
    ``model(tokens, positions, cache, mask)``; see ``forward``."""

    def __init__(
        self,
        spec: LlamaSpec,
        state: dict[str, torch.Tensor],  # HF parameter names -> tensors
        rank: int = 0,
        world: int = 1,
        group=None,
        *,
        head_vocab: torch.Tensor | None = None,  # [Vh] int64 sorted unique ids: a reduced head
        feature_fc: torch.Tensor | None = None,  # [E, 2E]: a feature draft's input projection
        packed: bool | None = None,  # oneDNN-packed projections (Linear); None: packs_weights
        rounded: str | None = None,  # "int8" / "int4": weight-only rounding (CheckpointShard)
    ):
        super().__init__()
        spec.check_divisible(world)
        shard = CheckpointShard(state, rank, world, group, packed, rounded)
        self.spec, self.kv_heads = spec, spec.num_kv_heads // world
        embed = state["model.embed_tokens.weight"]
        self.register_buffer("embed", embed, persistent=False)  # [V, E]
        self.norm = RMSNorm(state["model.norm.weight"], spec.rms_norm_eps)
        inv_freq = spec.inv_freq().to(embed.device)  # [D/2] float32, once
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        lm_head = state.get("lm_head.weight", embed)  # absent: tied to the embeddings
        self.register_buffer("head_vocab", None, persistent=False)
        if head_vocab is not None:  # keep only those rows, gathered once
            self.head_vocab = head_vocab.to(device=embed.device, dtype=torch.int64)
            lm_head = lm_head[self.head_vocab].contiguous()
        # [V or Vh, E]. Tied and packed, the head is a second copy of the embeddings (F.embedding
        # reads the dense one): V·E more floats, 113 MB for SmolLM2 in float32.
        self.lm_head = shard.linear(lm_head, in_layer=False)
        # A feature draft (EAGLE) reads, at each position, its token's embedding and the
        # target's feature one position back: h = fc([feature; embedding]).
        self.feature_fc = None if feature_fc is None else shard.linear(feature_fc, in_layer=False)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, shard, f"model.layers.{i}.") for i in range(spec.num_layers)
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [n, R, T] int64: R rows per request, T new tokens per row
        positions: torch.Tensor,  # [n, R, T] int64
        cache: KVCache,  # prefix: slots [slot0, slot0 + n) with their committed positions
        mask: torch.Tensor,  # [n, R, T, T] bool: new token t sees new token s (same row)
        suffix: tuple[torch.Tensor, torch.Tensor] | None = None,  # extra per-row keys/values:
        # ([L, n, R, H_kv, S, D] k, v) seen by every new token (earlier draft-path tokens)
        slot0: int = 0,
        features: torch.Tensor | None = None,  # [n, R, T, E]: a feature draft's input features
        head: bool = True,  # False: no logits (prefill reads none: ~10% of its work, V·E/token)
        window: int | None = None,  # prefix positions read (>= the longest committed length);
        # None: exactly the longest. Wider reads masked keys: a static shape (workers/graphs.py)
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits [n, R, T, V] float32 or None, new k, new v [L, n, R, H_kv, T, D],
        features [n, R, T, E]: the final-norm hidden states the head reads, which a feature
        draft takes as input)."""
        h = self._inputs(tokens, features)  # [n, R, T, E]
        cos, sin = rope_tables(self.inv_freq, positions, h.dtype)  # [n, R, T, D]
        rope = cos[:, :, None], sin[:, :, None]  # the same for every head
        seen = self._seen_keys(tokens, cache, slot0, mask, suffix, window)
        new_k, new_v = [], []
        for layer, layer_seen in zip(self.layers, seen, strict=True):
            h, k, v = layer(h, rope, layer_seen)
            new_k.append(k)
            new_v.append(v)
        hidden = self.norm(h)
        logits = self.to_vocab(self.head_logits(hidden), -torch.inf) if head else None
        return logits, torch.stack(new_k), torch.stack(new_v), hidden

    def _inputs(
        self,
        tokens: torch.Tensor,  # [n, R, T] int64
        features: torch.Tensor | None,  # [n, R, T, E]
    ) -> torch.Tensor:  # [n, R, T, E]
        """The first layer's input: the tokens' embeddings, through fc for a feature draft."""
        h = F.embedding(tokens, self.embed)
        if self.feature_fc is None:
            return h
        if features is None:
            raise ValueError("a feature draft needs the target's features")
        return self.feature_fc(torch.cat([features.to(h.dtype), h], dim=-1))

    def _seen_keys(
        self,
        tokens: torch.Tensor,  # [n, R, T] int64
        cache: KVCache,
        slot0: int,
        mask: torch.Tensor,  # [n, R, T, T] bool (without a suffix: broadcastable to it)
        suffix: tuple[torch.Tensor, torch.Tensor] | None,  # [L, n, R, H_kv, S, D] k, v
        window: int | None,
    ) -> list[SeenKeys]:
        """Per layer, what the new tokens attend to besides each other: the slots' committed
        prefix, up to the longest one or `window` positions (the others' tails hidden), and the
        suffix, which every new token sees."""
        n, R, T = tokens.shape
        lengths = cache.lengths[slot0 : slot0 + n]
        # off the CPU: from the host, where known; a window is read on trust (graphs.py)
        plen = cache.prefix_length(slot0, n) if window is None else window
        device = tokens.device
        prefix_valid = torch.arange(plen, device=device)[None, :] < lengths[:, None]  # [n, P]
        visible = [mask]
        if suffix is not None:
            S = suffix[0].shape[4]
            visible.insert(0, torch.ones(n, R, T, S, dtype=torch.bool, device=device))
        prefix_hidden = ~prefix_valid[:, None, None, None, None, :]
        new_hidden = ~torch.cat(visible, dim=-1)[:, :, None, None]
        bias = joined = None
        fused = fused_kernels(device)
        if fused or (R == 1 and joins_keys(cache.k.dtype)):  # once a forward, for every layer
            hidden = torch.cat(
                [
                    prefix_hidden[:, :, 0, 0].expand(n, R, T, plen),
                    new_hidden[:, :, 0, 0].expand(n, R, T, new_hidden.shape[-1]),
                ],
                dim=-1,
            )  # [n, R, T, P+S+T]; a broadcast mask expands to every row and token
            if fused:
                bias = torch.zeros(hidden.shape, dtype=cache.k.dtype, device=device)
                bias = bias.masked_fill(hidden, -torch.inf).view(n * R, 1, T, -1)
            else:
                joined = hidden[:, :, None, None]
        slots = slice(slot0, slot0 + n)
        return [
            SeenKeys(
                prefix_k=cache.k[i, slots, :, :plen],
                prefix_v=cache.v[i, slots, :, :plen],
                prefix_hidden=prefix_hidden,
                suffix_k=None if suffix is None else suffix[0][i],
                suffix_v=None if suffix is None else suffix[1][i],
                new_hidden=new_hidden,
                bias=bias,
                hidden=joined,
            )
            for i in range(self.spec.num_layers)
        ]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., E] final-norm hidden states -> float32 logits [..., Vh] on the head's own ids
        (head_vocab; all V when the head is whole)."""
        return self.lm_head(hidden).float()

    def to_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        """[..., Vh] on the head's ids -> [..., V], `fill` at the ids the head drops (-inf for
        logits, 0 for probabilities)."""
        if self.head_vocab is None:
            return rows
        full = rows.new_full((*rows.shape[:-1], self.spec.vocab_size), fill)
        return full.index_copy_(-1, self.head_vocab, rows)
