"""Model reloads that reach every replica, seen from the gateway.

``POST /admin/reload-model`` records the desired checkpoint in Redis; every retriever and
generator replica follows it (:class:`openbook.shared_state.ModelFollower`) and publishes its
own state (replica id, version served, state of the latest reload, error) under a key with a
TTL. The gateway waits, bounded, for every replica it can see to report on the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from redis.exceptions import RedisError

from openbook.shared_state import (
    CONVERGED,
    DESIRED_MODEL_KEY,
    FAILED,
    LOADING,
    MODEL_RELOAD_CHANNEL,
    REPLICA_KEY_PREFIX,
)

log = logging.getLogger(__name__)

SERVICES = ("retriever", "generator")
POLL_S = 0.2


async def list_replicas(client) -> list[dict]:
    """Every live replica's own state, by service then replica id."""
    keys = [key async for key in client.scan_iter(match=REPLICA_KEY_PREFIX + "*", count=500)]
    if not keys:
        return []
    replicas = []
    for raw in await client.mget(keys):
        if raw:  # expired between SCAN and MGET
            try:
                replicas.append(json.loads(raw))
            except ValueError:
                continue
    return sorted(replicas, key=lambda r: (r.get("service", ""), r.get("replica", "")))


async def desired_model(client) -> dict:
    return await client.hgetall(DESIRED_MODEL_KEY)


async def set_desired(client, checkpoint: str) -> str:
    request = uuid.uuid4().hex
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(DESIRED_MODEL_KEY)
        pipe.hset(
            DESIRED_MODEL_KEY,
            mapping={"id": request, "checkpoint": checkpoint, "at": str(time.time())},
        )
        pipe.publish(MODEL_RELOAD_CHANNEL, request)
        await pipe.execute()
    return request


def outcome(replica: dict, request: str) -> dict:
    """One replica's result for ``request``: converged, failed (with the reason) or loading."""
    mine = replica.get("request") == request
    state = replica.get("state") if mine else LOADING
    return {
        "service": replica.get("service", ""),
        "replica": replica.get("replica", ""),
        "version": replica.get("version", ""),
        "state": state if state in (CONVERGED, FAILED) else LOADING,
        "error": (replica.get("error") or None) if mine and state == FAILED else None,
    }


async def reload_everywhere(
    client, checkpoint: str, wait_s: float
) -> tuple[str, dict, list[dict]] | None:
    """Set the desired model and wait (at most ``wait_s``) until every live replica reports on
    it. Returns the request id, the desired record and each replica's outcome; None when Redis
    cannot be reached or no replica follows shared reloads (the caller falls back to RPCs)."""
    try:
        if not await list_replicas(client):
            log.warning("no replica follows shared reloads: reloading over RPC only")
            return None
        request = await set_desired(client, checkpoint)
    except (RedisError, OSError) as exc:
        log.warning("redis unavailable, reload reaches one replica per channel only: %s", exc)
        return None
    deadline = time.monotonic() + wait_s
    outcomes: list[dict] = []
    desired: dict = {}
    while True:
        try:
            replicas = await list_replicas(client)
            desired = await desired_model(client)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable while waiting for replicas: %s", exc)
            replicas = []
        if replicas:
            outcomes = [outcome(r, request) for r in replicas]
        if desired.get("id") not in (None, request):
            break  # a newer reload superseded this one: report where this one got
        if outcomes and all(o["state"] != LOADING for o in outcomes):
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_S)
    return request, desired, outcomes
