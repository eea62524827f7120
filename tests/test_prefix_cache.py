"""Automatic prefix caching in the engine (service/engine.py): a request without a session but
with a cache scope reuses the parked KV of its scope's request that shares the longest prefix
with its prompt, never another scope's; entries share the session slots' LRU order; a seeded
request gives the same tokens with and without a cache hit."""

from __future__ import annotations

import pytest

from blockspec.service.build import build_engine
from blockspec.service.parking import MIN_SHARED_PREFIX
from blockspec.service.requests import make_request
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from blockspec.workers.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i) % 97 + 3 for i in range(40)]


def engine(prefix_caching: bool = True, max_sessions: int = 2):
    eng, _ = build_engine(
        str(TINY_DRAFT),
        str(TINY_TARGET),
        max_batch=2,
        max_len=256,
        max_sessions=max_sessions,
        prefix_caching=prefix_caching,
    )
    return eng


def ask(eng, prompt, scope="alice", session=None, new=8, seed=None, sampling=GREEDY):
    req = make_request(
        eng.limits, prompt, new, "block", sampling=sampling, seed=seed,
        session_id=session, cache_scope=scope,
    )  # fmt: skip
    return eng.generate([req])[0]


@pytest.fixture(scope="module")
def shared():
    return engine()


def test_a_scope_reuses_its_longest_prefix_and_never_anothers(shared):
    shared.parking.clear()
    first = ask(shared, PROMPT)
    assert first.cached_tokens == 0
    turn = [*PROMPT, *first.token_ids, 5, 6, 7]
    assert ask(shared, turn, scope="mallory").cached_tokens == 0  # another principal
    second = ask(shared, turn)
    assert second.cached_tokens >= len(PROMPT) + len(first.token_ids) - 1
    # The second turn's entry extends the first's, which it replaced: one entry per
    # conversation, and the third turn reuses all of the second.
    scopes = [p.scope for p in shared.parking.entries.values()]
    assert scopes.count("alice") == 1 and scopes.count("mallory") == 1
    third = ask(shared, [*turn, *second.token_ids, 9])
    assert third.cached_tokens >= len(turn) + len(second.token_ids) - 1


def test_short_shared_prefixes_and_unscoped_requests_are_not_cached(shared):
    shared.parking.clear()
    ask(shared, PROMPT)
    short = [*PROMPT[: MIN_SHARED_PREFIX - 1], 1, 2, 1]  # PROMPT holds no id below 3
    assert ask(shared, short).cached_tokens == 0
    assert ask(shared, [*PROMPT, 1, 2], scope=None).cached_tokens == 0  # no scope: no reuse


def test_entries_and_sessions_share_one_lru_order():
    eng = engine(max_sessions=2)
    ask(eng, PROMPT, session="s1", scope=None)
    ask(eng, [1, *PROMPT])  # two prefixes of alice: the session is the oldest
    ask(eng, [2, *PROMPT])
    assert "s1" not in eng.parking.entries and len(eng.parking.entries) == 2
    assert ask(eng, [1, *PROMPT, 4]).cached_tokens > 0  # the newer entries stayed


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0)])
def test_a_seeded_request_gives_the_same_tokens_with_and_without_a_hit(sampling):
    cold, warm = engine(prefix_caching=False), engine()
    for eng in (cold, warm):
        ask(eng, PROMPT, seed=3, sampling=sampling)
    follow = [*PROMPT, 8, 9, 10]
    miss = ask(cold, follow, seed=4, new=16, sampling=sampling)
    hit = ask(warm, follow, seed=4, new=16, sampling=sampling)
    assert miss.cached_tokens == 0 and hit.cached_tokens >= len(PROMPT)
    assert hit.token_ids == miss.token_ids


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0)])
def test_a_cancelled_request_leaves_its_prefix_with_the_same_seeded_tokens(sampling):
    """A request cancelled between steps (the gateway cut it at a stop string, or its client
    left) parks its KV as a finished one does: the next request over its prefix reuses it and
    gets the tokens it gets without a hit."""
    cold, warm = engine(prefix_caching=False), engine()
    cut = []
    for eng in (cold, warm):
        req = make_request(eng.limits, PROMPT, 40, "block", sampling=sampling, seed=3,
                           cache_scope="alice")  # fmt: skip
        request_id = eng.add(req)
        for _ in range(3):
            eng.step()
        (active,) = eng.active
        cut.append(list(active.output))
        assert eng.cancel(request_id) and not eng.active
    assert cut[0] == cut[1] and len(warm.parking.entries) == 1
    follow = [*PROMPT, *cut[1], 8, 9]
    miss = ask(cold, follow, seed=4, new=16, sampling=sampling)
    hit = ask(warm, follow, seed=4, new=16, sampling=sampling)
    assert miss.cached_tokens == 0 and hit.cached_tokens >= len(PROMPT) + len(cut[1]) - 1
    assert hit.token_ids == miss.token_ids


def test_a_cancel_without_parking_frees_the_slot():
    """park=False (a restart emptied the workers' caches) leaves nothing to reuse."""
    eng = engine()
    request_id = eng.add(make_request(eng.limits, PROMPT, 40, "block", cache_scope="alice"))
    eng.step()
    assert eng.cancel(request_id, park=False) and not eng.parking.entries
