"""The engine on a fake CUDA device (tests/fake_device.py): device bugs and host waits, on CPU.

CI has no GPU, and blockspec first met one long after its CPU tests passed: its first step
mixed cuda:0 and CPU tensors. Here the in-process engine runs with its models, caches and every
tensor placed on ``cuda`` made a ``FakeCudaTensor`` (a CPU tensor that reports cuda:0 and
enforces CUDA's same-device rule), so:

- every verifier, ``none``, ``auto``, a mixed batch and a session's follow-up decode on the
  fake device with a token draft (the tiny pair, loaded by ``build_engine(device="cuda")``)
  and a feature draft, and through the Ray actors' classes (in process, every tensor through
  a link's serialization), and give the CPU engine's seeded tokens;
- the host's syncs (reads of device data, blocking copies to it: each one a wait for the GPU)
  are counted per decode step and bounded (HOST_SYNCS_PER_STEP);
- mutants that drop one ``.to(device)`` fail with CUDA's error, and one that leaves a per-step
  buffer on the host fails the bound.

The verifiers' Triton kernels and CUDA graphs are off under the harness (they need a GPU), so
the verifiers take their torch-ops accelerator paths; tests/test_verify_kernels.py covers the
kernels, tests/test_fake_graphs.py the engine with every graph captured on the fake device.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections import Counter

import pytest
import torch
from fake_device import FakeCuda, is_fake, to_fake_model
from test_engine import make_engine, tiny_pair
from test_feature_draft import random_fc

import blockspec.workers.actors as actors
import blockspec.workers.channel as channel
from blockspec import workers
from blockspec.service.build import build_engine
from blockspec.service.engine import SpeculativeEngine
from blockspec.service.policy import AUTO, PLAIN
from blockspec.service.requests import GenerationRequest, Limits, make_request
from blockspec.verification import METHODS, VERIFIERS
from blockspec.workers.draft import DraftProposer
from blockspec.workers.feature_draft import FeatureDraft, FeatureFeed
from blockspec.workers.llama import KVCache, LlamaSpec
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.step import StepRunner
from blockspec.workers.target import TargetWorker
from blockspec.workers.token_draft import TokenFeed

MAX_BATCH, MAX_LEN = 4, 96

# Host syncs per decode step (reads of device data, and blocking copies to it), at most,
# whatever the methods of the batch: the step's one copy of the verdict back to the host
# (verdict_on_host), which brings the draft tokens' out-of-vocabulary flags with it
# (workers.step.clamp_to_vocab; the verify calls read nothing). Off the CPU the tree keeps
# 1 + Kγ nodes instead of reading its real size back (build_tree), and the methods that carry
# a target modification pass their records over all rows, masked, pruned by a bound on their
# age (verification.modification).
HOST_SYNCS_PER_STEP = 1


def paths_for(method: str) -> int:
    return 1 if method in (PLAIN, AUTO) or VERIFIERS[method].single_path else 3


# `requests` fit every engine here: the feature pair's 48 ids and MAX_LEN positions.
LIMITS = Limits.for_engine(vocab_size=48, max_context=MAX_LEN)


def requests(methods: list[str], gamma: int = 3, new: int = 10) -> list[GenerationRequest]:
    """Seeded requests of varied prompts and sampling settings, one per method given."""
    settings = [SamplingParams(), SamplingParams(0.8, top_k=40), SamplingParams(0.0)]
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [42], [7, 7, 7, 7]]
    return [
        make_request(
            LIMITS,
            prompts[i % len(prompts)],
            new,
            m,
            paths_for(m),
            gamma,
            settings[i % 3],
            seed=10 + i,
        )
        for i, m in enumerate(methods)
    ]


def run_cpu(engine, reqs: list[GenerationRequest]) -> list[tuple[list[int], int]]:
    """Each request's tokens and prompt tokens cached from its session."""
    return [(r.token_ids, r.cached_tokens) for r in engine.generate(reqs)]


