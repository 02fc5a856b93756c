"""The API keys' Redis calls, as the gateway makes them over ``redis.asyncio.Redis`` (the
async half of :mod:`openbook.api_keys_protocol`, as :mod:`openbook.shared_state_aio` is of
:mod:`openbook.redis_protocol`).

Invariants: key names and encodings are the protocol module's only; every function raises
``RedisError`` / ``OSError`` when Redis cannot be reached: the gateway then refuses what needs
a key checked (503, fail closed), never opens it.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

from openbook.api_keys_protocol import (
    API_KEY_PATTERN,
    API_KEY_PREFIX,
    API_KEYS_LAST_USED_KEY,
    ApiKeyRecord,
    api_key_key,
    open_api_key,
    seal_api_key,
)
from openbook.sealing import Sealer


async def read_api_key(client: aioredis.Redis, sealer: Sealer, name: str) -> ApiKeyRecord | None:
    """Key ``name``'s record; None if absent or not genuine (no key)."""
    key = api_key_key(name)
    return open_api_key(sealer, name, await client.get(key))


async def create_api_key(client: aioredis.Redis, sealer: Sealer, record: ApiKeyRecord) -> bool:
    """Store ``record`` unless a key of its name exists; whether it was stored."""
    stored = await client.set(api_key_key(record["name"]), seal_api_key(sealer, record), nx=True)
    return bool(stored)


async def delete_api_key(client: aioredis.Redis, name: str) -> bool:
    """Remove key ``name`` (and when it was last used); whether there was one."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(api_key_key(name))
        pipe.hdel(API_KEYS_LAST_USED_KEY, name)
        deleted, _ = await pipe.execute()
    return bool(deleted)


async def list_api_keys(
    client: aioredis.Redis, sealer: Sealer
) -> list[tuple[ApiKeyRecord, float | None]]:
    """Every genuine key's record and when it was last used (None: never), by name. An entry
    not sealed with the server key is left out: it is no key."""
    keys = [key async for key in client.scan_iter(match=API_KEY_PATTERN, count=500)]
    if not keys:
        return []
    raws = await client.mget(keys)
    last_used = cast(dict[str, str], await client.hgetall(API_KEYS_LAST_USED_KEY))
    listed = []
    for key, raw in zip(keys, raws, strict=True):
        name = str(key).removeprefix(API_KEY_PREFIX)
        record = open_api_key(sealer, name, raw)
        if record is None:
            continue
        try:
            used: float | None = float(last_used[name])
        except (KeyError, ValueError):
            used = None
        listed.append((record, used))
    return sorted(listed, key=lambda entry: entry[0]["name"])


async def touch_api_key(client: aioredis.Redis, name: str, at: float) -> None:
    """Record that key ``name`` was used at ``at`` (Unix time)."""
    await client.hset(API_KEYS_LAST_USED_KEY, name, str(at))
