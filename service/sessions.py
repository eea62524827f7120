"""Session store: conversations continued across requests.

A session is one conversation: its full token history (prompts and completions so far), the
last request's settings, and which replica holds a warm KV cache for it and for how many leading
tokens. A continued session goes back to that replica and reuses the cache; if the replica is gone
(scaled down, crashed), any other replica rebuilds the cache from the history. The store holds the
history, so losing a replica loses nothing but the time to recompute it.

Two backends with one interface (`SessionStore`): `MemoryStore`, in-process, for a single node and
tests; `RedisStore`, shared by every replica and router of a deployment. Entries expire after the
store's TTL since their last write, so abandoned conversations go away on their own.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from pydantic import BaseModel
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff


class Session(BaseModel):
    session_id: str
    tokens: list[int]  # full history: prompts + completions so far
    # A chat session's turns ({"role", "content"}; replies included), rendered whole with the
    # chat template on every turn; None: a session of prompt text, continued by appending.
    messages: list[dict[str, str]] | None = None
    settings: dict[str, Any]  # the last request's settings, free-form JSON
    replica: str | None = None  # replica holding the warm KV cache, if any
    kv_length: int = 0  # leading tokens of `tokens` that `replica` holds KV for
    created: float  # unix time
    updated: float  # unix time
    turns: int = 0


@runtime_checkable
class SessionStore(Protocol):
    async def get(self, session_id: str) -> Session | None:
        """The session, or None if it never existed or has expired."""
        ...

    async def put(self, session: Session) -> None:
        """Write the session; its TTL starts over."""
        ...

    async def delete(self, session_id: str) -> None: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


class StoreUnavailableError(ConnectionError):
    """The session store cannot be reached."""


class MemoryStore:
    """In-process store for a single node. Returns copies, like a remote store would."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        # session_id -> (monotonic deadline, session). Every put moves its key to the end and the
        # TTL is fixed, so deadlines ascend in order: expired entries are always at the front.
        self._entries: OrderedDict[str, tuple[float, Session]] = OrderedDict()

    async def get(self, session_id: str) -> Session | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        deadline, session = entry
        if time.monotonic() >= deadline:
            del self._entries[session_id]
            return None
        return session.model_copy(deep=True)

    async def put(self, session: Session) -> None:
        now = time.monotonic()
        # Drop expired entries from the front, so sessions never read again don't pile up.
        while self._entries:
            first = next(iter(self._entries.values()))
            if first[0] > now:
                break
            self._entries.popitem(last=False)
        self._entries.pop(session.session_id, None)
        self._entries[session.session_id] = (now + self.ttl_s, session.model_copy(deep=True))

    async def delete(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._entries.clear()


# A request that cannot load its session should get an error promptly, not after redis-py's
# default of 10 retries: a refused connection fails in well under a second, a silent host after
# (1 + _RETRIES) connect timeouts.
_CONNECT_TIMEOUT_S = 2.0
_RETRIES = 2


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisStore:
    """Sessions as JSON strings in Redis under `prefix + session_id`, written with a TTL."""

    def __init__(self, url: str, ttl_s: float, prefix: str = "blockspec:session:") -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.url = _redact(url)
        self.ttl_s = ttl_s
        self.prefix = prefix
        # Milliseconds (SET PX) so a fractional TTL is honoured; never less than 1 ms.
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._redis = aioredis.from_url(
            url,
            socket_connect_timeout=_CONNECT_TIMEOUT_S,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), _RETRIES),
        )

    def _key(self, session_id: str) -> str:
        return self.prefix + session_id

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        # redis-py's ConnectionError is not the builtin one; callers catch the builtin.
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            raise StoreUnavailableError(
                f"session store: cannot reach Redis at {self.url}: {err}"
            ) from err

    async def get(self, session_id: str) -> Session | None:
        with self._reaching():
            data = await self._redis.get(self._key(session_id))
        return None if data is None else Session.model_validate_json(data)

    async def put(self, session: Session) -> None:
        with self._reaching():
            await self._redis.set(
                self._key(session.session_id), session.model_dump_json(), px=self._ttl_ms
            )

    async def delete(self, session_id: str) -> None:
        with self._reaching():
            await self._redis.delete(self._key(session_id))

    async def ping(self) -> bool:
        with self._reaching():
            return bool(await self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(url: str | None, ttl_s: float) -> SessionStore:
    """`RedisStore` for a redis:// (rediss://, unix://) URL; `MemoryStore` when none is given."""
    if not url:
        return MemoryStore(ttl_s)
    return RedisStore(url, ttl_s)