def run_fake(
    engine, reqs: list[GenerationRequest], dev: FakeCuda | None = None
) -> tuple[list[tuple], list[int], Counter]:
    """run_cpu's outputs, host syncs of each step, and where they came from (all steps), under
    `dev` (default: a FakeCuda of its own)."""
    results, per_step, sites = {}, [], Counter()
    with dev or FakeCuda() as dev:
        ids = [engine.add(r) for r in reqs]
        while engine.active or engine.waiting:
            dev.reset()
            for res in engine.step().finished:
                results[res.request_id] = (res.token_ids, res.cached_tokens)
            per_step.append(dev.total)
            sites.update(dev.sites)
    return [results[i] for i in ids], per_step, sites


@pytest.fixture(scope="module")
def tiny():
    """The tiny pair (a token draft) on the CPU and on the fake device; weights unpacked on
    both (the fake device never packs: a GPU has cuBLAS), so their products are the same."""
    common = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, max_sessions=1, packed=False)
    cpu, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), **common)
    with FakeCuda():
        fake, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device="cuda", **common)
    assert is_fake(fake.target.cache.k) and fake.draft.cache.k.device == torch.device("cuda", 0)
    return cpu, fake


@pytest.fixture(scope="module")
def featured():
    """A feature draft (reads the target's features) on tiny random models, CPU and fake."""
    _, target, draft = tiny_pair(vocab=48, draft_fc=random_fc(64, scale=0.1))
    cpu = make_engine(target, draft, MAX_BATCH, MAX_LEN)
    with FakeCuda():
        slots = MAX_BATCH
        fake = SpeculativeEngine(
            StepRunner(
                TargetWorker(to_fake_model(target), slots, MAX_LEN, device="cuda"),
                FeatureDraft(to_fake_model(draft), slots, MAX_LEN, device="cuda"),
            ),
            MAX_BATCH,
            MAX_LEN,
            target.spec.vocab_size,
        )
    assert isinstance(fake.feed, FeatureFeed)
    return cpu, fake


# ------------------------------------------------------------------------------ the harness
def test_harness_refuses_what_cuda_refuses_and_counts_host_reads():
    with FakeCuda() as dev, torch.inference_mode():
        a = torch.arange(6.0, device="cuda").view(2, 3)
        assert is_fake(a) and a.is_cuda and a.device == torch.device("cuda", 0)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            a + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([a[0], torch.ones(3)])
        with pytest.raises(RuntimeError, match="same device"):
            a[torch.tensor([0])] = torch.ones(1, 3)  # index_put_ takes values on a's device
        with pytest.raises(RuntimeError, match="generator"):
            torch.rand(2, generator=torch.Generator(), device="cuda")
        with pytest.raises(TypeError, match="numpy"):
            a.numpy()
        # What CUDA takes: 0-dim host tensors, host index tensors, copies from the host.
        assert is_fake(a * torch.tensor(2.0)) and is_fake(a[torch.tensor([1])])
        view = a[1]
        view.add_(1)  # views alias their base
        assert is_fake(torch.ones(3).to("cuda", non_blocking=True))
        assert dev.total == 0 and dev.h2d == 1
        a[0] = torch.ones(3)  # a blocking copy: the host waits for the queued work
        assert dev.syncs == Counter({"h2d wait": 1})
        assert a.tolist() == [[1.0, 1.0, 1.0], [4.0, 5.0, 6.0]]
        assert int(a[1, 0]) == 4 and bool(a.any()) and a.sum().item() == 18.0
        assert not is_fake(a.cpu()) and is_fake(a[a > 4])
        assert is_fake(torch.tensor([1, 2], device="cuda"))  # a blocking copy too
        reads = {"tolist": 1, "int": 1, "bool": 1, "item": 1, "to host": 1, "mask index": 1}
        assert dev.syncs == Counter({**reads, "h2d wait": 2})
    with FakeCuda(), torch.no_grad():  # outside inference mode too
        b = torch.zeros(2, 3, device="cuda")
        assert is_fake(torch.where(b > 0, b, 0.0)) and is_fake(b.new_zeros(2))
        assert is_fake(torch.nn.utils.rnn.pad_sequence([b, b[:1]], batch_first=True))


