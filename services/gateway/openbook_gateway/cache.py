"""Answers cached in Redis, keyed by everything that determines them.

The key includes the index that computed the answer, so after a swap a lookup (keyed by the
newly active index) can never return an answer computed on the other one. When Redis is
unreachable the cache is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from openbook.shared_state import ACTIVE_INDEX_KEY, MODEL_VERSIONS_KEY

log = logging.getLogger(__name__)

KEY_PREFIX = "openbook:answer:"


def cache_key(index: str, params: dict) -> str:
    blob = json.dumps({"index": index, **params}, sort_keys=True, ensure_ascii=False)
    return KEY_PREFIX + hashlib.sha256(blob.encode()).hexdigest()


class AnswerCache:
    def __init__(self, url: str, ttl_s: int, timeout_s: float) -> None:
        self.ttl_s = ttl_s
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )

    async def serving(self) -> tuple[str | None, dict[str, str]]:
        """The active index and the model versions the services announced."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                index, versions = (
                    await pipe.get(ACTIVE_INDEX_KEY).hgetall(MODEL_VERSIONS_KEY).execute()
                )
            return index, versions
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable: %s", exc)
            return None, {}

    async def get(self, index: str, params: dict) -> dict | None:
        try:
            raw = await self.client.get(cache_key(index, params))
        except (RedisError, OSError) as exc:
            log.warning("cache read skipped, redis unavailable: %s", exc)
            return None
        return json.loads(raw) if raw else None

    async def put(self, index: str, params: dict, answer: dict) -> None:
        try:
            await self.client.set(cache_key(index, params), json.dumps(answer), ex=self.ttl_s)
        except (RedisError, OSError) as exc:
            log.warning("cache write skipped, redis unavailable: %s", exc)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.client.aclose()
