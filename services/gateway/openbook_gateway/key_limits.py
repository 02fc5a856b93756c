"""Limits per key (issue 43): requests a minute and generations at once, counted in Redis so
that every gateway replica counts the same key's requests together.

A key made with a ``rate`` (``POST /admin/keys``) is held to it; the admin token, the static
keys and anonymous requests are not (they have no name to count under).

* ``requests_per_minute``: every request the door lets in counts (:func:`count_request`, from
  ``access.admit``) in a window that opens with the key's first request and lasts a minute
  (one transaction: the counter made with its expiry if absent, ``INCR``, ``PTTL``). Past the
  limit: 429 with ``Retry-After``, the seconds until the window closes (rounded up): a request
  sent then is counted in a new window, so the header is true.
* ``concurrent_generations``: an answer being generated holds a lease (:func:`generation`,
  from ``answering.answer_events``; a cached answer takes none) in a sorted set scored by when
  the lease expires (taken in one transaction, given back at once if one too many), so a
  gateway that dies while generating frees its leases by itself once
  they expire (after ``generate_timeout_s`` and a minute). Past the limit: 429, with
  ``Retry-After: 1`` (when a running generation ends cannot be known).
* Redis unreachable: the key's limits cannot be counted, so its request is refused (503), as
  its key could not be checked either: never open.

Fair share at the generator: a key's ``concurrent_generations`` bounds how many of the
generator's slots one key can hold at once, across replicas; the generator's own admission
queue is first come, first served (it knows no keys), so a key with no limit can still fill
it. Giving the generator per-key queues is left to its scheduler (docs/security.md).
"""

from __future__ import annotations

import logging
import math
import time
import uuid

from redis.exceptions import RedisError

from openbook.state.api_keys_state_aio import count_request as count_in_redis
from openbook.state.api_keys_state_aio import give_back_generation, take_generation
from openbook_gateway.principal import Principal
from openbook_gateway.services import Services

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
# A lease outlives its generation's longest wait by this much.
LEASE_MARGIN_S = 60.0


class Limited(Exception):
    """A key past its limits (429), or limits that cannot be counted (503)."""

    def __init__(self, status: int, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


def _unavailable(exc: Exception) -> Limited:
    log.warning("cannot count a key's requests: redis unavailable: %s", exc)
    return Limited(503, "the key's limits cannot be counted now: Redis is unreachable", 1)


async def count_request(principal: Principal, services: Services) -> None:
    """Count one request of ``principal``'s key; :class:`Limited` past its per-minute limit."""
    limit = principal.rate["requests_per_minute"] if principal.rate else None
    if limit is None or principal.name is None:
        return
    try:
        count, left_ms = await count_in_redis(services.cache.client, principal.name, WINDOW_MS)
    except (RedisError, OSError) as exc:
        raise _unavailable(exc) from None
    if count > limit:
        retry_after = max(1, math.ceil(left_ms / 1000))
        raise Limited(
            429,
            f"key {principal.name!r} is past its limit of {limit} requests a minute: "
            f"retry in {retry_after} s",
            retry_after,
        )


class Lease:
    """One of a key's concurrent generations, held until :meth:`release` (which never
    raises: a lease not given back expires by itself)."""

    def __init__(self, services: Services | None = None, name: str = "", lease: str = "") -> None:
        self._services, self._name, self._lease = services, name, lease

    async def release(self) -> None:
        if self._services is None:
            return
        services, self._services = self._services, None
        try:
            await give_back_generation(services.cache.client, self._name, self._lease)
        except (RedisError, OSError) as exc:
            log.warning("a generation lease of key %s not given back: %s", self._name, exc)


async def generation(principal: Principal, services: Services) -> Lease:
    """A lease on one of ``principal``'s key's concurrent generations (an empty one for a key
    without that limit); :class:`Limited` when all are held."""
    limit = principal.rate["concurrent_generations"] if principal.rate else None
    if limit is None or principal.name is None:
        return Lease()
    lease = uuid.uuid4().hex
    settings = services.settings
    lease_ms = int(
        (settings.retrieve_timeout_s + settings.generate_timeout_s + LEASE_MARGIN_S) * 1000
    )
    try:
        taken = await take_generation(
            services.cache.client, principal.name, limit, lease, lease_ms, int(time.time() * 1000)
        )
    except (RedisError, OSError) as exc:
        raise _unavailable(exc) from None
    if not taken:
        raise Limited(
            429,
            f"key {principal.name!r} has {limit} answers being generated, its limit: retry "
            "when one is done",
            1,
        )
    return Lease(services, principal.name, lease)
