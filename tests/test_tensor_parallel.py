"""Tensor-parallel target (workers/tensor_parallel.py): 2 ranks in 2 processes vs. one.

A tiny random Llama checkpoint (4 heads, 2 kv heads, MLP 64: all even) is saved to disk; the
sharded target must give the unsharded TargetWorker's logits over prefill, several scored trees
and commits (so the per-rank caches are exercised), and the speculative engine on top of it
must emit the target's greedy tokens at temperature 0. Also: uneven splits are refused before
anything is spawned, every listener of the group is on loopback, and shutdown leaves no process
behind, whether clean or after a rank died.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from blockspec.service.engine import SpeculativeEngine
from blockspec.service.requests import make_request
from blockspec.workers.llama import Llama
from blockspec.workers.models import load_model
from blockspec.workers.proposers import build_proposer
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.step import StepRunner
from blockspec.workers.target import TargetWorker
from blockspec.workers.tensor_parallel import TensorParallelTarget
from blockspec.workers.tree import build_tree

VOCAB, MAX_BATCH, MAX_LEN = 96, 4, 64
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def _shared_tp():
    """Holder of one 2-rank group for the module (a process can be in one group at a time)."""
    holder: dict = {}  # "tp": the group; "baseline": listener addresses
    # Listeners this process had before any group (a Ray driver's, when the live-service tests
    # ran in this worker first): not the group's, so the socket checks leave them out.
    holder["baseline"] = {line.split()[3] for line in _listeners([os.getpid()])}
    yield holder
    if "tp" in holder:
        holder["tp"].close()


@pytest.fixture
def tp(_shared_tp, checkpoint) -> TensorParallelTarget:
    # Restarted only if a test that needs its own group closed it (startup takes seconds).
    if "tp" not in _shared_tp or _shared_tp["tp"].closed:
        _shared_tp["tp"] = TensorParallelTarget(checkpoint, 2, MAX_BATCH, MAX_LEN)
    return _shared_tp["tp"]


def _reference(checkpoint: str) -> TargetWorker:
    return TargetWorker(load_model(checkpoint).build(), MAX_BATCH, MAX_LEN)


def _random_tree(n: int, k: int, gamma: int, g: torch.Generator):
    """Ragged trees: request b uses 1..k paths to depth 1..γ (shared prefixes merge)."""
    paths = torch.randint(0, VOCAB, (n, k, gamma), generator=g)  # [n, K, γ]
    paths[:, 1:, 0] = paths[:, :1, 0]  # common first token: a real tree, not a bundle
    num_paths = torch.randint(1, k + 1, (n,), generator=g)
    depth = torch.randint(1, gamma + 1, (n,), generator=g)
    root = torch.randint(0, VOCAB, (n,), generator=g)
    return build_tree(root, paths, num_paths, depth), num_paths, depth


def test_logits_match_unsharded(tp, checkpoint):
    ref = _reference(checkpoint)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, VOCAB, (t,), generator=g) for t in (7, 0, 12, 3)]  # ragged
    tp.prefill(0, contexts)
    ref.prefill(0, contexts)
    n = len(contexts)
    worst = 0.0
    for step in range(4):
        if step == 2:  # a request leaves: slot 3 moves into slot 1 (engine compaction)
            tp.move(3, 1)
            ref.move(3, 1)
            n = 3
        tree, num_paths, depth = _random_tree(n, 3, 4, g)
        got, want = tp.score_logits(tree), ref.score_logits(tree)  # [n, N, V]
        real = torch.arange(tree.tokens.shape[1]) < tree.num_nodes[:, None]  # padding aside
        worst = max(worst, (got - want).abs()[real].max().item())
        params = [SamplingParams(temperature=0.7, top_k=20)] * n
        probs_tp = tp.score(tree, params)  # [n, K, γ+1, V]
        assert (probs_tp - ref.score(tree, params)).abs().max().item() < TOL
        # Commit a ragged accepted prefix of a real path of each request.
        path = (torch.rand(n, generator=g) * num_paths).long()
        accepted = (torch.rand(n, generator=g) * (depth + 1)).long()
        tp.commit(path, accepted)
        ref.commit(path, accepted)
        assert torch.equal(tp.cache.lengths, ref.cache.lengths)
    assert worst < TOL, f"max |Δlogit| = {worst}"


def test_single_rank_needs_no_processes(checkpoint):
    with TensorParallelTarget(checkpoint, 1, MAX_BATCH, MAX_LEN) as one:
        assert one.worker_pids == []
        ref = _reference(checkpoint)
        contexts = [torch.arange(5), torch.arange(2)]
        one.prefill(0, contexts)
        ref.prefill(0, contexts)
        tree, _, _ = _random_tree(2, 2, 3, torch.Generator().manual_seed(2))
        assert torch.equal(one.score_logits(tree), ref.score_logits(tree))


def test_refused_ops_leave_the_group_usable(tp, checkpoint):
    with pytest.raises(ValueError, match="max_batch"):
        tp.prefill(3, [torch.arange(2), torch.arange(2)])  # slots 3, 4 of 4
    ref = _reference(checkpoint)
    tree, _, _ = _random_tree(1, 1, 4, torch.Generator().manual_seed(6))
    for target in (tp, ref):
        target.prefill(0, [torch.arange(MAX_LEN - 4)])
        target.score_logits(tree)
    # Root + 4 accepted would pass max_len: refused by rank 0 before the other rank commits.
    with pytest.raises(ValueError, match="KV cache full"):
        tp.commit(torch.tensor([0]), torch.tensor([4]))
    for target in (tp, ref):
        target.commit(torch.tensor([0]), torch.tensor([2]))
    assert int(tp.cache.lengths[0]) == MAX_LEN - 1
    # Every rank still has the same cache: the next scores agree with the unsharded target.
    assert (tp.score_logits(tree) - ref.score_logits(tree)).abs().max().item() < TOL


def _hf_greedy(checkpoint: str, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding with the HF model (no eos: exactly `steps` tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(steps):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _noisy_draft(checkpoint: str) -> Llama:
    """The target plus noise: drafts that are often, not always, right (long and short commits)."""
    loaded = load_model(checkpoint)
    g = torch.Generator().manual_seed(3)
    state = {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) for k, v in loaded.state.items()
    }
    return Llama(loaded.spec, state)


def test_engine_greedy_equals_target(tp, checkpoint):
    greedy = SamplingParams(temperature=0.0)
    specs = [  # (prompt length, method, K, γ): ragged prompts (one of 1 token: empty context)
        (9, "block", 1, 4),
        (1, "token", 1, 3),
        (14, "spectr", 3, 3),
        (5, "none", 1, 1),
        (11, "greedy_block", 1, 2),
    ]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (t,), generator=g).tolist() for t, *_ in specs]

    def run(target) -> list:
        # max_batch 2 < 5 requests: continuous batching, so requests leave and slots move.
        draft = build_proposer(_noisy_draft(checkpoint), MAX_BATCH, MAX_LEN)
        vocab = draft.model.spec.vocab_size
        executor = StepRunner(target, draft)
        engine = SpeculativeEngine(executor, max_batch=2, max_len=MAX_LEN, vocab_size=vocab)
        reqs = [
            make_request(engine.limits, p, 12, method, k, gamma, greedy, seed=i)
            for i, (p, (_, method, k, gamma)) in enumerate(zip(prompts, specs, strict=True))
        ]
        return engine.generate(reqs)

    got = run(tp)
    want = run(_reference(checkpoint))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(r.stats.accepted for r in got) > 0  # some drafts were accepted and committed
    for prompt, res in zip(prompts, got, strict=True):
        assert res.token_ids == _hf_greedy(checkpoint, prompt, 12)


@pytest.mark.parametrize("world, what", [(3, "attention heads (4)"), (4, "kv heads (2)")])
def test_uneven_split_is_refused(checkpoint, world, what):
    before = set(multiprocessing.active_children())
    pattern = rf"cannot split .* over {world} ranks: .*{re.escape(what)}"
    with pytest.raises(ValueError, match=pattern):
        TensorParallelTarget(checkpoint, world, MAX_BATCH, MAX_LEN)
    assert set(multiprocessing.active_children()) == before  # refused before spawning


def _listeners(pids: list[int]) -> list[str]:
    """`ss` lines of the TCP listeners owned by pids ([] without ss)."""
    if shutil.which("ss") is None:
        return []
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_group_listens_on_loopback_only(tp, _shared_tp):
    ours = _listeners([os.getpid(), *tp.worker_pids])
    local = [line.split()[3] for line in ours]
    local = [a for a in local if a not in _shared_tp["baseline"]]
    assert local, "expected the rendezvous store and gloo listeners"
    assert all(a.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")) for a in local), ours


def test_clean_shutdown_and_dead_rank(tp, _shared_tp, checkpoint):
    # Clean: the shared group (a process is in one group at a time) leaves on STOP.
    procs = list(tp._workers.procs)
    sockets = {line.split()[3] for line in _listeners([os.getpid()])}  # Local Address:Port
    sockets -= _shared_tp["baseline"]
    tp.close()
    assert [p.exitcode for p in procs] == [0]  # not terminated
    assert not sockets & {line.split()[3] for line in _listeners([os.getpid()])}  # closed too
    with pytest.raises(RuntimeError, match="closed"):
        tp.prefill(0, [torch.arange(4)])

    # A rank dies: the next op fails clearly and nothing is left running.
    target = TensorParallelTarget(checkpoint, 2, MAX_BATCH, MAX_LEN, timeout_s=60)
    _shared_tp["tp"] = target  # closed at module teardown if this test fails midway
    procs = list(target._workers.procs)
    target.prefill(0, [torch.arange(4)])
    os.kill(target.worker_pids[0], signal.SIGKILL)
    procs[0].join(10)
    tree, _, _ = _random_tree(1, 1, 2, torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="group shut down"):
        target.score_logits(tree)
    assert not any(p.is_alive() for p in procs)
    target.close()  # idempotent
