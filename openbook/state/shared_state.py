"""The sync half of the Redis protocol (:mod:`openbook.state.redis_protocol`), as the retriever and
the generator speak it over ``redis.Redis``: the active index, the model version each serves,
and following the desired model.

Redis is an optimisation and a coordination channel, never a single point of failure: when
it cannot be reached, reads return ``None`` and writes are skipped with a warning, and each
process keeps serving with what it knows. Key names and encodings are the protocol module's
only; this module only executes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol, cast

import redis

from openbook.config.settings import RedisOptions
from openbook.security.sealing import Sealer, default_sealer
from openbook.state.redis_protocol import (
    ACTIVE_INDEX_KEY,
    CONVERGED,
    DESIRED_MODEL_KEY,
    FAILED,
    INDEX_STATE_KEY,
    INDEX_SWAP_CHANNEL,
    LOADING,
    MODEL_RELOAD_CHANNEL,
    MODEL_VERSIONS_KEY,
    REPLICA_TTL_S,
    RESOLVED_FIELD,
    DesiredModel,
    IndexState,
    ModelVersion,
    ReplicaState,
    encode_replica_state,
    new_index_state,
    next_seq,
    open_active_index,
    open_desired_model,
    open_index_state,
    open_model_version,
    open_pinned_model,
    raised_index_state,
    replica_key,
    seal_active_index,
    seal_index_state,
    seal_model_version,
    seal_pinned_model,
)

log = logging.getLogger(__name__)


def publish_model_version(
    client: redis.Redis, service: str, version: str, sealer: Sealer | None = None
) -> None:
    """Share the model version ``service`` serves now, sealed, numbered after the record it
    replaces (a gateway never goes back to an older one: redis_protocol's ``next_seq``)."""
    sealer = sealer or default_sealer()
    try:
        raw = cast(str | None, client.hget(MODEL_VERSIONS_KEY, service))
        current = open_model_version(sealer, service, raw)
        record = ModelVersion(
            version=version, seq=next_seq(current["seq"] if current is not None else None)
        )
        client.hset(MODEL_VERSIONS_KEY, service, seal_model_version(sealer, service, record))
    except redis.RedisError as exc:
        log.warning("redis unavailable, %s version %r not shared: %s", service, version, exc)


def publish_index_version(
    client: redis.Redis, index: str, version: int, shard: str = "", sealer: Sealer | None = None
) -> None:
    """Share ``index``'s version (on ``shard``; ``""``: unsharded) after an acknowledged write,
    or as the version a replica serves: the gateway keys cached answers by it. Only ever raised
    (compare-and-set); a record that is absent or not genuine is made afresh under a new epoch.
    Without Redis there is no answer cache to invalidate, so a failure is logged, never
    raised."""
    sealer = sealer or default_sealer()
    try:
        for _ in range(_CAS_TRIES):
            with client.pipeline() as pipe:
                try:
                    pipe.watch(INDEX_STATE_KEY)
                    raw = cast(str | None, pipe.hget(INDEX_STATE_KEY, index))
                    current = _not_replayed(index, open_index_state(sealer, index, raw))
                    raised = raised_index_state(current, shard, version)
                    if raised is None:
                        return
                    pipe.multi()
                    pipe.hset(INDEX_STATE_KEY, index, seal_index_state(sealer, index, raised))
                    pipe.execute()
                    _saw_generation(index, raised["gen"])
                    return
                except redis.WatchError:
                    continue  # another writer came first: read again
        log.warning("index %r version %d not shared: too many concurrent writers", index, version)
    except redis.RedisError as exc:
        log.warning("redis unavailable, index %r version %d not shared: %s", index, version, exc)


# Compare-and-set retries before giving up on sharing a version (writers of one index are few).
_CAS_TRIES = 16

# The newest generation of each index's state this process read or wrote: a genuine state of
# an older one found in Redis was written back by someone (a replay of a deleted index's
# state) and is made afresh, as one that is not genuine is. Generations follow the wall clock
# (redis_protocol.next_seq), so one made afresh after Redis lost its keys is newer still.
_GENERATIONS: dict[str, int] = {}
_GENERATIONS_LOCK = threading.Lock()


def _saw_generation(index: str, gen: int) -> None:
    with _GENERATIONS_LOCK:
        _GENERATIONS[index] = max(gen, _GENERATIONS.get(index, 0))


def _not_replayed(index: str, state: IndexState | None) -> IndexState | None:
    """``state``, or None when it is older than one this process saw (replayed: logged)."""
    if state is None:
        return None
    with _GENERATIONS_LOCK:
        newest = _GENERATIONS.get(index, 0)
    if state["gen"] < newest:
        log.warning("index %r: an older state in redis (replayed): made afresh", index)
        return None
    _saw_generation(index, state["gen"])
    return state


def index_renewed(client: redis.Redis, index: str, sealer: Sealer | None = None) -> None:
    """``index`` was created or deleted by this retriever, or its directory removed or replaced
    out of band: make its state afresh (a new epoch, no versions), as the gateway's
    ``index_deleted`` does for a deletion through its API. The retriever is the authority on
    an index's life: a deletion no gateway shared (its Redis down then, or the retriever's own
    API called) still leaves no new index of that name at the old epoch, where it would meet
    the old one's cached answers at the versions they share. Logged, never raised, without
    Redis (no cache to invalidate)."""
    sealer = sealer or default_sealer()
    try:
        raw = cast(str | None, client.hget(INDEX_STATE_KEY, index))
        fresh = new_index_state(_not_replayed(index, open_index_state(sealer, index, raw)))
        with _GENERATIONS_LOCK:
            fresh["gen"] = max(fresh["gen"], _GENERATIONS.get(index, 0) + 1)
        client.hset(INDEX_STATE_KEY, index, seal_index_state(sealer, index, fresh))
        _saw_generation(index, fresh["gen"])
    except redis.RedisError as exc:
        log.warning("redis unavailable, index %r: its epoch not renewed: %s", index, exc)


def index_vanished(client: redis.Redis, index: str, sealer: Sealer | None = None) -> None:
    """``index``'s directory was removed out of band (not through DeleteIndex): its state made
    afresh (:func:`index_renewed`), so no gateway serves a cached answer from it again."""
    index_renewed(client, index, sealer)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_client(target: str | RedisOptions, timeout_s: float = 0.5) -> redis.Redis:
    """A client of ``target``: a URL (its own credentials, if any) or a service's
    :class:`~openbook.config.settings.RedisOptions` (``settings.redis_options()``: user, password
    file, TLS)."""
    options = target if isinstance(target, RedisOptions) else RedisOptions(target, timeout_s)
    return redis.Redis.from_url(options.url, **options.client_kwargs())


class ActiveIndexStore:
    """The active index name in Redis, sealed (openbook.security.sealing), and a channel announcing
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
        return open_active_index(self.sealer, raw)

    def set(self, name: str) -> bool:
        """Record and announce ``name`` as active; False if Redis could not be reached."""
        try:
            pipe = self.client.pipeline()
            pipe.set(ACTIVE_INDEX_KEY, seal_active_index(self.sealer, name))
            pipe.publish(INDEX_SWAP_CHANNEL, name)
            pipe.execute()
            return True
        except redis.RedisError as exc:
            log.warning("redis unavailable, swap to %r not shared: %s", name, exc)
            return False

    def restore(self, name: str) -> None:
        """Write ``name`` back if the key is gone (Redis restarted: it keeps nothing on disk)
        or holds something not genuine (forged: replaced by what this replica serves)."""
        sealed = seal_active_index(self.sealer, name)
        if not self.client.set(ACTIVE_INDEX_KEY, sealed, nx=True):
            raw = self.client.get(ACTIVE_INDEX_KEY)
            if raw is not None and open_active_index(self.sealer, raw) is None:
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


# --- following the desired model (openbook.state.redis_protocol says what it is) ------------------

# One checkpoint load at a time in a process: loading with transformers (meta-device init)
# is not thread-safe, and replicas running in one process (tests, benchmarks) would otherwise
# load at the same moment. A deployed replica is a process of its own: nothing waits.
_LOADS = threading.Lock()


def new_replica_id() -> str:
    """Host, pid and a random suffix: unique even for two replicas in one process (tests)."""
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
        load: Callable[[str], object],  # what it returns is not used
        resolve: Callable[[str], tuple[str, str]],
        version: Callable[[], str],
        replica: str | None = None,
        poll_s: float = 0.5,
        ttl_s: int = REPLICA_TTL_S,
        on_state: Callable[[ReplicaState], None] | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.client = client
        self.sealer = sealer or default_sealer()
        self.service = service
        self.replica = replica or new_replica_id()
        self._load, self._resolve, self._version = load, resolve, version
        self.poll_s = poll_s
        self.ttl_s = ttl_s
        self.on_state = on_state
        self.handled: str | None = None  # the desired request id last acted on
        self.handled_seq = 0  # its sequence number: an older request is never followed again
        self.state = CONVERGED
        self.error = ""
        self.checkpoint = ""
        self._lock = threading.Lock()
        self._warned = False

    # -- state --------------------------------------------------------------------------
    def snapshot(self) -> ReplicaState:
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
        key = replica_key(self.service, self.replica)
        self.client.set(key, encode_replica_state(self.sealer, key, state), ex=self.ttl_s)

    # -- following ----------------------------------------------------------------------
    def sync(self) -> bool:
        """Act on the desired model if it changed since last time; publish this replica's
        state. False when Redis could not be reached (nothing changed here)."""
        with self._lock:
            try:
                # decode_responses=True (RedisOptions): replies are str, which redis-py's
                # annotations cannot tell from the client's type.
                fields = cast(dict[str, str], self.client.hgetall(DESIRED_MODEL_KEY))
                # Not genuine (an insider's HSET): no reload asked for. An older genuine
                # request written back (a replay): not followed again.
                desired = open_desired_model(self.sealer, fields) if fields else None
                if (
                    desired is not None
                    and desired["id"] != self.handled
                    and desired["seq"] > self.handled_seq
                ):
                    self.handled, self.state, self.error = desired["id"], LOADING, ""
                    self.handled_seq = desired["seq"]
                    self.checkpoint = desired["checkpoint"]
                    self.publish()
                    self._follow(desired, fields)
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

    def _follow(self, desired: DesiredModel, fields: Mapping[str, str]) -> None:
        pinned = open_pinned_model(self.sealer, desired["id"], fields.get(RESOLVED_FIELD))
        requested = pinned if pinned is not None else desired["checkpoint"]
        try:
            relative, version = self._resolve(requested)
            if pinned is None:
                # The first replica pins what "latest" meant; take whatever was pinned first.
                pinned = self._pin(desired["id"], relative)
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

    def _pin(self, request: str, relative: str) -> str | None:
        """Pin ``request`` to ``relative`` unless a replica pinned it first (compare-and-set:
        a pin that is not genuine, or of another request, is replaced); the pin that holds."""
        sealed = seal_pinned_model(self.sealer, request, relative)
        if self.client.hsetnx(DESIRED_MODEL_KEY, RESOLVED_FIELD, sealed):
            return relative
        for _ in range(_CAS_TRIES):
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(DESIRED_MODEL_KEY)
                    raw = cast(str | None, pipe.hget(DESIRED_MODEL_KEY, RESOLVED_FIELD))
                    pinned = open_pinned_model(self.sealer, request, raw)
                    if pinned is not None:
                        return pinned
                    pipe.multi()
                    pipe.hset(DESIRED_MODEL_KEY, RESOLVED_FIELD, sealed)
                    pipe.execute()
                    return relative
                except redis.WatchError:
                    continue
        return None

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


class ServingInfo(Protocol):
    """What :func:`replica_metrics` needs of a service's metrics (``ServiceMetrics``)."""

    def set_serving(self, kind: str, name: str) -> None: ...


def replica_metrics(metrics: ServingInfo | None) -> Callable[[ReplicaState], None] | None:
    """An ``on_state`` for :class:`ModelFollower` that shows the replica's id and the state of
    the latest reload on a service's ``openbook_serving_info`` (beside its model version)."""
    if metrics is None:
        return None

    def record(state: ReplicaState) -> None:
        metrics.set_serving("replica", state["replica"])
        metrics.set_serving("reload", state["state"])

    return record
