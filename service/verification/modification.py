"""The carried target modification of greedy block verification and SpecTr-GBV*.

Greedy BV (spec §3.1-3.2) and SpecTr-GBV* (§10) are lossless only if later iterations verify
against a *modified* target: after an iteration that started at context c, for continuations v
of c inside a window of relative lengths,

    M_new(x | c, v) = (P(v x) - Q(v x))_+ / Σ_x' (P(v x') - Q(v x'))_+

with P, Q the joint probabilities of v x from c under the target in force before the record
(the record's *base*) and under the draft. A :class:`TargetModification` holds these records
for a batch, oldest first; the next iteration's target rows are the base model rows with every
live record applied in order (each on top of the previous ones), and afterwards each record's
running joints absorb the emitted tokens. The draft is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import exclusive_cumsum, positive_part_or, scaled_difference, take_rows


@dataclass(frozen=True)
class TargetModification:
    """Live modification records of a batch; column r is the r-th oldest record."""

    log_p: torch.Tensor  # [B, R] float64: log P(generated continuation) under the record's base
    log_q: torch.Tensor  # [B, R] float64: log Q(generated continuation) under the draft
    rows_left: torch.Tensor  # [B, R] int64: upcoming target rows it modifies (0 = dead slot)

    @staticmethod
    def empty(batch: int, device: torch.device | str = "cpu") -> TargetModification:
        z = torch.zeros(batch, 0, dtype=torch.float64, device=device)
        return TargetModification(
            z, z.clone(), torch.zeros(batch, 0, dtype=torch.int64, device=device)
        )

    @property
    def batch_size(self) -> int:
        return self.rows_left.shape[0]

    @property
    def max_rows(self) -> int:
        """Largest number of upcoming rows any record still modifies (0 when none)."""
        return int(self.rows_left.max()) if self.rows_left.numel() else 0

    def select(self, index: torch.Tensor | list[int]) -> TargetModification:
        """Records of a subset of requests (e.g. when requests leave a batch)."""
        idx = torch.as_tensor(index, device=self.rows_left.device)
        return TargetModification(self.log_p[idx], self.log_q[idx], self.rows_left[idx])._pruned()

    @staticmethod
    def cat(mods: list[TargetModification]) -> TargetModification:
        """Stack the records of several batches (requests joining a batch); pads with dead slots."""
        width = max(m.rows_left.shape[1] for m in mods)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return TargetModification(
            torch.cat([pad(m.log_p, 0.0) for m in mods]),
            torch.cat([pad(m.log_q, 0.0) for m in mods]),
            torch.cat([pad(m.rows_left, 0) for m in mods]),
        )

    def _pruned(self) -> TargetModification:
        """Drop columns that are dead for every request (keeps application cost bounded)."""
        live = (self.rows_left > 0).any(0)
        if bool(live.all()):
            return self
        return TargetModification(self.log_p[:, live], self.log_q[:, live], self.rows_left[:, live])


def m_new(
    log_p: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """M_new(·|v) = norm((P(v) p(·|v) - Q(v) q(·|v))_+), falling back to p on zero mass
    (only on probability-0 prefixes, spec §3.1, §11). log_p, log_q [...]: joints of the
    prefixes v; p, q [..., V]: their rows."""
    modified = positive_part_or(scaled_difference(log_p, p, log_q, q), p)
    return modified / modified.sum(-1, keepdim=True)


def apply_records(
    mod: TargetModification,
    tokens: torch.Tensor,  # [B, P, L] int64: the paths whose rows are given
    draft_probs: torch.Tensor,  # [B, P, L, V]: q rows along the paths
    target_probs: torch.Tensor,  # [B, P, L+1, V]: unmodified target rows along the paths
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply every live record, oldest first.

    Returns (modified target rows [B, P, L+1, V], token_logp [B, R, P, L]) where
    token_logp[:, r] = log of each path token under record r's base rows, which is what the
    record's running joint P absorbs as tokens are generated.
    """
    B, P, L = tokens.shape
    R = mod.rows_left.shape[1]
    token_logp = torch.zeros(B, R, P, L, dtype=torch.float64, device=tokens.device)
    width = min(mod.max_rows, L + 1)  # rows beyond every record's window are untouched
    if R == 0 or width == 0:
        return target_probs, token_logp
    if mod.max_rows > L:
        raise ValueError(
            f"carry modifies {mod.max_rows} upcoming rows but only {L} draft rows were given: "
            "keep γ constant for a request that carries a target modification"
        )
    rows = target_probs[:, :, :width].clone()  # [B, P, W, V]
    q = draft_probs[:, :, :width]
    log_q_tok = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double().log()  # [B, P, L]
    joint_q = exclusive_cumsum(log_q_tok)[..., :width]  # [B, P, W]
    in_window = torch.arange(width, device=tokens.device)  # [W]
    for r in range(R):
        base_logp = _token_logp(rows, target_probs, tokens)  # under the rows before record r
        token_logp[:, r] = base_logp
        joint_p = mod.log_p[:, r, None, None] + exclusive_cumsum(base_logp)[..., :width]
        joint_qr = mod.log_q[:, r, None, None] + joint_q
        modified = m_new(joint_p, rows, joint_qr, q)
        active = in_window[None, None, :] < mod.rows_left[:, r, None, None]  # [B, 1, W]
        rows = torch.where(active.unsqueeze(-1), modified, rows)
    out = torch.cat([rows, target_probs[:, :, width:]], dim=2)
    return out, token_logp


