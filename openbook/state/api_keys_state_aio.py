"""The API keys' Redis calls, as the gateway makes them over ``redis.asyncio.Redis`` (the
async half of :mod:`openbook.state.api_keys_protocol`, as :mod:`openbook.state.shared_state_aio`
is of :mod:`openbook.state.redis_protocol`).

Invariants: key names and encodings are the protocol module's only; every function raises
``RedisError`` / ``OSError`` when Redis cannot be reached: the gateway then refuses what needs
a key checked (503, fail closed), never opens it.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

from openbook.security.sealing import Sealer
from openbook.state.api_keys_protocol import (
    API_KEY_PATTERN,
    API_KEY_PREFIX,
    API_KEYS_LAST_USED_KEY,
    ApiKeyRecord,
    api_key_generations_key,
    api_key_key,
    api_key_requests_key,
    open_api_key,
    seal_api_key,
)


async def read_api_key(client: aioredis.Redis, sealer: Sealer, name: str) -> ApiKeyRecord | None:
    """Key ``name``'s record; None if absent or not genuine (no key)."""
    key = api_key_key(name)
    return open_api_key(sealer, name, await client.get(key))


async def create_api_key(client: aioredis.Redis, sealer: Sealer, record: ApiKeyRecord) -> bool:
    """Store ``record`` unless a key of its name exists; whether it was stored."""
    stored = await client.set(api_key_key(record["name"]), seal_api_key(sealer, record), nx=True)
    return bool(stored)


async def delete_api_key(client: aioredis.Redis, name: str) -> bool:
    """Remove key ``name`` (and when it was last used, and its counters); whether there was
    one."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(api_key_key(name))
        pipe.hdel(API_KEYS_LAST_USED_KEY, name)
        pipe.delete(api_key_requests_key(name), api_key_generations_key(name))
        deleted, _, _ = await pipe.execute()
    return bool(deleted)


# No script does this (openbook's Redis user may run none: openbook.security.secrets.ACL_RULES), but
# transactions (MULTI/EXEC): each is applied at once, with no other client's command between.


async def count_request(client: aioredis.Redis, name: str, window_ms: int) -> tuple[int, int]:
    """Count one request of key ``name``: how many its window holds now (this one included)
    and the milliseconds until the window ends (when the count starts again from 0). The
    window opens with the first request (a counter made with its expiry), and ends when the
    counter expires."""
    key = api_key_requests_key(name)
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(key, 0, px=window_ms, nx=True)
        pipe.incr(key)
        pipe.pttl(key)
        _, count, left = await pipe.execute()
    if left < 0:  # a counter without an expiry (it should not be): never locked for ever
        await client.pexpire(key, window_ms)
        left = window_ms
    return int(count), int(left)


async def take_generation(
    client: aioredis.Redis, name: str, limit: int, lease: str, lease_ms: int, now_ms: int
) -> bool:
    """Take ``lease`` on one of key ``name``'s ``limit`` concurrent generations, until
    ``lease_ms`` after ``now_ms`` (it expires by itself: a gateway that dies holding it holds
    it no longer); False when all are taken.

    Leases past their expiry are dropped, this one added, and all counted in one transaction;
    one too many is given back at once. Two gateways taking the last lease at the same instant
    may then both give theirs back: the limit is never exceeded, at worst a request is told to
    retry."""
    key = api_key_generations_key(name)
    async with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, "-inf", now_ms)
        pipe.zadd(key, {lease: now_ms + lease_ms})
        pipe.pexpire(key, lease_ms)
        pipe.zcard(key)
        *_, held = await pipe.execute()
    if held > limit:
        await client.zrem(key, lease)
        return False
    return True


async def give_back_generation(client: aioredis.Redis, name: str, lease: str) -> None:
    """A generation of key ``name`` is over: its lease is free."""
    await client.zrem(api_key_generations_key(name), lease)


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
