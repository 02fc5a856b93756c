"""State that every replica must agree on, kept in Redis: which index is active.

Redis is an optimisation and a coordination channel, never a single point of failure: when
it cannot be reached, reads return ``None`` and writes are skipped with a warning, and each
process keeps serving with what it knows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

ACTIVE_INDEX_KEY = "openbook:active-index"
INDEX_SWAP_CHANNEL = "openbook:index-swaps"
# Hash: service name ("retriever", "generator") -> model version it serves. Part of the
# answer-cache key, so a reloaded model never serves answers computed by the old one.
MODEL_VERSIONS_KEY = "openbook:model-versions"


def publish_model_version(client: redis.Redis, service: str, version: str) -> None:
    try:
        client.hset(MODEL_VERSIONS_KEY, service, version)
    except redis.RedisError as exc:
        log.warning("redis unavailable, %s version %r not shared: %s", service, version, exc)


def redis_client(url: str, timeout_s: float = 0.5) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=True,
    )


class ActiveIndexStore:
    """The active index name in Redis, and a channel announcing swaps."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def get(self) -> str | None:
        try:
            return self.client.get(ACTIVE_INDEX_KEY)
        except redis.RedisError as exc:
            log.warning("redis unavailable, active index unknown: %s", exc)
            return None

    def set(self, name: str) -> bool:
        """Record and announce ``name`` as active; False if Redis could not be reached."""
        try:
            pipe = self.client.pipeline()
            pipe.set(ACTIVE_INDEX_KEY, name)
            pipe.publish(INDEX_SWAP_CHANNEL, name)
            pipe.execute()
            return True
        except redis.RedisError as exc:
            log.warning("redis unavailable, swap to %r not shared: %s", name, exc)
            return False

    def restore(self, name: str) -> None:
        """Write ``name`` back if the key is gone (Redis restarted: it keeps nothing on disk)."""
        self.client.set(ACTIVE_INDEX_KEY, name, nx=True)

    def watch(
        self, on_change: Callable[[], None], stop: threading.Event, check_every_s: float = 2.0
    ) -> threading.Thread:
        """Call ``on_change()`` on every swap announcement, and every ``check_every_s``.

        ``on_change`` must re-read the key (``get``) rather than trust any message: an
        announcement can arrive after a newer swap, and one can be missed while cut off from
        Redis. Reconnects after Redis outages.
        """

        def listen() -> None:
            while not stop.is_set():
                try:
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(INDEX_SWAP_CHANNEL)
                    on_change()
                    last_check = time.monotonic()
                    while not stop.is_set():
                        message = pubsub.get_message(timeout=0.5)
                        announced = message is not None and message.get("type") == "message"
                        if announced or time.monotonic() - last_check > check_every_s:
                            on_change()
                            last_check = time.monotonic()
                except redis.RedisError:
                    stop.wait(1.0)
                except Exception:  # noqa: BLE001 - a failed follow must not kill the watcher
                    log.exception("following the active index failed")
                    stop.wait(1.0)

        thread = threading.Thread(target=listen, name="active-index-watch", daemon=True)
        thread.start()
        return thread
