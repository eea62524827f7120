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

import functools
from dataclasses import dataclass

import torch

from . import cpu_kernels, kernels
from .backends import Backend, host_reads_are_free
from .common import exclusive_cumsum, over_batch_chunks


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

    @functools.cached_property  # one host read per carry: apply_records and advance_records
    def max_rows(self) -> int:
        """Largest number of upcoming rows any record still modifies (0 when none)."""
        return int(self.rows_left.max()) if self.rows_left.numel() else 0

    def to(self, device: torch.device | str) -> TargetModification:
        """The records on `device` (themselves when they are there)."""
        if self.rows_left.device == torch.device(device):
            return self
        from_host = self.rows_left.device.type == "cpu"  # then the copies need not wait
        tensors = (self.log_p, self.log_q, self.rows_left)
        return TargetModification(*(t.to(device, non_blocking=from_host) for t in tensors))

    def split(self) -> list[TargetModification]:
        """Each request's records, a batch of one each. Where host reads are free, only the
        columns live for that request (``select``); on an accelerator the rows of this batch's
        columns, as views: pruning them would read the device once a request, and the batch's
        columns are already bounded (``advance_records``); dead columns change no row."""
        if host_reads_are_free(self.rows_left.device):
            return [self.select([j]) for j in range(self.batch_size)]
        return [
            TargetModification(
                self.log_p[j : j + 1], self.log_q[j : j + 1], self.rows_left[j : j + 1]
            )
            for j in range(self.batch_size)
        ]

    def select(self, index: torch.Tensor | list[int]) -> TargetModification:
        """Records of a subset of requests (e.g. when requests leave a batch)."""
        idx = torch.as_tensor(index, device=self.rows_left.device)
        return TargetModification(self.log_p[idx], self.log_q[idx], self.rows_left[idx])._pruned()

    @staticmethod
    def cat(mods: list[TargetModification]) -> TargetModification:
        """Stack the records of several batches (requests joining a batch); pads with dead slots."""
        width = max(m.rows_left.shape[1] for m in mods)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            # Dead slots go first: each request's newest records stay the rightmost columns,
            # which `_bounded` relies on (the order of the live ones is unchanged). A full
            # width is taken as it is (a pad of nothing still copies: a launch on a GPU).
            if t.shape[1] == width:
                return t
            return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

        return TargetModification(
            torch.cat([pad(m.log_p, 0.0) for m in mods]),
            torch.cat([pad(m.log_q, 0.0) for m in mods]),
            torch.cat([pad(m.rows_left, 0) for m in mods]),
        )

    def widened(self, width: int) -> TargetModification:
        """At least `width` columns: dead ones (rows_left 0) added as the oldest, which no step
        applies. Carries verified from graphs on an accelerator take their bound's width
        (`_bounded`) from the first step, so the graph's shape does not change as records
        accumulate (eagerly, each column costs its ops: there they grow to it)."""
        missing = width - self.rows_left.shape[1]
        if missing <= 0:
            return self
        return TargetModification(
            torch.nn.functional.pad(self.log_p, (missing, 0)),
            torch.nn.functional.pad(self.log_q, (missing, 0)),
            torch.nn.functional.pad(self.rows_left, (missing, 0)),
        )

    def _bounded(self, generations: int, per_generation: int) -> TargetModification:
        """Keep the newest generations x per_generation columns, with no host read: a record
        modifies at most L rows and every iteration emits at least one token, so records of
        more than L iterations ago (generations = L) are dead. The accelerators' `_pruned`."""
        keep = generations * per_generation
        if self.rows_left.shape[1] <= keep:
            return self
        return TargetModification(
            self.log_p[:, -keep:], self.log_q[:, -keep:], self.rows_left[:, -keep:]
        )

    def _pruned(self) -> TargetModification:
        """Drop columns that are dead for every request (keeps application cost bounded)."""
        live = (self.rows_left > 0).any(0)
        cols = live.nonzero().squeeze(1)  # one host read (a test, then three mask indexes, took 4)
        if cols.numel() == live.numel():
            return self
        return TargetModification(
            self.log_p.index_select(1, cols),
            self.log_q.index_select(1, cols),
            self.rows_left.index_select(1, cols),
        )


# Offsets beyond this are clamped: (p - t q)_+ then differs from the exact row only on tokens with
# q < p / T_MAX, a draft mass below 1e-30, and t q stays finite in float32 (no inf * 0 = NaN).
T_MAX = 1e30


