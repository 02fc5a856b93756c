"""The API keys' part of the Redis protocol (issue 43): key names and codecs, no I/O.

Kept beside :mod:`openbook.state.redis_protocol` (same rules: names and encodings here only, the
Redis calls in :mod:`openbook.state.api_keys_state_aio`), for the keys an admin makes with ``POST
/admin/keys``: one sealed record per key under :func:`api_key_key` of its name, holding the
key's scopes, its indexes, the tenant ``filter`` and the ``rate`` it is held to, when it was
made, and a salted hash of its secret (never the secret). Sealed bound to its Redis key
(:mod:`openbook.security.sealing`): an entry written, altered or moved by anyone without the server
key (Redis's password is not enough) opens as None, and is no key. When a key was last used is
kept apart, unsealed (hash :data:`API_KEYS_LAST_USED_KEY`: name -> Unix time): a forged value
there only shows a wrong time, and never opens anything.

A key's ``rate`` is counted under :func:`api_key_requests_key` (requests in the current minute,
a counter that expires with its window) and :func:`api_key_generations_key` (a sorted set of
the generations running, each a lease that expires on its own if its gateway dies): shared by
every gateway replica. They are plain counters, not sealed: whoever can write to Redis can
reset them, which only lets that key's requests through sooner, never opens another door.
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

from openbook.security.sealing import Sealer

API_KEY_PREFIX = "openbook:api-key:"
# Every key's record (a SCAN pattern).
API_KEY_PATTERN = API_KEY_PREFIX + "*"
API_KEYS_LAST_USED_KEY = "openbook:api-keys-last-used"
API_KEY_REQUESTS_PREFIX = "openbook:api-key-requests:"
API_KEY_GENERATIONS_PREFIX = "openbook:api-key-generations:"


class KeyRate(TypedDict):
    """A key's limits (None: none of that kind)."""

    requests_per_minute: int | None
    concurrent_generations: int | None


class ApiKeyRecord(TypedDict):
    name: str
    scopes: list[str]
    indexes: list[str] | None  # None: every index
    created: float  # time.time() when it was made
    # The tenant's metadata filter (openbook.validation.metadata_filter's grammar), ANDed into every
    # retrieval made with the key; None: none.
    filter: dict[str, Any] | None
    rate: KeyRate | None  # None: no limits
    salt: str  # hex
    digest: str  # hex: SHA-256 of salt + secret (openbook_gateway.api_keys)


def api_key_key(name: str) -> str:
    return API_KEY_PREFIX + name


def api_key_requests_key(name: str) -> str:
    """The count of key ``name``'s requests in its current one-minute window."""
    return API_KEY_REQUESTS_PREFIX + name


def api_key_generations_key(name: str) -> str:
    """The leases of key ``name``'s running generations (member: a lease id, score: when it
    expires, Unix time in milliseconds)."""
    return API_KEY_GENERATIONS_PREFIX + name


def seal_api_key(sealer: Sealer, record: ApiKeyRecord) -> str:
    """``record`` as stored under :func:`api_key_key` of its name (sealed: bound to it)."""
    return sealer.seal(api_key_key(record["name"]), json.dumps(record))


def open_api_key(sealer: Sealer, name: str, raw: str | bytes | None) -> ApiKeyRecord | None:
    """The record of key ``name`` stored as ``raw``; None if absent, not genuine (not sealed
    with the server key, or sealed for another name) or not a record."""
    record = sealer.open_json(api_key_key(name), raw)
    if record is None:
        return None
    indexes = record.get("indexes") if isinstance(record, dict) else None
    # absent in a record made before keys had them: none
    tenant = record.get("filter") if isinstance(record, dict) else None
    rate = _rate(record.get("rate")) if isinstance(record, dict) else None
    if not (
        isinstance(record, dict)
        and record.get("name") == name
        and isinstance(record.get("scopes"), list)
        and all(isinstance(scope, str) for scope in record["scopes"])
        and (
            indexes is None
            or (isinstance(indexes, list) and all(isinstance(i, str) for i in indexes))
        )
        and isinstance(record.get("created"), int | float)
        and isinstance(record.get("salt"), str)
        and isinstance(record.get("digest"), str)
        and (tenant is None or isinstance(tenant, dict))
        and (rate is not None or record.get("rate") is None)
    ):
        return None
    return ApiKeyRecord(
        name=name,
        scopes=record["scopes"],
        indexes=indexes,
        created=float(record["created"]),
        filter=tenant or None,
        rate=rate,
        salt=record["salt"],
        digest=record["digest"],
    )


def _rate(value: Any) -> KeyRate | None:
    """A stored ``rate`` (None when absent or not one: the caller refuses such a record)."""
    if not isinstance(value, dict):
        return None
    limits = [value.get("requests_per_minute"), value.get("concurrent_generations")]
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in limits):
        return None
    return KeyRate(requests_per_minute=limits[0], concurrent_generations=limits[1])
