"""``/admin/keys``: make, list and delete keys with scopes (issue 43; docs/api.md, "Keys and
scopes").

Invariants: behind the ``admin`` scope (``openbook_gateway.access``: the admin token or a key
with ``admin``), like the rest of ``/admin``. The secret is in the reply that made the key and
nowhere else: Redis keeps a salted hash in a sealed record (``openbook_gateway.api_keys``), a
listing shows names, scopes, indexes and times. A deleted key is refused by every gateway from
the next request on (they read the record each time). Redis unreachable: 503, nothing done.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request
from redis.exceptions import RedisError

from openbook.state.api_keys_protocol import KeyRate
from openbook.state.api_keys_state_aio import create_api_key, delete_api_key, list_api_keys
from openbook_gateway import audit
from openbook_gateway.api_keys import KEY_NAME_PATTERN, new_key
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.schemas import CreatedKey, CreateKeyRequest, DeletedKey, KeysResponse
from openbook_gateway.services import ServicesDep

log = logging.getLogger(__name__)

router = APIRouter(prefix="/admin/keys", route_class=JSONBodyRoute)

KeyName = Annotated[str, Path(pattern=KEY_NAME_PATTERN, description="the key's name")]


def _unavailable(exc: Exception) -> HTTPException:
    return HTTPException(503, f"redis unavailable: keys cannot be managed: {exc}")


@router.post("", status_code=201, response_model=CreatedKey)
async def create_key(body: CreateKeyRequest, request: Request, services: ServicesDep) -> dict:
    """A new key with ``scopes`` (and, if given, only ``indexes``): its secret is in this
    reply only. A name already taken is a 409."""
    audit.note(request, name=body.name, scopes=list(body.scopes), indexes=body.indexes)
    rate = (
        KeyRate(
            requests_per_minute=body.rate.requests_per_minute,
            concurrent_generations=body.rate.concurrent_generations,
        )
        if body.rate is not None
        else None
    )
    secret, record = new_key(body.name, list(body.scopes), body.indexes, body.filter, rate)
    cache = services.cache
    try:
        created = await create_api_key(cache.client, cache.sealer, record)
    except (RedisError, OSError) as exc:
        raise _unavailable(exc) from None
    if not created:
        raise HTTPException(409, f"name: a key named {body.name!r} exists (delete it first)")
    return {"name": body.name, "key": secret}


@router.get("", response_model=KeysResponse)
async def list_keys(services: ServicesDep) -> dict:
    """Every key: name, scopes, indexes, when made and last used; never a secret."""
    cache = services.cache
    try:
        listed = await list_api_keys(cache.client, cache.sealer)
    except (RedisError, OSError) as exc:
        raise _unavailable(exc) from None
    return {
        "keys": [
            {
                "name": record["name"],
                "scopes": record["scopes"],
                "indexes": record["indexes"],
                "filter": record["filter"],
                "rate": record["rate"],
                "created": record["created"],
                "last_used": last_used,
            }
            for record, last_used in listed
        ]
    }


@router.delete("/{name}", response_model=DeletedKey)
async def delete_key(name: KeyName, services: ServicesDep) -> dict:
    """Revoke a key: refused by every gateway from the next request on (404 when absent)."""
    try:
        deleted = await delete_api_key(services.cache.client, name)
    except (RedisError, OSError) as exc:
        raise _unavailable(exc) from None
    if not deleted:
        raise HTTPException(404, f"name: no key named {name!r}")
    return {"name": name}
