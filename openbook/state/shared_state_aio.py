"""The async half of the Redis protocol (:mod:`openbook.state.redis_protocol`), as the gateway
speaks it over ``redis.asyncio.Redis``: what is served now (the active index, the model and index
versions, the index epochs), cached answers, stored responses, the desired model and the
replicas' states.

Invariants: key names and encodings are the protocol module's only; this module only executes
them. Every function raises ``RedisError`` / ``OSError`` when Redis cannot be reached: what to
do then (skip the cache, fall back to RPCs, answer 503) is the caller's decision.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis

from openbook.config.settings import RedisOptions
from openbook.security.sealing import Sealer
from openbook.state.redis_protocol import (
    ACTIVE_INDEX_KEY,
    DESIRED_MODEL_KEY,
    DESIRED_RECORD_FIELD,
    INDEX_STATE_KEY,
    MODEL_RELOAD_CHANNEL,
    MODEL_VERSIONS_KEY,
    REPLICA_KEY_PATTERN,
    DesiredModel,
    IndexState,
    ReplicaState,
    StoredConversation,
    decode_replica_state,
    desired_fields,
    index_version_of,
    new_index_state,
    next_seq,
    open_active_index,
    open_answer,
    open_conversation,
    open_desired_model,
    open_index_state,
    open_model_version,
    response_key,
    seal_answer,
    seal_conversation,
    seal_desired_model,
    seal_index_state,
)


def async_redis_client(options: RedisOptions) -> aioredis.Redis:
    """An asyncio client with ``options``' credentials, TLS and timeouts (as
    :func:`openbook.state.shared_state.redis_client` for the sync half)."""
    return aioredis.Redis.from_url(options.url, **options.client_kwargs())


@dataclass(frozen=True)
class ServingState:
    """What the services announced in Redis, read together (:func:`read_serving`)."""

    active_index: str | None  # None: unknown, or not genuine
    model_versions: dict[str, str]  # service -> the model version it serves (genuine only)
    index_states: dict[str, str]  # INDEX_STATE_KEY: index -> its sealed state, unopened
    sealer: Sealer | None = None  # opens index_states (None: nothing was read)
    # service -> the sequence number of its genuine record (model_versions)
    model_seqs: dict[str, int] = field(default_factory=dict)
    # services whose record is there but not genuine: their version is unknown
    unsealed_models: frozenset[str] = frozenset()

    def index_state(self, index: str) -> IndexState | None:
        """``index``'s epoch and versions; None if unknown or not genuine (logged by the
        sealer, rate-limited)."""
        raw = self.index_states.get(index)
        if raw is None or self.sealer is None:
            return None
        return open_index_state(self.sealer, index, raw)

    @staticmethod
    def version(state: IndexState) -> int:
        return index_version_of(state)


async def read_serving(client: aioredis.Redis, sealer: Sealer) -> ServingState:
    """The active index, the model versions and the index states, in one round trip."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(ACTIVE_INDEX_KEY)
        pipe.hgetall(MODEL_VERSIONS_KEY)
        pipe.hgetall(INDEX_STATE_KEY)
        index, versions, states = await pipe.execute()
    records = {
        service: open_model_version(sealer, service, raw) for service, raw in versions.items()
    }
    genuine = {service: record for service, record in records.items() if record is not None}
    return ServingState(
        open_active_index(sealer, index),
        {service: record["version"] for service, record in genuine.items()},
        states,
        sealer,
        model_seqs={service: record["seq"] for service, record in genuine.items()},
        unsealed_models=frozenset(records) - frozenset(genuine),
    )


async def index_deleted(client: aioredis.Redis, sealer: Sealer, index: str) -> None:
    """``index`` was deleted: its state is made afresh (a new epoch, no versions, a later
    generation), so a new index of that name never meets the old one's cached answers."""
    previous = open_index_state(sealer, index, await client.hget(INDEX_STATE_KEY, index))
    fresh = new_index_state(previous)
    await client.hset(INDEX_STATE_KEY, index, seal_index_state(sealer, index, fresh))


