"""Values kept in Redis sealed with a MAC, so that whoever can write to Redis cannot make a
service believe them.

A sealed value is ``{"v": payload, "mac": HMAC-SHA256(server key, redis key + NUL + payload)}``.
The MAC binds the payload to the Redis key it is stored under, so a genuine entry cannot be
moved to another key either (an answer cached for one question served for another).

Invariants: :meth:`Sealer.open` returns the payload only when the MAC verifies (compared in
constant time); anything else (no MAC, a wrong one, not JSON, a plain unsealed value) is
``None``: the caller treats it as absent (a cache miss, no shared active index). Rejections
are logged, rate-limited (:class:`RateLimitedLog`), so a flood of forged reads cannot flood the
log. The key comes from ``OPENBOOK_SERVER_KEY_FILE`` (openbook-secrets makes it); without one a
process makes up its own key and says so: it then trusts only what it sealed itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openbook.security.secrets import read_secret

log = logging.getLogger(__name__)


@dataclass
class RateLimitedLog:
    """Log at most one line per ``every_s`` seconds; the next line counts what it held back."""

    logger: logging.Logger
    every_s: float = 60.0
    _last: float = field(default=-1e18, init=False)
    _held: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def warning(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line went out less than ``every_s`` ago; True if logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._held += 1
                return False
            held, self._held, self._last = self._held, 0, now
        suffix = f" ({held} more since the last such warning)" if held else ""
        self.logger.warning(msg + suffix, *args)
        return True


@dataclass(frozen=True)
class Sealer:
    """Seals and opens values under one server key (bytes, kept out of ``repr``)."""

    key: bytes = field(repr=False)
    rejected: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog(log), compare=False, repr=False
    )

    def _mac(self, redis_key: str, payload: str) -> str:
        message = redis_key.encode() + b"\0" + payload.encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def seal(self, redis_key: str, payload: str) -> str:
        """``payload`` as stored under ``redis_key``."""
        return json.dumps({"v": payload, "mac": self._mac(redis_key, payload)})

    def open(self, redis_key: str, raw: str | bytes | None) -> str | None:
        """The payload sealed in ``raw`` for ``redis_key``; None if absent or not genuine."""
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode(errors="replace")
        try:
            sealed = json.loads(raw)
            payload, mac = sealed["v"], sealed["mac"]
            genuine = (
                isinstance(payload, str)
                and isinstance(mac, str)
                and hmac.compare_digest(mac, self._mac(redis_key, payload))
            )
        except (ValueError, TypeError, KeyError):
            genuine = False
        if genuine:
            return payload
        self.rejected.warning(
            "ignoring %s in redis: not sealed with this deployment's server key "
            "(forged, altered or moved)",
            redis_key,
        )
        return None

    def open_json(self, redis_key: str, raw: str | bytes | None) -> Any:
        """The JSON value sealed in ``raw`` for ``redis_key``; None if absent, not genuine or
        not JSON (each record's reader then checks the value's shape)."""
        payload = self.open(redis_key, raw)
        if not payload:
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None


_EPHEMERAL: Sealer | None = None
_EPHEMERAL_LOCK = threading.Lock()


def load_sealer(key_file: Path | None) -> Sealer:
    """The sealer of ``key_file`` (openbook-secrets' ``server-key``); ``ValueError`` naming the
    file if it cannot be read. None: one random key for this process, with a warning, since
    other processes cannot verify what it seals (nor it theirs)."""
    global _EPHEMERAL
    if key_file is not None:
        return Sealer(read_secret(key_file, "server key (OPENBOOK_SERVER_KEY_FILE)").encode())
    with _EPHEMERAL_LOCK:
        if _EPHEMERAL is None:
            log.warning(
                "OPENBOOK_SERVER_KEY_FILE not set: sealing Redis entries with a key of this "
                "process only; set it (openbook-secrets init) so replicas trust each other"
            )
            _EPHEMERAL = Sealer(secrets.token_bytes(32))
        return _EPHEMERAL


def default_sealer() -> Sealer:
    """The sealer of ``OPENBOOK_SERVER_KEY_FILE`` as the environment says now (what a
    service's settings would read), for code given no sealer of its own."""
    path = os.environ.get("OPENBOOK_SERVER_KEY_FILE", "").strip()
    return load_sealer(Path(path) if path else None)
