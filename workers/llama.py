"""A Llama forward pass readable in one sitting, fed with a Hugging Face checkpoint's weights.

Why not call the HF module directly: speculative decoding needs three things HF's cache API does
not give cheaply: attention of many rows (K draft paths, or a draft tree) against one shared
per-request prefix cache without copying it, tree attention masks over ragged batches, and
committing an arbitrary subset of new KV entries (the accepted path). This module does exactly
that and nothing more; weights come from ``AutoModelForCausalLM.from_pretrained`` (see
``workers/models.py``) and tests pin its logits to the HF model's.

Attention of new tokens is split in two parts, softmaxed jointly:
- *prefix*: the request's committed cache, shared by all of the request's rows ([B, 1, ...]
  broadcast against [B, R, ...]: no copy per path);
- *suffix*: the new tokens of each row (a draft path, or a flattened tree), with an explicit
  boolean mask saying which new token sees which.

Tensor parallelism (Megatron style) shards heads and the MLP's inner dimension over the ranks
of a ``torch.distributed`` group: q/k/v and gate/up are column-parallel, o and down are
row-parallel followed by an all-reduce. With one rank the group is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


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

    @staticmethod
    def from_hf_config(cfg) -> LlamaSpec:
        rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}: only 'default'")
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
        )


class KVCache:
    """Committed keys/values of up to `max_batch` requests (slots), `max_len` positions each.

    k, v: [L, max_batch, H_kv, max_len, D]; lengths: [max_batch] int64 (committed positions).
    A forward works on a contiguous slot range: active requests stay compacted in [0, n).
    """

    def __init__(self, spec: LlamaSpec, kv_heads: int, max_batch: int, max_len: int, dtype, device):
        shape = (spec.num_layers, max_batch, kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(
        self,
        new_k: torch.Tensor,  # [L, n, H_kv, T, D]
        new_v: torch.Tensor,  # [L, n, H_kv, T, D]
        index: torch.Tensor,  # [n, C] int64 into T
        count: torch.Tensor,  # [n] int64 <= C
        slot0: int = 0,
    ) -> None:
        """Slot slot0 + b appends new entries index[b, :count[b]] after its committed ones."""
        n, c = index.shape
        if c == 0:
            return
        lengths = self.lengths[slot0 : slot0 + n]
        valid = torch.arange(c, device=index.device)[None, :] < count[:, None]  # [n, C]
        pos = lengths[:, None] + torch.arange(c, device=index.device)  # [n, C]
        if bool((valid & (pos >= self.max_len)).any()):
            raise ValueError(f"KV cache full: a request exceeds max_len={self.max_len}")
        # Entries past count land beyond the new length (clamped into range): never read.
        pos = pos.clamp_max(self.max_len - 1)
        slots = slot0 + torch.arange(n, device=index.device)[:, None]
        layers, _, heads, _, dim = new_k.shape
        take = index[None, :, None, :, None].expand(layers, n, heads, c, dim)
        for cache, new in ((self.k, new_k), (self.v, new_v)):
            cache[:, slots, :, pos, :] = new.gather(3, take).permute(1, 3, 0, 2, 4)  # [n,C,L,H,D]
        lengths += count

    def move(self, src: int, dst: int) -> None:
        """Copy slot src into slot dst (compaction when a request leaves)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.lengths[dst] = self.lengths[src]