def test_a_device_cache_keeps_its_lengths_on_the_host_and_still_refuses_overflow():
    spec = LlamaSpec(64, 8, 16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                     rms_norm_eps=1e-6, rope_theta=1e4, max_positions=8)  # fmt: skip
    new = torch.zeros(1, 2, 1, 4, 8)  # [L, n, H, T, D]
    index = torch.arange(4).expand(2, 4)
    with FakeCuda() as dev, torch.inference_mode():
        cache = KVCache(spec, 1, 2, 6, torch.float32, "cuda")
        new, index = new.cuda(), index.cuda()
        cache.truncate(0, [0, 0])
        dev.reset()
        cache.append(new, new, index, torch.tensor([4, 2]))  # counts on the host: known there
        assert cache.prefix_length(0, 2) == 4 and dev.total == 0
        with pytest.raises(ValueError, match="KV cache full"):  # refused before writing
            cache.append(new, new, index, torch.tensor([3, 0]))
        # Counts on the device: the next read refreshes the host lengths, one wait.
        cache.append(new, new, index, torch.tensor([0, 3]).to("cuda", non_blocking=True))
        assert cache.prefix_length(0, 2) == 5 and dev.syncs == Counter({"tolist": 1})
        cache.append(new, new, index, torch.tensor([3, 0]).cuda())  # 7 > 6: found when read
        with pytest.raises(ValueError, match="KV cache full"):
            cache.prefix_length(0, 2)


# ------------------------------------------------------------------------------ token draft
@pytest.mark.parametrize("method", [*METHODS, PLAIN, AUTO])
def test_every_method_decodes_on_the_device_as_on_the_cpu(tiny, method):
    cpu, fake = tiny
    expected = run_cpu(cpu, requests([method] * 3))
    out, per_step, sites = run_fake(fake, requests([method] * 3))
    assert out == expected
    assert max(per_step) <= HOST_SYNCS_PER_STEP, (per_step, sites)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_draft_token_outside_the_vocabulary_fails_its_step_within_the_one_sync(device):
    """The draft tokens' range rides on the verdict's one copy to the host: the step fails
    naming the row, and nothing indexed past a table on the way (the tokens were clamped; on
    a GPU that is a device-side assert, which ends the process's CUDA context)."""
    common = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, max_sessions=1, packed=False)
    with FakeCuda() as dev:
        engine, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device=device, **common)
        draft = engine.executor.draft
        propose = draft.propose

        def past_the_vocabulary(*args, **kwargs):
            x, q = propose(*args, **kwargs)
            x = x.clone()
            x[1, 0, 1] = q.shape[-1]  # row 1's second token: one past the last id
            return x, q

        draft.propose = past_the_vocabulary
        for r in requests(["block"] * 3):
            engine.add(r)
        engine._admit()
        dev.reset()
        with pytest.raises(ValueError, match=r"tokens outside the vocabulary \(rows \[1\]\)"):
            engine.step()
        assert dev.total <= HOST_SYNCS_PER_STEP, dev.sites


def test_a_mixed_batch_decodes_on_the_device_as_on_the_cpu(tiny):
    cpu, fake = tiny
    methods = ["block", "spectr_gbv", PLAIN, "traversal"]
    expected = run_cpu(cpu, requests(methods))
    out, per_step, sites = run_fake(fake, requests(methods))
    assert out == expected
    assert max(per_step) <= HOST_SYNCS_PER_STEP, (per_step, sites)


