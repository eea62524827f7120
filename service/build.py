"""The in-process engine over a draft/target pair on disk: workers, caches and graphs chosen
for the device (the actors' counterpart is workers/actors.py's `build_remote_engine`)."""

from __future__ import annotations

from blockspec.service.engine import SpeculativeEngine
from blockspec.service.policy import AutoPolicy
from blockspec.workers.compiled import DecodeForwards
from blockspec.workers.proposers import build_proposer
from blockspec.workers.speculation import speculation_cache
from blockspec.workers.step import StepRunner
from blockspec.workers.target import TargetWorker


def build_engine(
    draft_dir: str,
    target_dir: str,
    max_batch: int = 16,
    max_len: int = 1024,
    dtype: str = "float32",
    device: str = "cpu",
    tensor_parallel: int = 1,
    max_sessions: int = 0,
    auto_arms: list[str] | None = None,
    packed: bool | None = None,
    prefix_caching: bool = True,
    speculation: int = 0,
    speculation_downweight: float = 1.0,
    speculation_max_batch: int | None = None,
    cuda_graphs: bool = True,
    compiled: bool = False,
):
    """Engine over a draft/target pair in this process (a `StepRunner`); the target split
    over `tensor_parallel` ranks (spawned processes, gloo on CPU) when > 1. `max_len` is capped
    at the models' context. `packed=False` keeps F.linear on dense weights where a CPU would
    pack them (a benchmark's baseline; see workers.llama.Linear). `speculation` > 0 turns on
    the speculation cache with that fan-out (workers/speculation.py), and
    `speculation_downweight` < 1 Saguaro sampling, preparing at batches of at most
    `speculation_max_batch` drafted requests (None: any; `speculation_cache`). On a CUDA
    device `cuda_graphs` replays the decode step's forwards from CUDA graphs (workers/graphs.py;
    the in-process target only: tensor-parallel ranks run eagerly). `compiled` runs them
    through torch.compile (workers/compiled.py; dense weights, whatever `packed` says; the
    in-process target only): on a CPU instead of graphs, on CUDA inside them. Returns
    (engine, tokenizer)."""
    from blockspec.workers.models import DTYPES, load_pair
    from blockspec.workers.tensor_parallel import TensorParallelTarget

    d, t, tokenizer = load_pair(draft_dir, target_dir, dtype, device)
    # Positions past either model's trained context are refused, not silently extrapolated.
    max_len = min(max_len, d.spec.max_positions, t.spec.max_positions)
    slots = max_batch + max_sessions
    forwards = DecodeForwards(cuda_graphs, compiled)
    if compiled:  # dense: inductor packs the weights itself
        packed = forwards.packed
    draft = build_proposer(d.build(packed=packed), slots, max_len, DTYPES[dtype], device)
    cache = speculation_cache(draft, speculation, speculation_downweight, speculation_max_batch)
    if tensor_parallel > 1:
        target = TensorParallelTarget(target_dir, tensor_parallel, slots, max_len, dtype, device)
    else:
        target = TargetWorker(t.build(packed=packed), slots, max_len, DTYPES[dtype], device)
    forwards.use(draft)
    if isinstance(target, TargetWorker):  # a split target's ranks run eagerly
        forwards.use(target)
    policy = AutoPolicy(auto_arms) if auto_arms else None
    engine = SpeculativeEngine(
        StepRunner(target, draft, cache),
        max_batch,
        max_len,
        t.spec.vocab_size,
        max_sessions,
        policy,
        prefix_caching,
    )
    return engine, tokenizer
