"""What the two draft proposers share: the KV cache, prefill, and the propose/commit loop.

A draft worker is a *proposer*: a token draft (workers/token_draft.py) or a feature draft
(EAGLE; workers/feature_draft.py), one per file, each a `DraftProposer` with its host-side
`feed` (workers/protocols.py: what the engine feeds it and what it keeps). `build_proposer`
gives a draft model the one it needs.

Each request drafts its own K paths of its own γ tokens (0 and 0 for a plain request that only
catches its cache up): the batch runs as [n, max K, max γ] tensors. Its uniforms are
counter-based (workers/sampling.py: a hash of its draft key, the step's root position, path and
depth), so what it drafts depends neither on its batch-mates nor on when it is drafted.

The cache holds each request's committed tokens except its *pending* ones (not yet run through
the draft). A proposal first runs the pending tokens (they become committed), then samples K
tokens from the root row and extends the K paths for γ - 1 more forwards; the paths' own
keys/values live in a per-step suffix (the shared prefix is never copied), and `commit` moves
the accepted path's entries into the cache. The proposers differ in what each forward reads
beside its token (`_pending_features`, `_next_features`) and in what `commit` keeps beside
the path's entries (`_keep_path_state`).

The prefill helpers at the end serve both workers (the target's too: workers/target.py).
"""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from blockspec.workers.compiled import CompiledCalls, CompiledForward, compile_forward
from blockspec.workers.graphs import CallGraphs, ForwardGraphs, prefix_window
from blockspec.workers.llama import KVCache, Linear, Llama, packs_weights
from blockspec.workers.protocols import DraftFeed
from blockspec.workers.sampling import (
    Law,
    SamplingParams,
    apply_law,
    downweight_top,
    draft_uniforms,
    law_of,
    sample_drafts,
)

# The pending run's least width with graphs: a step leaves 1 pending token, or 2 after a whole
# path is accepted, and one width is one graph, which warm-up captures for sure (its steps
# need not accept a path whole) rather than the second width capturing mid-stream.
GRAPHED_PENDING = 2


