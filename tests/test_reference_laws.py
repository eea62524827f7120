"""Every method reproduces the spec's exact one-iteration output laws (spec §12).

For each reference instance x K x method, N = 200,000 independent trials (draft K paths from
the instance's draft tables, verify against its target tables) give an empirical law of the
emitted token sequence, compared with the exact law by Pearson's chi-square at level ALPHA.

Why the test has power: at N = 200k a cell of probability 0.1 has standard error 6.7e-4, so a
bias of 0.003 in one such cell alone gives a noncentrality of ~18 on top of the dof, rejected
with probability > 0.9 at ALPHA = 1e-4 for the dof here (<= ~60 cells). The mutant tests below
show it on real lossy variants: block verification with the clip applied per factor (the
vLLM-Ascend #7807 bug class) and SpecTr with ρ = 1 (infeasible, spec §7) are both rejected.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from harness import ALPHA, SPEC_NAMES, chi_square, load_reference, one_iteration, reference_models

from blockspec import verification
from blockspec.verification import VERIFIERS, Backend, block, top_down

N = 200_000
INSTANCES, NUMBERS = load_reference()


def cases():
    for instance in INSTANCES:
        for k in (1, 2, 3):
            for spec_name, method in SPEC_NAMES.items():
                if VERIFIERS[method].single_path and k > 1:
                    continue
                yield pytest.param(instance, k, spec_name, id=f"{instance}-K{k}-{method}")


def law_test(method: str, instance: str, k: int, spec_name: str, seed: int = 0):
    target, draft, gamma = reference_models(instance)
    outcomes = one_iteration(method, target, draft, N, k, gamma, seed=seed)
    reference = NUMBERS["numbers"][instance][f"K={k}"][spec_name]
    _, _, pvalue = chi_square(Counter(outcomes), reference["output_law"], N)
    mean_tau = sum(o.count(",") for o in outcomes) / N
    return pvalue, mean_tau, reference["E_tau"]


@pytest.mark.parametrize(("instance", "k", "spec_name"), list(cases()))
def test_output_law_matches_reference(instance, k, spec_name):
    method = SPEC_NAMES[spec_name]
    pvalue, mean_tau, exact_tau = law_test(method, instance, k, spec_name)
    assert pvalue > ALPHA, (
        f"{method}: law rejected (p={pvalue:.2e}); E[τ] {mean_tau:.4f} vs {exact_tau:.4f}"
    )
    # E[τ] within 5 standard errors (τ <= 3 so its sd is <= 1.5).
    assert abs(mean_tau - exact_tau) < 5 * 1.5 / N**0.5


def _per_factor_clip(log_factors, log_start=None):
    return log_factors.clamp_max(0).cumsum(-1)  # Π min(1, r_j): the lossy variant


def take_the_torch_ops(monkeypatch) -> None:
    """verify runs the torch ops, where a mutant can be swapped in: the CPU's without the
    compiled loops (held to the torch ops' tokens in test_cpu_verifiers.py), an
    accelerator's without the fused kernels (held to them in test_verify_kernels.py)."""
    plain = {Backend.NUMBA: Backend.TORCH_HOST, Backend.TRITON: Backend.TORCH_DEVICE}
    choose = verification.choose_backend

    def choose_torch_ops(q, p):
        backend = choose(q, p)
        return plain.get(backend, backend)

    monkeypatch.setattr(verification, "choose_backend", choose_torch_ops)


def test_power_per_factor_clipped_block_is_rejected(monkeypatch):
    monkeypatch.setattr(block, "clipped_products", _per_factor_clip)
    take_the_torch_ops(monkeypatch)
    pvalues = [law_test("block", inst, 1, "BV")[0] for inst in INSTANCES]
    assert min(pvalues) < 1e-9, pvalues


def test_power_spectr_with_rho_one_is_rejected(monkeypatch):
    def rho_one(p_row, q_row, n, backend):
        rho = torch.ones(p_row.shape[0], dtype=torch.float64, device=p_row.device)
        return rho, torch.minimum(q_row, p_row).sum(-1).double()

    monkeypatch.setattr(top_down, "kseq_rho", rho_one)
    # on CUDA the node's kernel solves ρ* itself: take the torch ops there (the kernel's ρ*
    # is checked against kseq_rho_all in test_verify_kernels.py)
    take_the_torch_ops(monkeypatch)
    pvalues = [law_test("spectr", inst, 3, "SpecTr")[0] for inst in INSTANCES]
    assert min(pvalues) < 1e-9, pvalues


def test_power_laws_of_different_methods_are_told_apart():
    # GBV's samples tested against SpecInfer's law (toy, K = 2: E[τ] 131/81 vs 4/3).
    target, draft, gamma = reference_models("toy")
    outcomes = one_iteration("gbv", target, draft, N, 2, gamma, seed=3)
    law = NUMBERS["numbers"]["toy"]["K=2"]["SpecInfer"]["output_law"]
    assert chi_square(Counter(outcomes), law, N)[2] < 1e-9
