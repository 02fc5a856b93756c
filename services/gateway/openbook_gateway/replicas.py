"""Model reloads that reach every replica, seen from the gateway.

``POST /admin/reload-model`` records the desired checkpoint in Redis; every retriever and
generator replica follows it (:class:`openbook.state.shared_state.ModelFollower`) and publishes its
own state (replica id, version served, state of the latest reload, error) under a key with a
TTL. The gateway waits, bounded, for every replica it can see to report on the request.

The retriever and the generator of one deployment serve one checkpoint: if either cannot
switch to it, the one that did is put back (:func:`reload_models`), as a refused index swap
puts back the shards that had swapped. Without Redis the reload goes over RPC, to the one
replica (per shard) each of the gateway's channels reaches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from fastapi import HTTPException
from redis.exceptions import RedisError

from openbook.security.sealing import Sealer
from openbook.state.redis_protocol import (
    CONVERGED,
    FAILED,
    LOADING,
    REQUEST_FIELD,
    RESOLVED_FIELD,
    ReplicaState,
)
from openbook.state.shared_state_aio import desired_model, list_replicas, set_desired
from openbook_gateway.clients import GeneratorClient
from openbook_gateway.retrieval import Retrieval

# desired_model and list_replicas reach the admin routes through this module.
log = logging.getLogger(__name__)

SERVICES = ("retriever", "generator")
POLL_S = 0.2


def outcome(replica: Mapping[str, Any], request: str) -> dict[str, Any]:
    """One replica's result for ``request``: converged, failed (with the reason) or loading.
    Only genuine records get here (:func:`list_replicas` leaves out the others): a forged
    one is never a replica the reload waits on."""
    mine = replica.get("request") == request
    state = replica.get("state") if mine else LOADING
    return {
        "service": replica.get("service", ""),
        "replica": replica.get("replica", ""),
        "version": replica.get("version", ""),
        "state": state if state in (CONVERGED, FAILED) else LOADING,
        "error": (replica.get("error") or None) if mine and state == FAILED else None,
    }


@dataclass
class SharedReload:
    """A reload told to every replica through Redis, and where it got."""

    request: str  # its id
    desired: dict[str, str]  # the desired record (with the checkpoint the replicas resolved)
    outcomes: list[dict[str, Any]]  # each replica's (``outcome``)
    before: list[ReplicaState]  # each replica's state before the request


async def reload_everywhere(
    client: aioredis.Redis, sealer: Sealer, checkpoint: str, wait_s: float
) -> SharedReload | None:
    """Set the desired model and wait (at most ``wait_s``) until every live replica reports on
    it. None when Redis cannot be reached or no replica follows shared reloads (the caller
    falls back to RPCs)."""
    try:
        before = await list_replicas(client, sealer)
        if not before:
            log.warning("no replica follows shared reloads: reloading over RPC only")
            return None
        request = await set_desired(client, sealer, checkpoint)
    except (RedisError, OSError) as exc:
        log.warning("redis unavailable, reload reaches one replica per channel only: %s", exc)
        return None
    deadline = time.monotonic() + wait_s
    outcomes: list[dict[str, Any]] = []
    desired: dict[str, str] = {}
    while True:
        try:
            replicas = await list_replicas(client, sealer)
            desired = await desired_model(client, sealer)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable while waiting for replicas: %s", exc)
            replicas = []
        if replicas:
            outcomes = [outcome(r, request) for r in replicas]
        if desired.get(REQUEST_FIELD) not in (None, request):
            break  # a newer reload superseded this one: report where this one got
        if outcomes and all(o["state"] != LOADING for o in outcomes):
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_S)
    for service in SERVICES:
        if not any(o["service"] == service for o in outcomes):
            # Nothing of this service can switch: the other one must not stay switched alone.
            error = f"no {service} replica follows shared reloads (none is up)"
            outcomes.append(
                dict(service=service, replica="", version="", state=FAILED, error=error)
            )
    return SharedReload(request, desired, outcomes, before)


def _served(outcomes: list[dict[str, Any]]) -> dict[str, str]:
    """The version each service's replicas serve ('' where they differ)."""
    versions = {}
    for service in SERVICES:
        served = {
            o["version"] for o in outcomes if o["service"] == service and o["state"] == CONVERGED
        }
        versions[service] = served.pop() if len(served) == 1 else ""
    return versions


def _moved(reload: SharedReload) -> list[dict[str, Any]]:
    """The replicas that switched (or are still switching) to the requested model."""
    before = {(r.get("service"), r.get("replica")): r.get("version") for r in reload.before}
    return [
        o
        for o in reload.outcomes
        if o["state"] == LOADING
        or (o["state"] == CONVERGED and o["version"] != before.get((o["service"], o["replica"])))
    ]