def _widened(
    pending: torch.Tensor,  # [n, P] int64
    features: torch.Tensor | None,  # [n, P, E]
    width: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pending tokens (and features) padded to `width` columns, as a batch's shorter rows
    are: the padding is past each row's count, seen by nothing and never committed."""
    pad = width - pending.shape[1]
    pending = torch.nn.functional.pad(pending, (0, pad))
    if features is not None:
        features = torch.nn.functional.pad(features, (0, 0, 0, pad))
    return pending, features


class DraftProposer(ABC):
    """A draft model with its KV cache: propose K paths of γ tokens per request, commit one."""

    feed: DraftFeed  # the proposer's kind, host side (set by each subclass)

    def __init__(
        self, model: Llama, max_batch: int, max_len: int, dtype=torch.float32, device="cpu"
    ):
        self.model = model
        self.cache = KVCache(model.spec, model.kv_heads, max_batch, max_len, dtype, device)
        # the decode step's forwards (see use_graphs, use_compiled)
        self.forward: Llama | ForwardGraphs | CompiledForward = model
        # the paths past the root as one call (see use_graphs, use_compiled)
        self.proposals: CallGraphs | CompiledCalls | None = None
        self._suffix: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, n, K, H, γ-1, D]
        # [n, K, γ, E]: a feature draft's own feature after each depth of the step's paths
        # (depth 0: the root's), what `commit` keeps of the accepted one; None: a token draft
        self._own_paths: torch.Tensor | None = None
        # Saguaro sampling (workers/sampling.downweight_top): (count, factor), or None: the
        # draft's law is its processed rows as they are
        self.downweight: tuple[int, float] | None = None
        # Keep `beliefs` [n, K, γ, V] beside each proposal: the draft's rows at temperature 1
        # before the requests' processing (what the speculation cache ranks a greedy request's
        # recovered tokens by: its processed rows are one-hot)
        self.keep_beliefs = False
        self.beliefs: torch.Tensor | None = None
        self._beliefs: list[torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        """Where the model and cache live; inputs may arrive from anywhere (moved once here)."""
        return self.cache.lengths.device

    def use_graphs(self, emulate: bool = False, compiled: bool = False) -> None:
        """Replay the pending run's forward, and the whole proposal past it, from CUDA graphs
        (workers/graphs.py; a fork's forwards, over its own cache, stay eager), their forwards
        compiled by torch.compile with `compiled` (workers/compiled.py)."""
        # Their outputs are views of the graphs' own (no copy, a launch each): a step reads
        # them before the next propose replays (the pending run's go into the cache and the
        # root; the proposal's into the tree and the verify call's buffers, and `commit`).
        captured = compile_forward(self.model) if compiled else None
        self.forward = ForwardGraphs(
            self.model, self.cache, emulate, copies=False, captured=captured
        )
        self.proposals = CallGraphs(self.cache.k.shape[1], emulate, copies=False)

    def use_compiled(self) -> None:
        """Run the pending run's forward, and the whole proposal past it, through torch.compile
        (workers/compiled.py; a fork's, over its own cache, stay eager). The head, which
        every depth multiplies by eagerly (the draft's forwards read no logits), is packed
        again where Llama would pack it: the compiled graphs never read it."""
        self.forward = CompiledForward(self.model, self.cache)
        self.proposals = CompiledCalls(self.device)
        head = self.model.lm_head
        if not head.packed and packs_weights(head.weight):
            self.model.lm_head = Linear(head.weight, head.bias, packed=True)

    def prefill(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int] | None = None,
        features: list[torch.Tensor] | None = None,  # feature draft: [T_i, E] one position back
    ) -> None:
        """Commit new requests' contexts (all but their pending tokens) into slots slot0..,
        after the first keep[i] tokens a slot already holds (see :func:`prefill`)."""
        prefill(self.model, self.cache, slot0, contexts, keep, features)

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    @abstractmethod
    def _pending_features(
        self,
        features: torch.Tensor | None,  # [n, P, E] on the device, or None
        own: torch.Tensor | None,  # [n] bool, or None
        pending_count: torch.Tensor,  # [n] int64 on the device
    ) -> torch.Tensor | None:
        """What the pending tokens' forward reads beside them: [n, 1, P, E], or None."""

    @abstractmethod
    def _next_features(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """What the next depth reads beside its token, given this depth's output [n, K, 1, E]
        (depth 0: the root's, the same for every path); None: nothing."""

    @abstractmethod
    def _keep_path_state(self, rows: torch.Tensor, path: torch.Tensor, keep: torch.Tensor) -> None:
        """What the proposer keeps of the accepted paths beside their cache entries."""

    @torch.inference_mode()
    def propose(
        self,
        pending: torch.Tensor,  # [n, P] int64, padded
        pending_count: torch.Tensor,  # [n] int64 in [1, P]
        paths: list[int],  # per request: its K (0: a plain request, nothing drafted)
        depths: list[int],  # per request: its γ (0 likewise)
        params: list[SamplingParams],
        draws: torch.Tensor,  # [n, 2] int64: (draft key, the step's root position) per request
        pending_features: torch.Tensor | None = None,  # [n, P, E]: feature draft, one back
        whole_vocab: bool = True,  # False: rows on the head's ids only, [n, K, γ, Vh]
        own: torch.Tensor | None = None,  # [n] bool, feature draft: the row's single pending
        # token reads the draft's own feature kept by `commit` (its pending_features unread)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [n, K, γ] and the processed rows they were sampled from [n, K, γ, V]
        (K, γ the batch's largest; entries past a request's own K or γ are never read).

        A reduced head (head_vocab) gives a row zero probability outside its ids, so rows are
        processed and sampled on the head's Vh ids (temperature, top-k, top-p and the draw
        depend only on the tokens with finite logits) and widened to V once, at the end.

        With graphs (`use_graphs`), everything past the pending tokens' run (every depth's
        forward, law and draw) replays from one CUDA graph per (batch bucket, K, γ, prefix
        window, the law's steps); compiled (`use_compiled`), it runs as one compiled call."""
        n = pending.shape[0]
        k, gamma = max(paths), max(depths)
        # Hashed where the draws are (the engine's: the host), then one copy: on a GPU the
        # hash's ~40 small kernels would each cost a launch; the bits are the same anywhere.
        uniforms = draft_uniforms(draws, k, gamma).to(self.device, non_blocking=True)
        law = law_of(params, self.model.lm_head.shape[0], self.device)  # on the head's Vh ids
        root = self._run_pending(pending, pending_count, pending_features, own)  # [n, E]
        inputs = (root, uniforms, self.cache.lengths[:n], *law.tensors)
        shape = dict(k=k, gamma=gamma, whole_vocab=whole_vocab, law=law)
        self._beliefs = [] if self.keep_beliefs else None
        if self.proposals is not None and self._beliefs is None:
            window = prefix_window(self.cache, n)
            key = ("paths", k, gamma, window, law.steps, whole_vocab, self.downweight)
            forward = functools.partial(self.forward.captured, window=window)
            draft = functools.partial(self._paths, forward=forward, **shape)
            tokens, q, suffix, self._own_paths = self.proposals.run(key, draft, *inputs)
        else:
            tokens, q, suffix, self._own_paths = self._paths(*inputs, forward=self.forward, **shape)
        # [L, n, K, H_kv, γ-1, D] k, v of the paths' run tokens (batch-first out of _paths)
        self._suffix = None if suffix is None else tuple(t.transpose(0, 1) for t in suffix)
        if self._beliefs is not None:
            self._beliefs[0] = self._beliefs[0].expand(n, k, -1)
            self.beliefs = self.model.to_vocab(torch.stack(self._beliefs, dim=2), 0.0)
        return tokens, q

    def _paths(
        self,
        root: torch.Tensor,  # [n, E]: the root's hidden state (after the pending tokens)
        uniforms: torch.Tensor,  # [n, K, γ] float64
        base: torch.Tensor,  # [n] int64: committed lengths (the root's position + 1)
        *law_tensors: torch.Tensor,  # the law's tensors, [n] each (Law.tensors)
        forward,  # Llama.forward or the forward graphs
        k: int,
        gamma: int,
        whole_vocab: bool,
        law: Law,  # its steps (its tensors come in law_tensors)
    ) -> tuple:
        """Draft K paths of γ tokens past each root, every tensor batch-first (a graph's
        outputs): tokens [n, K, γ], their rows [n, K, γ, V or Vh], the run tokens' keys and
        values ([n, L, K, H_kv, γ-1, D] each; None when γ = 1) and, for a feature draft, its
        own feature after each depth [n, K, γ, E] (depth 0: the root's), else None."""
        n = root.shape[0]
        law = law.on(list(law_tensors))
        head_vocab = self.model.head_vocab

        def draw(rows: torch.Tensor, depth: int) -> torch.Tensor:  # [n, K, Vh] -> ids [n, K]
            picked = sample_drafts(rows, uniforms[:, :, depth])
            return picked if head_vocab is None else head_vocab[picked]

        # a feature draft's output at the root stands in for the target's there
        own = [root[:, None, None].expand(n, k, 1, -1)]
        feats = self._next_features(own[0])
        q_root = self._law(self.model.head_logits(root)[:, None], law)  # [n, 1, Vh]
        rows = [q_root.expand(n, k, -1)]
        tokens = [draw(rows[0], 0)]  # [n, K]
        ks, vs = [], []
        ones = torch.ones(n, k, 1, 1, dtype=torch.bool, device=root.device)
        for i in range(1, gamma):
            suffix = (torch.cat(ks, dim=4), torch.cat(vs, dim=4)) if ks else None
            pos = (base + i - 1)[:, None, None].expand(n, k, 1)
            _, nk, nv, hidden = forward(
                tokens[-1][:, :, None], pos, self.cache, ones, suffix, features=feats, head=False
            )
            own.append(hidden)
            feats = self._next_features(hidden)
            ks.append(nk)
            vs.append(nv)
            rows.append(self._law(self.model.head_logits(hidden[:, :, 0]), law))
            tokens.append(draw(rows[-1], i))
        q = torch.stack(rows, dim=2)  # [n, K, γ, Vh]
        suffix = None
        if ks:
            suffix = tuple(torch.cat(t, dim=4).transpose(0, 1) for t in (ks, vs))
        return (
            torch.stack(tokens, dim=2),
            self.model.to_vocab(q, 0.0) if whole_vocab else q,
            suffix,
            torch.cat(own, dim=2) if self.feed.reads_features else None,
        )

    def _law(self, logits: torch.Tensor, law: Law) -> torch.Tensor:
        """The rows the draft samples from and reports: [n, R, Vh] logits processed with each
        request's settings, then downweighted where Saguaro sampling is on."""
        if self._beliefs is not None:
            self._beliefs.append(logits.float().softmax(-1))
        rows = apply_law(logits, law)
        return rows if self.downweight is None else downweight_top(rows, *self.downweight)

    def _run_pending(
        self,
        pending: torch.Tensor,  # [n, P] int64, padded
        pending_count: torch.Tensor,  # [n] int64 in [1, P]
        features: torch.Tensor | None,  # [n, P, E]
        own: torch.Tensor | None,  # [n] bool
    ) -> torch.Tensor:
        """Run and commit the pending tokens; returns the last one's hidden state [n, E]."""
        if isinstance(self.forward, ForwardGraphs) and pending.shape[1] < GRAPHED_PENDING:
            pending, features = _widened(pending, features, GRAPHED_PENDING)
        n, P = pending.shape
        dev = self.device
        counted = pending_count.cpu()  # the engine's is on the host; the cache keeps it there
        # Positions, each row's causal mask over its count (padding sees only itself) and
        # where its last token is, made on the host, where the counts and the committed
        # lengths are, and copied at once: on a GPU each op making them there is a launch.
        steps = torch.arange(P)
        seen = torch.ones(P, P, dtype=torch.bool).tril() & (
            (steps[None, :] < counted[:, None, None]) | torch.eye(P, dtype=torch.bool)
        )  # [n, P, P]
        held = torch.tensor(self.cache.host_lengths()[:n])
        made = torch.cat(
            [held[:, None] + steps, counted[:, None], torch.arange(n)[:, None]], dim=1
        ).to(dev, non_blocking=True)  # [n, P + 2]
        positions, count, rows = made[:, :P], made[:, P], made[:, P + 1]
        pending = pending.to(dev, non_blocking=True)
        if features is not None:
            features = features.to(dev, non_blocking=True)
        _, new_k, new_v, hidden = self.forward(
            pending[:, None], positions[:, None], self.cache,
            seen.to(dev, non_blocking=True)[:, None],
            features=self._pending_features(features, own, count), head=False,
        )  # fmt: skip
        self.cache.append(new_k[:, :, 0], new_v[:, :, 0], None, counted)
        return hidden[rows, 0, count - 1]

    def fork(self, rows: list[int], room: int) -> DraftProposer:
        """A proposer over the same model whose slot i holds a copy of this one's slot rows[i]
        (a slot may repeat) and of its rows of the current proposal's path entries, with
        `room` positions past the longest: where the speculation cache drafts for a
        hypothesised prefix, leaving this proposer's state as it is (workers/speculation.py).
        A feature draft also copies its own features (FeatureDraft.fork)."""
        forked = copy.copy(self)  # the model shared
        forked.proposals = None  # captured over this proposer's cache
        held = self.cache.host_lengths()
        max_len = max(held[r] for r in rows) + room
        dtype = self.cache.k.dtype
        forked.cache = KVCache(
            self.model.spec, self.model.kv_heads, len(rows), max_len, dtype, self.device
        )
        forked.cache.copy_slots(self.cache, rows, list(range(len(rows))))
        if self._suffix is not None:
            index = torch.tensor(rows).to(self.device, non_blocking=True)
            forked._suffix = tuple(t.index_select(1, index) for t in self._suffix)
        return forked

    def adopt(self, parts: list[tuple[DraftProposer, list[int], list[int]]], gamma: int) -> None:
        """Take proposals made in forks as this proposer's own: for each (fork, its rows,
        slots), slot slots[j] gets the fork's row j cache entries and its proposal's path
        entries, as if it had proposed here with the step's largest γ `gamma` (the next
        `commit` keeps the accepted path's run tokens: at most γ - 1, what the engine counts)."""
        n = sum(len(slots) for _, _, slots in parts)
        suffixes = [(f._suffix, rows, slots) for f, rows, slots in parts if f._suffix is not None]
        for fork, rows, slots in parts:
            self.cache.copy_slots(fork.cache, rows, slots)
        self._suffix = None
        if not suffixes or gamma < 2:
            return
        # the batch's widest proposal: a slot's entries past its own K and γ are never read
        shape = [max(sfx[0].shape[d] for sfx, _, _ in suffixes) for d in range(6)]
        shape[1], shape[4] = n, gamma - 1
        kept = [torch.zeros(shape, dtype=self.cache.k.dtype, device=self.device) for _ in "kv"]
        for (sk, sv), rows, slots in suffixes:
            index = torch.tensor(rows).to(self.device, non_blocking=True)
            into = torch.tensor(slots).to(self.device, non_blocking=True)
            k, width = sk.shape[2], min(sk.shape[4], gamma - 1)
            for whole, part in zip(kept, (sk, sv), strict=True):
                whole[:, into, :k, :, :width] = part.index_select(1, index)[:, :, :, :, :width]
        self._suffix = (kept[0], kept[1])

    def commit(self, path: torch.Tensor, keep: torch.Tensor) -> None:
        """Append the first keep[i] draft tokens of each request's accepted path, of those that
        were run (at most γ - 1), and what the proposer keeps beside them (`feed.kept` says
        how many each keeps)."""
        n, dev = path.shape[0], self.device
        path = path.to(dev, non_blocking=True)
        rows = torch.arange(n, device=dev)
        self._keep_path_state(rows, path, keep)
        if self._suffix is None:
            return
        sk, sv = self._suffix
        k_path, v_path = sk[:, rows, path], sv[:, rows, path]  # [L, n, H, γ-1, D]
        # keep stays where it arrived: the cache reads the counts on the host
        self.cache.append(k_path, v_path, None, keep.clamp_max(sk.shape[4]))
        self._suffix = None


# Contexts prefilled together are padded to the longest; consecutive ones run as one batch
# while that padding stays within this share of their real tokens. Joining prompts differ
# (HumanEval chat prompts: 100-400 tokens), and one padded batch of them can compute twice their
# real tokens, while on CPU batching saves little per token.
PREFILL_PADDING = 0.25


def padding_groups(lengths: list[int], slack: float = PREFILL_PADDING) -> list[tuple[int, int]]:
    """Consecutive runs [lo, hi) of contexts whose padded size (count x longest) is at most
    (1 + slack) x their tokens."""
    groups, lo = [], 0
    for i in range(1, len(lengths) + 1):
        run = lengths[lo : i + 1]
        if i == len(lengths) or len(run) * max(run) > (1 + slack) * sum(run):
            groups.append((lo, i))
            lo = i
    return groups


def prefill(
    model: Llama,
    cache: KVCache,
    slot0: int,
    contexts: list[torch.Tensor],  # [T_i] int64 each
    keep: list[int] | None = None,  # cached tokens kept per slot (a warm session); None: 0
    features: list[torch.Tensor] | None = None,  # [T_i, E] each: a feature draft's input
) -> list[torch.Tensor]:
    """Slot slot0 + i keeps its first keep[i] cached tokens and appends contexts[i] after them
    (both workers). keep = 0 is a fresh prefill; contexts of similar length run batched, with
    padding (:func:`padding_groups`). Returns each context's features [T_i, E] (what a feature
    draft reads of the target)."""
    groups = prefill_groups(model, cache, slot0, contexts, keep, features)
    return [f for group in groups for f in group]


@torch.inference_mode()
def prefill_groups(
    model: Llama,
    cache: KVCache,
    slot0: int,
    contexts: list[torch.Tensor],  # [T_i] int64 each
    keep: list[int] | None = None,
    features: list[torch.Tensor] | None = None,
) -> Iterator[list[torch.Tensor]]:
    """:func:`prefill`, one padding group at a time: yields the features [T_i, E] of the
    contexts of each group of ``padding_groups`` (in order) once that group is in the cache."""
    n = len(contexts)
    cache.truncate(slot0, keep if keep is not None else [0] * n)
    for lo, hi in padding_groups([c.shape[0] for c in contexts]):
        group_features = None if features is None else features[lo:hi]
        yield _prefill_batch(model, cache, slot0 + lo, contexts[lo:hi], group_features)


def _prefill_batch(
    model: Llama,
    cache: KVCache,
    slot0: int,
    contexts: list[torch.Tensor],  # [T_i] int64 each, appended after each slot's cache
    features: list[torch.Tensor] | None,  # [T_i, E] each
) -> list[torch.Tensor]:
    """One padded forward over the contexts (no logits: nothing reads them)."""
    n = len(contexts)
    dev = cache.lengths.device
    T = max(c.shape[0] for c in contexts)
    if T == 0:
        return [torch.zeros(0, model.spec.hidden_size, device=dev) for _ in contexts]
    kept = cache.lengths[slot0 : slot0 + n].clone()
    counted = torch.tensor([c.shape[0] for c in contexts])  # on the host: see KVCache
    counts = counted.to(dev, non_blocking=True)
    # Padded where the contexts are (the engine's: on the host), then moved at once.
    tokens = torch.zeros(n, T, dtype=torch.int64, device=contexts[0].device)
    for i, c in enumerate(contexts):
        tokens[i, : c.shape[0]] = c
    tokens = tokens.to(dev, non_blocking=True)
    steps = torch.arange(T, device=dev)
    # Causal; padded positions see themselves only (keeps their softmax finite, never read).
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril() & (
        (steps[None, :] < counts[:, None, None]) | torch.eye(T, dtype=torch.bool, device=dev)
    )
    positions = (kept[:, None] + steps)[:, None]  # [n, 1, T]
    feats = None
    if features is not None:
        feats = torch.zeros(n, 1, T, model.spec.hidden_size, device=dev)
        for i, f in enumerate(features):  # over Ray from the host: copied without waiting
            feats[i, 0, : f.shape[0]] = f.to(dev, non_blocking=True)
    _, k, v, hidden = model(
        tokens[:, None], positions, cache, mask[:, None], slot0=slot0, features=feats, head=False
    )
    cache.append(k[:, :, 0], v[:, :, 0], None, counted, slot0=slot0)
    return [hidden[i, 0, : c.shape[0]] for i, c in enumerate(contexts)]