def _rope_tables(
    spec: LlamaSpec, positions: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (
        spec.rope_theta
        ** (torch.arange(0, spec.head_dim, 2, device=positions.device).float() / spec.head_dim)
    )
    ang = positions.float()[..., None] * inv  # [..., D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Llama(torch.nn.Module):
    """Causal LM forward over (shared prefix cache, per-row new tokens with a mask)."""

    def __init__(
        self,
        spec: LlamaSpec,
        state: dict[str, torch.Tensor],
        rank: int = 0,
        world: int = 1,
        group=None,
    ):
        super().__init__()
        if spec.num_heads % world or spec.num_kv_heads % world or spec.intermediate_size % world:
            raise ValueError(f"heads/kv_heads/intermediate size must divide by {world} ranks")
        self.spec, self.group, self.world = spec, group, world
        self.heads, self.kv_heads = spec.num_heads // world, spec.num_kv_heads // world
        d = spec.head_dim

        def col(w: torch.Tensor, rows_per_rank: int) -> torch.Tensor:  # split output features
            return w[rank * rows_per_rank : (rank + 1) * rows_per_rank].contiguous()

        def row(w: torch.Tensor, cols_per_rank: int) -> torch.Tensor:  # split input features
            return w[:, rank * cols_per_rank : (rank + 1) * cols_per_rank].contiguous()

        inter = spec.intermediate_size // world
        self.embed = state["model.embed_tokens.weight"]
        self.norm = state["model.norm.weight"]
        self.lm_head = state.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [
                    col(state[p + "self_attn.q_proj.weight"], self.heads * d),
                    col(state[p + "self_attn.k_proj.weight"], self.kv_heads * d),
                    col(state[p + "self_attn.v_proj.weight"], self.kv_heads * d),
                ]
            )
            gate_up = torch.cat(
                [
                    col(state[p + "mlp.gate_proj.weight"], inter),
                    col(state[p + "mlp.up_proj.weight"], inter),
                ]
            )
            self.layers.append(
                dict(
                    attn_norm=state[p + "input_layernorm.weight"],
                    qkv=qkv,
                    o=row(state[p + "self_attn.o_proj.weight"], self.heads * d),
                    mlp_norm=state[p + "post_attention_layernorm.weight"],
                    gate_up=gate_up,
                    down=row(state[p + "mlp.down_proj.weight"], inter),
                )
            )

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits [n, R, T, V] float32, new k, new v [L, n, R, H_kv, T, D])."""
        spec, d = self.spec, self.spec.head_dim
        n, R, T = tokens.shape
        h = F.embedding(tokens, self.embed)  # [n, R, T, E]
        cos, sin = _rope_tables(spec, positions, h.dtype)  # [n, R, T, D]
        cos, sin = cos[:, :, None], sin[:, :, None]
        lengths = cache.lengths[slot0 : slot0 + n]
        plen = int(lengths.max()) if n else 0
        prefix_valid = (
            torch.arange(plen, device=tokens.device)[None, :] < lengths[:, None]
        )  # [n, P]
        group = self.heads // self.kv_heads
        new_k, new_v = [], []
        for li, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["attn_norm"], spec.rms_norm_eps)
            qkv = x @ layer["qkv"].T
            q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
            q = _rotate(q.view(n, R, T, self.heads, d).transpose(2, 3), cos, sin)  # [n, R, H, T, D]
            k = _rotate(
                k.view(n, R, T, self.kv_heads, d).transpose(2, 3), cos, sin
            )  # [n, R, Hkv, T, D]
            v = v.view(n, R, T, self.kv_heads, d).transpose(2, 3)
            new_k.append(k)
            new_v.append(v)
            qg = q.view(n, R, self.kv_heads, group, T, d)  # GQA: heads grouped under their kv head
            scale = d**-0.5
            # Shared prefix: [n, 1, Hkv, 1, P, D] views broadcast over rows and grouped heads.
            pk = cache.k[li, slot0 : slot0 + n, :, :plen][:, None, :, None]
            pv = cache.v[li, slot0 : slot0 + n, :, :plen][:, None, :, None]
            s_prefix = (qg @ pk.transpose(-1, -2)) * scale  # [n, R, Hkv, g, T, P]
            s_prefix = s_prefix.masked_fill(~prefix_valid[:, None, None, None, None, :], -torch.inf)
            keys, values, masks = [k], [v], [mask]
            if suffix is not None:
                sk, sv = suffix[0][li], suffix[1][li]  # [n, R, Hkv, S, D]
                keys.insert(0, sk)
                values.insert(0, sv)
                masks.insert(
                    0, torch.ones(n, R, T, sk.shape[3], dtype=torch.bool, device=tokens.device)
                )
            kk = torch.cat(keys, dim=3)[:, :, :, None]  # [n, R, Hkv, 1, S+T, D]
            vv = torch.cat(values, dim=3)[:, :, :, None]
            s_new = (qg @ kk.transpose(-1, -2)) * scale  # [n, R, Hkv, g, T, S+T]
            s_new = s_new.masked_fill(~torch.cat(masks, dim=-1)[:, :, None, None], -torch.inf)
            probs = torch.cat([s_prefix, s_new], dim=-1).float().softmax(-1).to(q.dtype)
            out = probs[..., :plen] @ pv + probs[..., plen:] @ vv  # [n, R, Hkv, g, T, D]
            out = out.view(n, R, self.heads, T, d).transpose(2, 3).reshape(n, R, T, self.heads * d)
            h = h + self._all_reduce(out @ layer["o"].T)
            x = _rms_norm(h, layer["mlp_norm"], spec.rms_norm_eps)
            gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
            h = h + self._all_reduce((F.silu(gate) * up) @ layer["down"].T)
        logits = _rms_norm(h, self.norm, spec.rms_norm_eps) @ self.lm_head.T
        return logits.float(), torch.stack(new_k), torch.stack(new_v)
