"""State that every replica must agree on, kept in Redis: which index is active.

Redis is an optimisation and a coordination channel, never a single point of failure: when
it cannot be reached, reads return ``None`` and writes are skipped with a warning, and each
process keeps serving with what it knows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from openbook.sealing import Sealer, default_sealer
from openbook.settings import RedisOptions

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


def redis_client(target: str | RedisOptions, timeout_s: float = 0.5) -> redis.Redis:
    """A client of ``target``: a URL (its own credentials, if any) or a service's
    :class:`~openbook.settings.RedisOptions` (``settings.redis_options()``: user, password
    file, TLS)."""
    options = target if isinstance(target, RedisOptions) else RedisOptions(target, timeout_s)
    return redis.Redis.from_url(options.url, **options.client_kwargs())


class ActiveIndexStore:
    """The active index name in Redis, sealed (openbook.sealing), and a channel announcing
    swaps. A value that is not sealed with the server key reads as no active index: whoever
    can write to Redis cannot choose what replicas serve. Announcements carry nothing to trust:
    they only make a replica re-read the key."""

    def __init__(self, client: redis.Redis, sealer: Sealer | None = None) -> None:
        self.client = client
        self.sealer = sealer or default_sealer()

    def get(self) -> str | None:
        try:
            raw = self.client.get(ACTIVE_INDEX_KEY)
        except redis.RedisError as exc:
            log.warning("redis unavailable, active index unknown: %s", exc)
            return None
        return self.sealer.open(ACTIVE_INDEX_KEY, raw)

    def set(self, name: str) -> bool:
        """Record and announce ``name`` as active; False if Redis could not be reached."""
        try:
            pipe = self.client.pipeline()
            pipe.set(ACTIVE_INDEX_KEY, self.sealer.seal(ACTIVE_INDEX_KEY, name))
            pipe.publish(INDEX_SWAP_CHANNEL, name)
            pipe.execute()
            return True
        except redis.RedisError as exc:
            log.warning("redis unavailable, swap to %r not shared: %s", name, exc)
            return False

    def restore(self, name: str) -> None:
        """Write ``name`` back if the key is gone (Redis restarted: it keeps nothing on disk)
        or holds something not genuine (forged: replaced by what this replica serves)."""
        sealed = self.sealer.seal(ACTIVE_INDEX_KEY, name)
        if not self.client.set(ACTIVE_INDEX_KEY, sealed, nx=True):
            raw = self.client.get(ACTIVE_INDEX_KEY)
            if raw is not None and self.sealer.open(ACTIVE_INDEX_KEY, raw) is None:
                # Compare-and-set: a genuine swap written meanwhile is never overwritten.
                with self.client.pipeline() as pipe:
                    try:
                        pipe.watch(ACTIVE_INDEX_KEY)
                        if pipe.get(ACTIVE_INDEX_KEY) == raw:
                            pipe.multi()
                            pipe.set(ACTIVE_INDEX_KEY, sealed)
                            pipe.execute()
                    except redis.WatchError:
                        pass

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


# --- model reloads that reach every replica -------------------------------------------------
#
# ``POST /admin/reload-model`` records the *desired* checkpoint in Redis (a hash: a fresh
# request ``id``, the ``checkpoint`` as the client named it, ``at``) and announces it; every
# retriever and generator replica runs a :class:`ModelFollower` that loads it with its own
# verified-load path and switches atomically, or records why it could not. Each replica
# publishes its own state under ``openbook:replica:<service>:<replica id>`` with a TTL, so a
# replica that is gone drops out of the listing by itself.

DESIRED_MODEL_KEY = "openbook:desired-model"
MODEL_RELOAD_CHANNEL = "openbook:model-reloads"
REPLICA_KEY_PREFIX = "openbook:replica:"
# The checkpoint the first replica resolved the request to (relative to the checkpoint root):
# the others load that one, so a checkpoint written meanwhile ("latest" moving) cannot split
# the replicas across two versions.
RESOLVED_FIELD = "resolved"
REPLICA_TTL_S = 15

# States a replica reports about the latest desired model.
CONVERGED, FAILED, LOADING = "converged", "failed", "loading"


# One checkpoint load at a time in a process: loading with transformers (meta-device init)
# is not thread-safe, and replicas running in one process (tests, benchmarks) would otherwise
# load at the same moment. A deployed replica is a process of its own: nothing waits.
_LOADS = threading.Lock()


def replica_key(service: str, replica: str) -> str:
    return f"{REPLICA_KEY_PREFIX}{service}:{replica}"


def new_replica_id() -> str:
    """Host, pid and a random suffix: unique even for two replicas in one process (tests)."""
    import os
    import socket
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ModelFollower:
    """One replica's follower of the desired model in Redis.

    ``load(requested)`` loads and switches to the checkpoint ``requested`` names (relative to,
    and confined to, the service's checkpoint root), raising if it is refused: the service's
    own verified-load path. ``resolve(requested)`` returns the checkpoint directory's path
    relative to the root and its version without loading it. ``version()`` is the version
    served now.
    """

    def __init__(
        self,
        client: redis.Redis,
        service: str,
        *,
        load: Callable[[str], None],
        resolve: Callable[[str], tuple[str, str]],
        version: Callable[[], str],
        replica: str | None = None,
        poll_s: float = 0.5,
        ttl_s: int = REPLICA_TTL_S,
        on_state: Callable[[dict], None] | None = None,
    ) -> None:
        self.client = client
        self.service = service
        self.replica = replica or new_replica_id()
        self._load, self._resolve, self._version = load, resolve, version
        self.poll_s = poll_s
        self.ttl_s = ttl_s
        self.on_state = on_state
        self.handled: str | None = None  # the desired request id last acted on
        self.state = CONVERGED
        self.error = ""
        self.checkpoint = ""
        self._lock = threading.Lock()
        self._warned = False

    # -- state --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "service": self.service,
            "replica": self.replica,
            "version": self._version(),
            "state": self.state,
            "request": self.handled or "",
            "checkpoint": self.checkpoint,
            "error": self.error,
            "updated": time.time(),
        }

    def publish(self) -> None:
        state = self.snapshot()
        if self.on_state is not None:
            self.on_state(state)
        self.client.set(replica_key(self.service, self.replica), json.dumps(state), ex=self.ttl_s)

    # -- following ----------------------------------------------------------------------
    def sync(self) -> bool:
        """Act on the desired model if it changed since last time; publish this replica's
        state. False when Redis could not be reached (nothing changed here)."""
        with self._lock:
            try:
                desired = self.client.hgetall(DESIRED_MODEL_KEY)
                request = desired.get("id") if desired else None
                if request and request != self.handled:
                    self.handled, self.state, self.error = request, LOADING, ""
                    self.checkpoint = desired.get("checkpoint", "")
                    self.publish()
                    self._follow(desired)
                self.publish()
                self._warned = False
                return True
            except redis.RedisError as exc:
                if not self._warned:
                    log.warning(
                        "redis unavailable, %s cannot follow reloads: %s", self.service, exc
                    )
                    self._warned = True
                return False

    def _follow(self, desired: dict) -> None:
        requested = desired.get(RESOLVED_FIELD) or desired.get("checkpoint", "")
        try:
            relative, version = self._resolve(requested)
            if not desired.get(RESOLVED_FIELD):
                # The first replica pins what "latest" meant; take whatever was pinned first.
                self.client.hsetnx(DESIRED_MODEL_KEY, RESOLVED_FIELD, relative)
                pinned = self.client.hget(DESIRED_MODEL_KEY, RESOLVED_FIELD)
                if pinned and pinned != relative:
                    relative, version = self._resolve(pinned)
            self.checkpoint = relative
            if version != self._version():
                with _LOADS:
                    self._load(relative)
            self.state = CONVERGED
            log.info("%s replica %s serves %s", self.service, self.replica, self._version())
        except redis.RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused: keep serving, report why
            self.state, self.error = FAILED, str(exc) or type(exc).__name__
            log.error(
                "%s replica %s refused checkpoint %r: %s",
                self.service,
                self.replica,
                requested,
                self.error,
            )

    def start(self, stop: threading.Event) -> threading.Thread:
        """Follow in a thread until ``stop``: on every announcement, and every ``poll_s``; a
        second thread keeps the state key alive while a load (minutes for a large model)
        holds ``sync``. The key is deleted once both have stopped."""

        def heartbeat() -> None:
            while not stop.wait(self.ttl_s / 3):
                with contextlib.suppress(redis.RedisError):
                    self.publish()

        beat = threading.Thread(target=heartbeat, name=f"{self.service}-replica-beat", daemon=True)

        def run() -> None:
            while not stop.is_set():
                try:
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(MODEL_RELOAD_CHANNEL)
                    while not stop.is_set():
                        self.sync()
                        pubsub.get_message(timeout=self.poll_s)
                except redis.RedisError:
                    self.sync()  # warns once
                    stop.wait(1.0)
                except Exception:  # noqa: BLE001 - a failed follow must not kill the follower
                    log.exception("following the desired model failed")
                    stop.wait(1.0)
            beat.join(5)
            with contextlib.suppress(redis.RedisError):
                self.client.delete(replica_key(self.service, self.replica))

        beat.start()
        thread = threading.Thread(target=run, name=f"{self.service}-model-follow", daemon=True)
        thread.start()
        return thread


def replica_metrics(metrics) -> Callable[[dict], None] | None:
    """An ``on_state`` for :class:`ModelFollower` that shows the replica's id and the state of
    the latest reload on a service's ``openbook_serving_info`` (beside its model version)."""
    if metrics is None:
        return None

    def record(state: dict) -> None:
        metrics.set_serving("replica", state["replica"])
        metrics.set_serving("reload", state["state"])

    return record
