"""Answers cached in Redis, keyed by everything that determines them.

The key includes the index that computed the answer, so after a swap a lookup (keyed by the
newly active index) can never return an answer computed on the other one; and the model
versions that computed it, so a reloaded model never serves the old one's answers. When
Redis is unreachable the cache is skipped, never an error.

Entries are sealed with the server key (openbook.sealing), bound to their key: one written or
altered by anyone else (Redis's password is not enough) is a miss, logged, and the answer is
computed afresh; the active index read from Redis is trusted the same way only.
"""

from __future__ import annotations

import hashlib
import json
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from openbook.sealing import Sealer
from openbook.settings import RedisOptions
from openbook.shared_state import ACTIVE_INDEX_KEY, MODEL_VERSIONS_KEY
from openbook_gateway.schemas import AnswerRequest

log = logging.getLogger(__name__)

KEY_PREFIX = "openbook:answer:"

# Fields of AnswerRequest that change the answer (and so belong in the cache key).
ANSWER_PARAMS = (
    "question",
    "k",
    "decoding",
    "num_beams",
    "max_new_tokens",
    "min_new_tokens",
    "num_return_sequences",
    "length_penalty",
    # None (the index's default) keys apart from the mode it names: the default can change with
    # the index's views, and the key holds the index's name, not its views.
    "retrieval",
)


def answer_params(body: AnswerRequest, k: int) -> dict:
    """What decides an answer, with ``k`` resolved (a request naming no k and one naming the
    model's default share their key)."""
    return {**body.model_dump(include=set(ANSWER_PARAMS)), "k": k}


def cache_key(index: str, params: dict) -> str:
    blob = json.dumps({"index": index, **params}, sort_keys=True, ensure_ascii=False)
    return KEY_PREFIX + hashlib.sha256(blob.encode()).hexdigest()


class AnswerCache:
    def __init__(self, redis: RedisOptions, ttl_s: int, sealer: Sealer) -> None:
        self.ttl_s = ttl_s
        self.sealer = sealer
        self.client = aioredis.Redis.from_url(redis.url, **redis.client_kwargs())
        # What this gateway saw serve last: covers a Redis that lost its keys.
        self.last_index: str | None = None
        self.last_versions: dict[str, str] = {}

    async def lookup(self, index: str | None, params: dict) -> dict | None:
        """The stored answer for ``params`` on ``index`` (None: the active index), if any.

        Keyed by the index and model versions that would answer now: Redis is the shared
        truth (the active index, the versions the services announced), what this gateway saw
        last fills in what Redis does not know."""
        shared_index, versions = await self.serving()
        index = index or shared_index or self.last_index
        versions = {**self.last_versions, **versions}
        if not (index and versions):
            return None
        return await self.get(index, {**params, "models": versions})

    def answered(self, index: str, versions: dict[str, str], active: bool) -> None:
        """An answer was computed on ``index`` (the active one if ``active``) by ``versions``."""
        if active:
            self.last_index = index
        self.last_versions = versions

    def swapped(self, active: str) -> None:
        self.last_index = active

    async def store(self, index: str, params: dict, versions: dict[str, str], answer: dict) -> None:
        """File ``answer`` under the index and the model versions that computed it."""
        await self.put(index, {**params, "models": versions}, answer)

    async def serving(self) -> tuple[str | None, dict[str, str]]:
        """The active index and the model versions the services announced."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                index, versions = (
                    await pipe.get(ACTIVE_INDEX_KEY).hgetall(MODEL_VERSIONS_KEY).execute()
                )
            return self.sealer.open(ACTIVE_INDEX_KEY, index), versions
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable: %s", exc)
            return None, {}

    async def get(self, index: str, params: dict) -> dict | None:
        key = cache_key(index, params)
        try:
            raw = await self.client.get(key)
        except (RedisError, OSError) as exc:
            log.warning("cache read skipped, redis unavailable: %s", exc)
            return None
        payload = self.sealer.open(key, raw)
        return json.loads(payload) if payload else None

    async def put(self, index: str, params: dict, answer: dict) -> None:
        key = cache_key(index, params)
        try:
            await self.client.set(key, self.sealer.seal(key, json.dumps(answer)), ex=self.ttl_s)
        except (RedisError, OSError) as exc:
            log.warning("cache write skipped, redis unavailable: %s", exc)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.client.aclose()