def test_replayed_forwards_decode_on_the_device_with_no_more_host_syncs(tiny):
    """The decode forwards replayed from static buffers (workers/graphs.py, emulated: capture
    needs a GPU) on the device: the CPU's tokens, and within the same host-sync bound (a graph
    replays without reading the host; choosing one reads only the host's lengths)."""
    cpu, _ = tiny
    common = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, max_sessions=1, packed=False)
    with FakeCuda():
        fake, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device="cuda", **common)
        fake.draft.use_graphs(emulate=True)
        fake.target.use_graphs(emulate=True)
    methods = ["block", "spectr_gbv", PLAIN, "traversal"]
    expected = run_cpu(cpu, requests(methods))
    out, per_step, sites = run_fake(fake, requests(methods))
    assert out == expected
    assert fake.draft.forward.replays > 0 and fake.target.forward.replays > 0
    assert max(per_step) <= HOST_SYNCS_PER_STEP, (per_step, sites)


# Kernels a graphed speculative step launches eagerly, at most (FakeCuda.kernels; a graph's
# replay is one): the step's graphs (the pending run's forward, the proposal past it, the
# tree's build, the tree pass, a verify call), the copies into their buffers, and what runs
# between them (three KV appends, the target's processing of its rows, the sampling
# settings' and the verdict's copies; a carrying method's records are in its verify graph).
# The tiny pair measures 70 at T = 1 (84 carrying; scripts/count_launches.py), 77-95 (91-109
# carrying) with these tests' mixed settings (temperature, top-k, greedy rows); with the
# proposal's depths eager, 163-203.
GRAPHED_STEP_LAUNCHES = 120


def launches_per_step(engine, reqs: list[GenerationRequest]) -> list[int]:
    """Kernels each step launches eagerly, past the first two (their graphs' captures)."""
    per_step = []
    with FakeCuda() as dev:
        for r in reqs:
            engine.add(r)
        while engine.active or engine.waiting:
            dev.reset()
            engine.step()
            per_step.append(dev.launches)
    return per_step[2:]


def test_a_graphed_step_launches_few_kernels_outside_its_graphs(tiny):
    """On a GPU a step's cost is its launches: with the graphs, a speculative step of any
    verifier launches at most GRAPHED_STEP_LAUNCHES kernels eagerly, and the bound fails
    when the draft's proposal runs its depths eagerly."""
    common = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, packed=False)
    with FakeCuda():
        fake, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device="cuda", **common)
        fake.draft.use_graphs(emulate=True)
        fake.target.use_graphs(emulate=True)
    for method in ("block", "gbv", "traversal", "greedy_block", "spectr_gbv"):
        per_step = launches_per_step(fake, requests([method] * 3, gamma=4, new=24))
        assert per_step and max(per_step) <= GRAPHED_STEP_LAUNCHES, (method, per_step)
    fake.draft.proposals = None
    per_step = launches_per_step(fake, requests(["block"] * 3, gamma=4, new=24))
    assert min(per_step) > GRAPHED_STEP_LAUNCHES, per_step  # 163-203


def test_a_session_follow_up_decodes_on_the_device_as_on_the_cpu(tiny):
    cpu, fake = tiny

    def on_fake(engine, reqs):
        out, per_step, sites = run_fake(engine, reqs)
        assert max(per_step) <= HOST_SYNCS_PER_STEP, (per_step, sites)
        return out

    def session(engine, run) -> tuple:
        first = make_request(
            engine.limits, [3, 1, 4, 1, 5], 8, "block", 1, 3, seed=1, session_id="s"
        )
        ((out, _),) = run(engine, [first])
        history = [*first.prompt_ids, *out]  # the follow-up reuses the parked KV of this
        follow = make_request(
            engine.limits, [*history, 9, 2], 8, "specinfer", 3, 3, seed=2, session_id="s"
        )
        ((again, cached),) = run(engine, [follow])
        assert cached > len(first.prompt_ids)
        return out, again, cached, engine.parking.entries["s"].tokens

    assert session(fake, on_fake) == session(cpu, run_cpu)