def _token_logp(rows: torch.Tensor, full_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log prob of each path token under ``rows`` (first W rows) then ``full_rows``: [B, P, L]."""
    width, L = rows.shape[2], tokens.shape[2]
    head = rows[:, :, : min(width, L)].gather(-1, tokens[:, :, :width].unsqueeze(-1)).squeeze(-1)
    tail = full_rows[:, :, width:L].gather(-1, tokens[:, :, width:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([head, tail], dim=2).double().log()


def advance_records(
    mod: TargetModification,
    emitted: torch.Tensor,  # [B, γ] int64: emitted tokens in the first min(n, γ) slots
    num_emitted: torch.Tensor,  # [B] int64: n = τ + 1
    path: torch.Tensor,  # [B] int64: the draft path whose prefix was accepted
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: unmodified target rows
    new_log_p: torch.Tensor,  # [B, N] float64: records created by this iteration
    new_log_q: torch.Tensor,  # [B, N] float64
    new_rows_left: torch.Tensor,  # [B, N] int64
) -> TargetModification:
    """Absorb the n emitted tokens into every record, retire finished ones, append new ones.

    A record whose window ends within the emitted tokens dies, so only the first
    min(n, rows_left) <= γ - 1 tokens matter; emitted[:, i] must be the i-th emitted token there.
    """
    gamma = emitted.shape[1]
    if mod.max_rows > 0:
        path_draft_probs = take_rows(draft_probs, path)  # [B, γ, V]
        path_target_probs = take_rows(target_probs, path)  # [B, γ+1, V]
        tok = emitted.clamp_min(0).unsqueeze(1)  # [B, 1, γ]
        _, token_logp = apply_records(
            mod, tok, path_draft_probs.unsqueeze(1), path_target_probs.unsqueeze(1)
        )
        used = torch.arange(gamma, device=emitted.device)[None, :] < num_emitted[:, None]  # [B, γ]
        log_q_tok = path_draft_probs.gather(-1, tok[:, 0].unsqueeze(-1)).squeeze(-1).double().log()
        d_logp = torch.where(used[:, None, :], token_logp[:, :, 0], 0.0).sum(-1)  # [B, R]
        d_logq = torch.where(used, log_q_tok, 0.0).sum(-1, keepdim=True)  # [B, 1]
        rows_left = (mod.rows_left - num_emitted[:, None]).clamp_min(0)
        alive = rows_left > 0
        # Dead records keep finite placeholders (their values are never read again).
        log_p = torch.where(alive, mod.log_p + d_logp, 0.0)
        log_q = torch.where(alive, mod.log_q + d_logq, 0.0)
        mod = TargetModification(log_p, log_q, rows_left)
    new_alive = new_rows_left > 0
    out = TargetModification(
        torch.cat([mod.log_p, torch.where(new_alive, new_log_p, 0.0)], dim=1),
        torch.cat([mod.log_q, torch.where(new_alive, new_log_q, 0.0)], dim=1),
        torch.cat([mod.rows_left, new_rows_left.clamp_min(0)], dim=1),
    )
    return out._pruned()