@dataclass(frozen=True)
class ResidualRows:
    """Modified target rows in closed form: row = (p - t q)_+ / z on the base rows p, q.

    M_new keeps this form: on a row (p - t q)_+ / z it gives norm((P(v) (p - t q)_+ / z -
    Q(v) q)_+), which is 0 wherever p <= t q and (P(v)/z)(p - (t + s) q) elsewhere, with
    s = z Q(v)/P(v); so M_new(t, z) = (t + s, F(t + s)), F(t) = Σ_x (p - t q)_+. Any chain of
    modifications is then one scalar pair per row, each costing one fused pass over V instead
    of materialised [.., V] rows (t = 0, z = 1 is the base row itself).
    """

    t: torch.Tensor  # [B, P, L] float64 offsets
    z: torch.Tensor  # [B, P, L] float64 normalisers F(t) (1 where t = 0)
    # Known on the host to be the base rows (every t = 0): a pass may then read p itself for
    # (p - 0 q)_+, bit for bit the same, and skip two passes over V.
    unmodified: bool = False

    @staticmethod
    def base(like: torch.Tensor) -> ResidualRows:
        """Unmodified rows for a [B, P, L] tensor's shape and device."""
        t = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
        return ResidualRows(t, torch.ones_like(t), unmodified=True)