# ------------------------------------------------------------------------------ feature draft
@pytest.mark.parametrize(
    "methods",
    [
        ["block"] * 2,
        ["spectr", "spectr"],
        ["greedy_block", "token", PLAIN],
        [AUTO, "traversal"],
        # several requests carry records in one group: a request's carry then holds columns
        # that are dead for it but live for a batch-mate (the verdict's `live` must not care)
        ["greedy_block"] * 4,
        ["spectr_gbv"] * 4,
    ],
)
def test_a_feature_draft_decodes_on_the_device_as_on_the_cpu(featured, methods):
    cpu, fake = featured
    expected = run_cpu(cpu, requests(methods, new=12))
    out, per_step, sites = run_fake(fake, requests(methods, new=12))
    assert out == expected
    assert max(per_step) <= HOST_SYNCS_PER_STEP, (per_step, sites)


# ------------------------------------------------------------------------------ mutants
def mutate(monkeypatch, owner, name: str, old: str, new: str, *also) -> None:
    """Install owner.name with `old` replaced by `new` in its source (in owner and in `also`,
    modules that imported it by name)."""
    fn = getattr(owner, name)
    module = sys.modules[fn.__module__]
    source = textwrap.dedent(inspect.getsource(fn))
    assert source.count(old) == 1, f"{name}: the mutated line moved; update this test"
    namespace = dict(vars(module))
    source = "from __future__ import annotations\n" + source.replace(old, new)  # as the module
    exec(compile(source, module.__file__, "exec"), namespace)
    for target in (owner, *also):
        monkeypatch.setattr(target, name, namespace[name])


DROPPED_MOVES = {
    # the draft keys and root positions its uniforms hash, made on the host by the engine
    "DraftProposer.propose": (
        DraftProposer,
        "propose",
        "draft_uniforms(draws, k, gamma).to(self.device, non_blocking=True)",
        "draft_uniforms(draws, k, gamma)",
        (),
    ),
    # a cache's positions and counts, made on the host
    "KVCache.append": (
        KVCache,
        "append",
        "made = torch.tensor(rows).to(lengths.device, non_blocking=True)",
        "made = torch.tensor(rows)",
        (),
    ),
    # the pending tokens' positions and counts, made on the host
    "DraftProposer._run_pending": (
        DraftProposer,
        "_run_pending",
        ").to(dev, non_blocking=True)  # [n, P + 2]",
        ")",
        (),
    ),
}


@pytest.mark.parametrize("mutant", DROPPED_MOVES)
def test_a_dropped_move_fails_as_on_a_gpu(tiny, monkeypatch, mutant):
    _, fake = tiny
    owner, name, old, new, also = DROPPED_MOVES[mutant]
    mutate(monkeypatch, owner, name, old, new, *also)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        run_fake(fake, requests(["block"]))
    with FakeCuda():  # leave the shared engine empty
        while fake.active:
            fake.cancel(fake.active[-1].request_id)


def test_a_buffer_left_on_the_host_fails_the_sync_bound(tiny, monkeypatch):
    """verify_step's emitted-token buffer of a mixed batch on the host: CUDA copies each
    group's tokens back (legal, so no error), one wait more a group; the bound sees it."""
    _, fake = tiny
    mutate(
        monkeypatch,
        workers.step,
        "verify_step",
        "tokens = torch.full((n, plan.max_gamma + 1), -1, dtype=torch.int64, device=dev)",
        "tokens = torch.full((n, plan.max_gamma + 1), -1, dtype=torch.int64)",
    )
    _, per_step, sites = run_fake(fake, requests(["block", PLAIN]))
    assert max(per_step) > HOST_SYNCS_PER_STEP
    assert any("verify_step" in site for site in sites)


