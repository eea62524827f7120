"""Session store: the same behaviour from MemoryStore and from RedisStore on a real redis-server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from blockspec.service.sessions import (
    MemoryStore,
    RedisStore,
    Session,
    SessionStore,
    StoreUnavailableError,
    open_store,
)
from tests.redis_server import free_port


def make_session(session_id: str = "s1", **changes: object) -> Session:
    now = time.time()
    fields: dict[str, object] = {
        "session_id": session_id,
        "tokens": [1, 2, 3, 4],
        "settings": {"method": "gbv", "k": 4, "gamma": 5, "temperature": 0.7, "stop": ["\n"]},
        "replica": "replica-a",
        "kv_length": 3,
        "created": now,
        "updated": now,
        "turns": 1,
    }
    fields.update(changes)
    return Session.model_validate(fields)


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest):
    """A factory for stores of the parametrized backend (with a chosen TTL), closed afterwards."""
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    # A fresh key prefix per test, so tests sharing the one redis-server never see each other.
    prefix = f"test:{uuid.uuid4().hex}:"

    def make(ttl_s: float = 60.0) -> SessionStore:
        if redis_url is None:
            return MemoryStore(ttl_s)
        return RedisStore(redis_url, ttl_s, prefix=prefix)

    return make


@pytest_asyncio.fixture
async def store(make_store) -> AsyncIterator[SessionStore]:
    s = make_store()
    yield s
    await s.close()


@pytest.mark.asyncio
async def test_round_trip(store: SessionStore) -> None:
    assert isinstance(store, SessionStore)
    assert await store.ping() is True
    session = make_session()
    await store.put(session)
    assert await store.get("s1") == session

    updated = session.model_copy(update={"tokens": [*session.tokens, 9], "turns": 2})
    await store.put(updated)
    assert await store.get("s1") == updated


@pytest.mark.asyncio
async def test_defaults_round_trip(store: SessionStore) -> None:
    session = Session(session_id="s2", tokens=[], settings={}, created=1.0, updated=2.0)
    await store.put(session)
    got = await store.get("s2")
    assert got == session
    assert got is not None and got.replica is None and got.kv_length == 0 and got.turns == 0


@pytest.mark.asyncio
async def test_missing_is_none(store: SessionStore) -> None:
    assert await store.get("nope") is None


@pytest.mark.asyncio
async def test_delete(store: SessionStore) -> None:
    await store.put(make_session("a"))
    await store.put(make_session("b"))
    await store.delete("a")
    await store.delete("never-existed")  # not an error
    assert await store.get("a") is None
    assert await store.get("b") is not None


@pytest.mark.asyncio
async def test_returned_copies_are_independent(store: SessionStore) -> None:
    session = make_session()
    await store.put(session)
    session.tokens.append(99)  # mutating what was put ...
    got = await store.get("s1")
    assert got is not None and got.tokens == [1, 2, 3, 4]
    got.tokens.append(100)  # ... or what was returned leaves the stored session alone
    got.settings["k"] = 1
    again = await store.get("s1")
    assert again is not None and again.tokens == [1, 2, 3, 4] and again.settings["k"] == 4


@pytest.mark.asyncio
async def test_expires_after_ttl(make_store) -> None:
    store = make_store(ttl_s=3.0)  # margins of 1.5 s: the CI machine is busy
    try:
        await store.put(make_session())
        assert await store.get("s1") is not None
        await asyncio.sleep(4.5)
        assert await store.get("s1") is None
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_put_refreshes_ttl(make_store) -> None:
    store = make_store(ttl_s=4.0)  # margins of 1.5 s: the CI machine is busy
    try:
        await store.put(make_session())
        await asyncio.sleep(2.5)
        await store.put(make_session(turns=2))
        await asyncio.sleep(2.5)  # 5 s after the first put, 2.5 s after the second
        got = await store.get("s1")
        assert got is not None and got.turns == 2
        await asyncio.sleep(3.0)  # 5.5 s after the second
        assert await store.get("s1") is None
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_memory_store_sweeps_expired_entries() -> None:
    store = MemoryStore(ttl_s=0.2)
    for i in range(5):
        await store.put(make_session(f"old{i}"))
    await asyncio.sleep(0.3)
    await store.put(make_session("new"))
    assert list(store._entries) == ["new"]


@pytest.mark.asyncio
async def test_open_store(redis_url: str) -> None:
    assert isinstance(open_store(None, 10), MemoryStore)
    assert isinstance(open_store("", 10), MemoryStore)
    store = open_store(redis_url, 10)
    try:
        assert isinstance(store, RedisStore)
        assert await store.ping() is True
    finally:
        await store.close()


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        MemoryStore(0)
    with pytest.raises(ValueError, match="ttl_s"):
        RedisStore("redis://127.0.0.1:1/0", -1)


@pytest.mark.asyncio
async def test_unreachable_redis_is_a_clear_error() -> None:
    port = free_port()  # nothing listens there
    store = RedisStore(f"redis://:hunter2@127.0.0.1:{port}/0", ttl_s=10)
    try:
        for call in (store.ping(), store.get("s1"), store.put(make_session()), store.delete("s1")):
            with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}") as info:
                await call
            assert isinstance(info.value, StoreUnavailableError)
            assert "hunter2" not in str(info.value)  # the password stays out of logs
    finally:
        await store.close()