async def first_index_state(
    client: aioredis.Redis, sealer: Sealer, index: str
) -> IndexState | None:
    """``index``'s state, made afresh (a new epoch, no versions) if Redis holds none: nothing
    was cached under a new epoch, and retrievers raise its versions as they serve and write it.
    None if what is there now is not genuine."""
    fresh = new_index_state()
    if await client.hsetnx(INDEX_STATE_KEY, index, seal_index_state(sealer, index, fresh)):
        return fresh
    return open_index_state(sealer, index, await client.hget(INDEX_STATE_KEY, index))


async def read_answer(client: aioredis.Redis, sealer: Sealer, key: str) -> dict[str, Any] | None:
    """The answer cached under ``key``; None if absent or not genuine."""
    return open_answer(sealer, key, await client.get(key))


async def write_answer(
    client: aioredis.Redis, sealer: Sealer, key: str, answer: dict[str, Any], ttl_s: int
) -> None:
    await client.set(key, seal_answer(sealer, key, answer), ex=ttl_s)


async def read_conversation(
    client: aioredis.Redis, sealer: Sealer, response_id: str
) -> StoredConversation | None:
    """The conversation state stored for ``response_id``; None if absent or not genuine."""
    key = response_key(response_id)
    return open_conversation(sealer, key, await client.get(key))


async def write_conversation(
    client: aioredis.Redis,
    sealer: Sealer,
    response_id: str,
    state: StoredConversation,
    ttl_s: int,
) -> None:
    key = response_key(response_id)
    await client.set(key, seal_conversation(sealer, key, state), ex=ttl_s)


async def list_replicas(client: aioredis.Redis, sealer: Sealer) -> list[ReplicaState]:
    """Every live replica's own state, by service then replica id. A record not sealed with
    the server key for its key (forged, altered, moved, or of the wrong shape) is left out and
    logged (rate-limited): it is no replica."""
    keys = [key async for key in client.scan_iter(match=REPLICA_KEY_PATTERN, count=500)]
    if not keys:
        return []
    # An entry that expired between SCAN and MGET, or is not genuine, is left out.
    replicas = [
        state
        for key, raw in zip(keys, await client.mget(keys), strict=True)
        if (state := decode_replica_state(sealer, _text(key), raw)) is not None
    ]
    return sorted(replicas, key=lambda r: (r["service"], r["replica"]))


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


async def desired_model(client: aioredis.Redis, sealer: Sealer) -> dict[str, str]:
    """The desired model (``desired_model_record``'s fields; empty: no reload was asked for,
    or what is there is not genuine)."""
    # decode_responses=True (RedisOptions): replies are str, which redis-py's annotations
    # cannot tell from the client's type.
    fields = cast(dict[str, str], await client.hgetall(DESIRED_MODEL_KEY))
    return desired_fields(sealer, fields) if fields else {}


async def set_desired(client: aioredis.Redis, sealer: Sealer, checkpoint: str) -> str:
    """Ask every replica for ``checkpoint``, sealed and numbered after the request before it
    (replicas never go back to an older one); returns the request's id."""
    request = uuid.uuid4().hex
    fields = cast(dict[str, str], await client.hgetall(DESIRED_MODEL_KEY))
    previous = open_desired_model(sealer, fields) if fields else None
    record = DesiredModel(
        id=request,
        checkpoint=checkpoint,
        at=time.time(),
        seq=next_seq(previous["seq"] if previous is not None else None),
    )
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(DESIRED_MODEL_KEY)
        pipe.hset(DESIRED_MODEL_KEY, DESIRED_RECORD_FIELD, seal_desired_model(sealer, record))
        pipe.publish(MODEL_RELOAD_CHANNEL, request)
        await pipe.execute()
    return request