# ------------------------------------------------------------------------------ Ray actors
def wire(obj):
    """What a link (workers/channel.py) makes of obj on the other side: the same, with every
    tensor on the host."""
    return channel.loads(channel.dumps(obj))


class WiredDraft:
    """RemoteDraft in process: its DraftActor's calls, arguments through the wire."""

    device = torch.device("cpu")  # the wire's side: the host
    feed = TokenFeed()  # the tiny pair's draft
    speculating = False  # the actor keeps no speculation cache

    def __init__(self, actor):
        self.actor = actor

    def prefill(self, *args) -> None:
        self.actor.call("prefill", wire(args))

    def move(self, src: int, dst: int) -> None:
        self.actor.call("move", (src, dst))

    def graphs(self, strict=None, sealed=None) -> list:
        return wire(self.actor.graphs(strict, sealed))


class WiredTarget(WiredDraft):
    """RemoteTarget in process: one TargetShardActor (rank 0 of 1), as RemoteTarget.speculate
    chains the draft's and the target's messages, every tensor through the wire."""

    def speculate(self, draft, step):
        drafted = wire(draft.actor.propose(wire(step))) if step.drafted else None
        x, verdict, seconds = wire(self.actor.speculate(wire(step.for_target()), drafted))
        if step.drafted:  # rank 0's word to the draft: what it verified
            draft.actor.call("keep", wire((step, verdict.path, verdict.num_accepted, verdict.live)))
        return x, verdict, seconds


@pytest.fixture(scope="module")
def wired():
    return wired_engine()


def wired_engine(graphs: bool = False) -> SpeculativeEngine:
    """The tiny pair as Ray's draft and target actors on the fake device, called in process
    (their classes without Ray), every argument and result through a link's serialization;
    with `graphs`, on the fake device that captures (their decode graphs on)."""
    with pytest.MonkeyPatch.context() as patch, FakeCuda(graphs=graphs):
        patch.setattr(actors, "use_numpy_wire", lambda: None)  # Ray's serializer: not here
        slots, dtype, threads = MAX_BATCH + 1, "float32", 1
        draft = actors.DraftActor.__ray_metadata__.modified_class(
            str(TINY_DRAFT), slots, MAX_LEN, dtype, "cuda", threads
        )
        target = actors.TargetShardActor.__ray_metadata__.modified_class(
            str(TINY_TARGET), 0, 1, slots, MAX_LEN, dtype, "cuda", threads
        )
    assert is_fake(target.shard.worker.cache.k) and is_fake(draft.worker.cache.k)
    vocab = target.shard.worker.model.spec.vocab_size
    executor = actors.RemoteRunner(WiredDraft(draft), WiredTarget(target))
    return SpeculativeEngine(executor, MAX_BATCH, MAX_LEN, vocab, max_sessions=1)


@pytest.mark.parametrize(
    "methods", [["block"] * 3, ["spectr"] * 3, ["greedy_block"] * 3, ["block", PLAIN, "gbv"]]
)
def test_the_ray_actors_decode_on_the_device_as_the_cpu_engine(tiny, wired, monkeypatch, methods):
    """Over Ray every tensor arrives on the host; the actors move what they get (the carried
    records of greedy_block come back from the coordinator each step)."""
    cpu, _ = tiny
    expected = run_cpu(cpu, requests(methods))
    out, per_step, sites = run_fake(wired, requests(methods))
    assert out == expected
    # As in process (HOST_SYNCS_PER_STEP: rank 0 verifies), and the draft actor sends x and q back
    # (2); carried records travel to the coordinator as 3 tensors a request (and back, waiting
    # for nothing).
    carrying = [m for m in methods if m in VERIFIERS and VERIFIERS[m].modifies_target]
    bound = 2 + HOST_SYNCS_PER_STEP + 3 * len(carrying)
    assert max(per_step) <= bound, (per_step, sites)
