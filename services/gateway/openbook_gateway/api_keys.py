"""Keys with scopes (issue 43): made by the admin (``POST /admin/keys``), kept in Redis, checked
at the gateway's door (:mod:`openbook_gateway.access`) on every request that presents one.

A key's secret is ``obk_<name>.<random>``: the name says which record to read (one ``GET``),
the random part (32 bytes, URL-safe base64: no ``.``) is what proves it. The gateway shows the
secret once, in the reply that made it, and keeps only a salted hash of it
(``SHA-256(salt + secret)``, a fresh 16-byte salt per key) in a record sealed with the server
key (:func:`openbook.state.api_keys_protocol.seal_api_key`). So:

* Redis's content never gives a key away (a hash of 256 random bits is not worth inverting:
  no slow hash is needed, and checking costs microseconds).
* A record written or altered by anyone who can write to Redis but has not the server key
  opens as None: no key, whatever secret its writer chose.
* The secret is compared in constant time (``hmac.compare_digest`` of the digests), and a
  name with no record is hashed against a dummy salt all the same, so the time taken tells
  neither whether the name exists nor how much of the secret was right.
* Nothing is cached: every request reads the record, so a key deleted through any gateway
  stops working at every gateway at once (well within the second issue 43 asks for).

Invariants: names follow :data:`KEY_NAME_PATTERN` (a path segment, and no ``.``); a record's
scopes are a subset of :data:`SCOPES`; a key with ``admin`` names no indexes and has no filter
(it could make itself a key that is held to neither). A record's ``filter`` parses
(:func:`openbook.validation.metadata_filter.parse_filter`): the gateway refuses it at ``POST
/admin/keys``, and treats a stored one that does not as no key (``access.identify``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from openbook.state.api_keys_protocol import ApiKeyRecord, KeyRate

Scope = Literal["ask", "write", "indexes:create", "admin"]
SCOPES: tuple[Scope, ...] = ("ask", "write", "indexes:create", "admin")
KEY_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
SECRET_PREFIX = "obk_"
# Indexes one key may be held to.
MAX_KEY_INDEXES = 256
_NAME = re.compile(KEY_NAME_PATTERN)
_SALT_BYTES = 16
_SECRET_BYTES = 32
# Hashed against when a name has no record: the same work as a real check.
_DUMMY_SALT = bytes(_SALT_BYTES).hex()


@dataclass(frozen=True)
class PresentedKey:
    """A bearer token in the managed keys' format: the key's name and the whole secret."""

    name: str
    secret: str


def parse(token: str) -> PresentedKey | None:
    """The managed key ``token`` claims to be; None when it is not in their format (an API key
    of ``OPENBOOK_GATEWAY_API_KEYS``, the admin token, or a client's placeholder)."""
    if not token.startswith(SECRET_PREFIX):
        return None
    name, dot, random_part = token[len(SECRET_PREFIX) :].partition(".")
    if not dot or not random_part or not _NAME.fullmatch(name):
        return None
    return PresentedKey(name, token)


def digest(salt_hex: str, secret: str) -> str:
    """The hash a record keeps of ``secret``."""
    salt = bytes.fromhex(salt_hex)
    return hashlib.sha256(salt + secret.encode("utf-8", "surrogateescape")).hexdigest()


def matches(record: ApiKeyRecord | None, presented: PresentedKey) -> bool:
    """Whether ``presented`` is the key of ``record`` (constant time; None: no record, the
    same work done)."""
    try:
        salt = record["salt"] if record is not None else _DUMMY_SALT
        computed = digest(salt, presented.secret)
    except ValueError:  # a sealed record with a salt that is not hex: not ours to trust
        return False
    expected = record["digest"] if record is not None else computed
    same = hmac.compare_digest(computed.encode(), expected.encode())
    return same and record is not None


def new_key(
    name: str,
    scopes: list[str],
    indexes: list[str] | None,
    tenant: dict[str, Any] | None = None,
    rate: KeyRate | None = None,
) -> tuple[str, ApiKeyRecord]:
    """A new key's secret (to show once) and the record to store (``tenant``: its filter)."""
    secret = f"{SECRET_PREFIX}{name}.{secrets.token_urlsafe(_SECRET_BYTES)}"
    salt = secrets.token_bytes(_SALT_BYTES).hex()
    record = ApiKeyRecord(
        name=name,
        scopes=[scope for scope in SCOPES if scope in scopes],  # canonical order, no repeats
        indexes=sorted(set(indexes)) if indexes is not None else None,
        created=time.time(),
        filter=tenant or None,
        rate=rate,
        salt=salt,
        digest=digest(salt, secret),
    )
    return secret, record


class LastUsed:
    """When to record that a key was used: at most once per ``every_s`` per key and gateway,
    so a busy key costs one extra Redis write a minute, not one per request. ``GET
    /admin/keys`` shows it to within that much."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def due(self, name: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(name, -1e18) < self.every_s:
            return False
        if len(self._last) > 10_000:  # names of deleted keys: forget them all now and then
            self._last.clear()
        self._last[name] = now
        return True