async def reload_models(
    retrieval: Retrieval,
    generator: GeneratorClient,
    client: aioredis.Redis,
    sealer: Sealer,
    checkpoint: str,
    request_id: str,
    timeout_s: float,
    wait_s: float,
) -> tuple[int, dict[str, Any]]:
    """Reload the retriever (query encoder) and the generator from ``checkpoint`` ('' : the
    latest), both or neither. Returns the HTTP status and the body (``ReloadModelResponse``,
    with ``detail`` when a replica refused): 200 when every replica switched, 202 when some
    are still loading after ``wait_s``, 422 when the checkpoint was refused and every replica
    serves what it served before (the ones that had switched were put back), 409 when the
    replicas now disagree (a refusal, and the others could not be put back)."""
    shared = await reload_everywhere(client, sealer, checkpoint, wait_s)
    if shared is None:
        log.warning("model reload without shared state: other replicas keep their model")
        versions = await reload_over_rpc(retrieval, generator, checkpoint, request_id, timeout_s)
        log.info("models reloaded over RPC: %s", versions)
        return 200, versions
    outcomes = shared.outcomes
    failed = [o for o in outcomes if o["state"] == FAILED]
    loading = [o for o in outcomes if o["state"] == LOADING]
    log.info(
        "model reload %s: %d replicas converged, %d failed, %d loading",
        shared.request,
        len(outcomes) - len(failed) - len(loading),
        len(failed),
        len(loading),
    )
    body = {
        **_served(outcomes),
        "checkpoint": shared.desired.get(RESOLVED_FIELD) or checkpoint or None,
        "request": shared.request,
        "replicas": outcomes,
        "rolled_back": None,
    }
    if not failed:
        # The wait may have run out: those loading keep loading, /admin/replicas shows them.
        return (202 if loading else 200), body
    # Every replica that refused keeps its model.
    reasons = "; ".join(f"{o['service']} {o['replica'] or '-'}: {o['error']}" for o in failed)
    detail = f"checkpoint refused by {len(failed)} of {len(outcomes)} replicas: {reasons}"
    moved = _moved(shared)
    if not moved:
        return 422, {"detail": detail, **body}
    previous = {r.get("version", "") for r in shared.before}
    if len(previous) != 1 or not next(iter(previous)):
        detail += f"; the replicas that switched cannot be put back: they served {sorted(previous)}"
        return 409, {"detail": detail, **body}
    (target,) = previous
    log.warning(
        "model reload %s refused: putting %d replicas back on %s",
        shared.request,
        len(moved),
        target,
    )
    back = await reload_everywhere(client, sealer, target, wait_s)
    mine = {(o["service"], o["replica"]) for o in moved}
    stuck = [
        o
        for o in (back.outcomes if back is not None else moved)
        if (o["service"], o["replica"]) in mine
        and (o["state"] != CONVERGED or o["version"] != target)
    ]
    if back is None or stuck:
        why = "; ".join(
            f"{o['service']} {o['replica'] or '-'}: {o['error'] or o['state']}" for o in stuck
        )
        if back is None:
            why = "redis unavailable"
        detail += f"; the replicas that switched could not be put back on {target}: {why}"
        return 409, {"detail": detail, **body}
    detail += f"; the replicas that had switched were put back on {target}"
    return 422, {"detail": detail, **body, **_served(back.outcomes), "rolled_back": target}


async def reload_over_rpc(
    retrieval: Retrieval,
    generator: GeneratorClient,
    checkpoint: str,
    request_id: str,
    timeout_s: float,
) -> dict[str, str]:
    """Reload over the gateway's channels: every retriever shard (all or none), then the
    generator; if the generator cannot switch, the retriever is put back. Raises the refusal
    (an ``HTTPException``), a 409 when the retriever could not be put back."""
    previous, retriever = await retrieval.reload_model(checkpoint, request_id, timeout_s)
    try:
        generator_version = await generator.reload_model(checkpoint, request_id, timeout_s)
    except HTTPException as refused:
        if all(version == retriever for version in previous):
            raise  # the retriever did not change
        try:
            await retrieval.restore_model(previous, request_id, timeout_s)
        except HTTPException as stuck:
            raise HTTPException(
                409,
                f"{refused.detail}; the retriever, switched to {retriever}, could not be put "
                f"back: {stuck.detail}",
            ) from None
        back = ", ".join(sorted(set(previous)))
        raise HTTPException(
            refused.status_code,
            f"{refused.detail} (the retriever was put back on {back})",
            headers=refused.headers,
        ) from None
    return {"retriever": retriever, "generator": generator_version}
