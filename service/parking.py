"""Parked KV: finished requests' cache entries kept in spare slots. The workers' caches hold
max_batch + max_sessions slots: [0, max_batch) belong to active requests, the rest to parked
entries. This module keeps the books; the engine (service/engine.py) moves the slots' contents.

Sessions: a request with a ``session_id`` parks its KV entries in one of ``max_sessions`` spare
cache slots when it finishes (least recently parked evicted first). The session's next request
(its prompt = the history + new tokens) takes the slot back and prefills only the tokens past the
longest cached prefix that still matches; KV of tokens generated past a stop is dropped.

Automatic prefix caching: a request without a session but with a ``cache_scope`` (the caller's
principal) parks its KV in the same spare slots, and a later request of the same scope takes
the parked entry whose tokens share the longest prefix with its prompt (a stateless client that
sends the whole conversation each turn reuses the last turn's KV). One LRU order evicts both
kinds; one scope's entries never serve another's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from blockspec.service.requests import GenerationRequest

# A parked prefix is taken only for at least this many shared tokens: fewer save less prefill
# than moving the slot costs, and would evict the entry for another request's sake.
MIN_SHARED_PREFIX = 16

ParkKey = str | tuple[str, str]  # a session id, or (cache scope, request id)


@dataclass
class Parked:
    """A finished request's KV, kept in a spare slot for its session's next request or, with a
    cache scope, for any request of that scope that shares a prefix with it."""

    slot: int
    tokens: list[int]  # the request's history; the caches hold KV of its first *_len tokens
    draft_len: int
    target_len: int
    scope: str | None = None  # a cached prefix's scope; None: a session's (taken by its id)

    def reusable(self, prompt: Sequence[int]) -> tuple[int, int]:
        """The cached tokens (the draft's, the target's) a request with `prompt` can keep."""
        usable = min(shared_prefix(self.tokens, prompt), len(prompt) - 1)  # the last: pending
        return min(self.draft_len, usable), min(self.target_len, usable)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class Parking:
    """The parked entries (oldest first) and the spare slots no entry holds."""

    def __init__(self, first_slot: int, count: int, prefix_caching: bool = True):
        self.entries: OrderedDict[ParkKey, Parked] = OrderedDict()
        self.free_slots = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.slots = count
        self.prefix_caching = prefix_caching  # requests' cache_scope honoured

    def wants(self, req: GenerationRequest) -> bool:
        """Whether req's KV is parked when it leaves: a session's, or with prefix caching a
        scoped request's (given spare slots at all)."""
        cached = req.cache_scope is not None and self.prefix_caching
        return self.slots > 0 and bool(req.session_id or cached)

    def take(self, req: GenerationRequest) -> Parked | None:
        """The parked KV `req` continues from, out of the entries: its session's, or the entry
        of its cache scope that shares the longest prefix with its prompt (at least
        MIN_SHARED_PREFIX tokens). Its slot is the caller's to `release` once moved."""
        if req.session_id:
            return self.entries.pop(req.session_id, None)
        if req.cache_scope is None or not self.prefix_caching:
            return None
        best, longest = None, MIN_SHARED_PREFIX - 1
        for key, parked in self.entries.items():
            if parked.scope == req.cache_scope:
                same = shared_prefix(parked.tokens, req.prompt_ids)
                best, longest = (key, same) if same > longest else (best, longest)
        return self.entries.pop(best) if best is not None else None

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def reserve(self, req: GenerationRequest, key: ParkKey, history: list[int]) -> int:
        """A slot for req's entry under `key`: what a new entry replaces (the session's old
        one, or the scope's entries that `history` extends) is dropped first, then the least
        recently parked entry if no slot is free."""
        stale = [key] if key in self.entries else []
        if not req.session_id:
            stale = [
                k
                for k, p in self.entries.items()
                if p.scope == req.cache_scope and shared_prefix(p.tokens, history) == len(p.tokens)
            ]
        for k in stale:
            self.release(self.entries.pop(k).slot)
        if not self.free_slots:
            self.release(self.entries.popitem(last=False)[1].slot)
        return self.free_slots.pop()

    def clear(self) -> None:
        """Drop every entry (the caches they were in are gone)."""
        self.free_slots += [parked.slot for parked in self.entries.values()]
        self.entries.clear()