def as_row_scalars(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 [...] -> rows' dtype [..., 1], finite (half precision tops out at 65504)."""
    return x.clamp_max(torch.finfo(rows.dtype).max / 4).to(rows.dtype).unsqueeze(-1)


def residual_weights(p: torch.Tensor, q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(p - t q)_+, unnormalised: p, q [..., V], t [...] float64 -> [..., V] in p's dtype."""
    return torch.addcmul(p, q, as_row_scalars(t, p), value=-1).clamp_min_(0)


def residual_mass(
    backend: Backend,
    p: torch.Tensor,  # [B, ..., V]
    q: torch.Tensor,  # [B, ..., V]
    t: torch.Tensor,  # [B, ...] float64
) -> torch.Tensor:
    """F(t) = Σ_x (p(x) - t q(x))_+: [B, ...] float64."""
    if backend.fuses(p, q):  # CUDA: one fused pass
        return kernels.row_masses(p, q, t)[0]
    return over_batch_chunks(_summed_residual, p, q, t)


def _summed_residual(p: torch.Tensor, q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """residual_mass in torch ops, on one chunk of requests."""
    return residual_weights(p, q, t).sum(-1).double()


def residual_prob(
    p_tok: torch.Tensor, q_tok: torch.Tensor, t: torch.Tensor, z: torch.Tensor
) -> torch.Tensor:
    """The rows' probability of given tokens, (p - t q)_+ / z, from gathered p, q (float64)."""
    return (p_tok - t * q_tok).clamp_min(0) / z


def m_new(
    backend: Backend,
    p: torch.Tensor,  # [..., V]: base target rows
    q: torch.Tensor,  # [..., V]: draft rows
    t: torch.Tensor,  # [...] float64: the rows (p - t q)_+ / z being modified
    z: torch.Tensor,  # [...] float64
    log_p: torch.Tensor,  # [...]: log P(v) of each row's prefix v under those rows
    log_q: torch.Tensor,  # [...]: log Q(v) under the draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """M_new(·|v) = norm((P(v) row - Q(v) q)_+) as new (t, z) (spec §3.1, class docstring).

    With no mass left (only on probability-0 prefixes: P(v) = 0, or no token where the row
    beats the draft, spec §11) the row is kept: that never changes the output law.
    """
    s = z * (log_q - log_p).exp()  # log_p = -inf: s = inf, kept below
    t_new = (t + s).clamp_max(T_MAX)
    z_new = residual_mass(backend, p, q, t_new)
    moved = (z_new > 0) & (log_p > -torch.inf)
    return torch.where(moved, t_new, t), torch.where(moved, z_new, z)


def apply_records(
    mod: TargetModification,
    tokens: torch.Tensor,  # [B, P, L] int64: the paths whose rows are given
    draft_probs: torch.Tensor,  # [B, P, L, V]: q rows along the paths
    target_probs: torch.Tensor,  # [B, P, L+1, V]: unmodified target rows along the paths
    backend: Backend,
) -> tuple[ResidualRows, ResidualRows]:
    """Apply every live record, oldest first.

    Returns (the modified target rows of prefix lengths 0..L-1 as :class:`ResidualRows`
    [B, P, L]; the row of length L is never modified; each record's base rows [B, R, P, L]:
    the rows before record r was applied, under which the record's running joint P absorbs
    the tokens generated next, see :func:`advance_records`).

    The numba backend takes one loop a request (cpu_kernels.apply_records), each record
    passing over its own window's rows only; the ops below pass over the batch's widest
    window and mask.
    """
    B, P, L = tokens.shape
    R = mod.rows_left.shape[1]
    rows = ResidualRows.base(tokens)
    # Rows beyond every record's window are untouched. Reading the widest window waits for an
    # accelerator, so there every record passes over all L rows, masked to its own window
    # (the engine keeps γ constant under a carry, so no record reaches past L).
    most = mod.max_rows if backend.reads_host else L  # a host read: once
    width = min(most, L + 1)
    if R == 0 or width == 0:
        return rows, ResidualRows.base(tokens.new_empty(B, R, P, L))
    if most > L:
        raise ValueError(
            f"carry modifies {most} upcoming rows but only {L} draft rows were given: "
            "keep γ constant for a request that carries a target modification"
        )
    if backend.compiled_loops:  # one loop a request, each record over its own window only
        t, z, base_t, base_z = cpu_kernels.apply_records(
            tokens, draft_probs, target_probs, mod.log_p, mod.log_q, mod.rows_left, T_MAX
        )
        return ResidualRows(t, z), ResidualRows(base_t, base_z)
    tok = tokens.unsqueeze(-1)
    p_tok = target_probs[:, :, :L].gather(-1, tok).squeeze(-1).double()  # [B, P, L]
    q_tok = draft_probs.gather(-1, tok).squeeze(-1).double()
    joint_q = exclusive_cumsum(q_tok.log())[..., :width]  # [B, P, W]
    p, q = target_probs[:, :, :width], draft_probs[:, :, :width]  # [B, P, W, V]
    t, z = rows.t, rows.z
    base_t, base_z = [], []
    in_window = torch.arange(width, device=tokens.device)  # [W]
    for r in range(R):
        base_t.append(t)
        base_z.append(z)
        base_logp = residual_prob(p_tok, q_tok, t, z).log()  # under the rows before record r
        joint_p = mod.log_p[:, r, None, None] + exclusive_cumsum(base_logp)[..., :width]
        joint_qr = mod.log_q[:, r, None, None] + joint_q
        t_new, z_new = m_new(backend, p, q, t[..., :width], z[..., :width], joint_p, joint_qr)
        active = in_window[None, None, :] < mod.rows_left[:, r, None, None]  # [B, 1, W]
        t = torch.cat([torch.where(active, t_new, t[..., :width]), t[..., width:]], dim=-1)
        z = torch.cat([torch.where(active, z_new, z[..., :width]), z[..., width:]], dim=-1)
    return ResidualRows(t, z), ResidualRows(torch.stack(base_t, 1), torch.stack(base_z, 1))


def advance_records(
    mod: TargetModification,
    record_rows: ResidualRows,  # [B, R, K, γ]: each record's base rows (from apply_records)
    emitted: torch.Tensor,  # [B, γ] int64: emitted tokens in the first min(n, γ) slots
    num_emitted: torch.Tensor,  # [B] int64: n = τ + 1
    path: torch.Tensor,  # [B] int64: the draft path whose prefix was accepted
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: unmodified target rows
    new_log_p: torch.Tensor,  # [B, N] float64: records created by this iteration
    new_log_q: torch.Tensor,  # [B, N] float64
    new_rows_left: torch.Tensor,  # [B, N] int64
    backend: Backend,
) -> TargetModification:
    """Absorb the n emitted tokens into every record, retire finished ones, append new ones.

    A record whose window ends within the emitted tokens dies, so only the first
    min(n, rows_left) <= γ - 1 tokens matter; emitted[:, i] must be the i-th emitted token there.
    The emitted tokens sit at prefix lengths 0..τ of ``path`` (its first τ draft tokens, then
    the recovered one), whose rows ``record_rows`` already holds: only the tokens' own
    probabilities are read here, no row over V.
    """
    gamma = emitted.shape[1]
    on_host = backend.reads_host
    if (mod.max_rows if on_host else mod.rows_left.shape[1]) > 0:  # dead columns: no-ops
        ar = torch.arange(emitted.shape[0], device=emitted.device)
        tok = emitted.clamp_min(0)  # [B, γ]
        at = (ar[:, None], path[:, None], torch.arange(gamma, device=emitted.device), tok)
        p_tok = target_probs[at].double()  # [B, γ]: p of each emitted token in its row
        q_tok = draft_probs[at].double()
        base = ResidualRows(record_rows.t[ar, :, path], record_rows.z[ar, :, path])  # [B, R, γ]
        token_logp = residual_prob(p_tok[:, None], q_tok[:, None], base.t, base.z).log()
        used = torch.arange(gamma, device=emitted.device)[None, :] < num_emitted[:, None]  # [B, γ]
        d_logp = torch.where(used[:, None, :], token_logp, 0.0).sum(-1)  # [B, R]
        d_logq = torch.where(used, q_tok.log(), 0.0).sum(-1, keepdim=True)  # [B, 1]
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
    return out._pruned() if on_host else out._bounded(gamma, new_rows_left.shape[1])
