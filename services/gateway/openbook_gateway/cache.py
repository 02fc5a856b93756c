"""Answers cached in Redis, keyed by everything that determines them.

The key includes the index that computed the answer, so after a swap a lookup (keyed by the
newly active index) can never return an answer computed on the other one; and the model
versions that computed it, so a reloaded model never serves the old one's answers; and the
index's version (its count of acknowledged document writes), so no cached answer outlives the
knowledge it came from. The lookup happens before retrieval, so the version it keys by is the
one known then: the highest of what the retrievers published in Redis (the index's sealed
state, ``INDEX_STATE_KEY``) and what this gateway saw last (its own writes' replies, its
answers' ``index_version``). Versions only grow, so either source can only make a lookup
newer: a lookup can miss an answer still good, never hit one computed on fewer writes than it
knows of. The key also holds the index's epoch, a random token made afresh whenever its state
is (the index deleted, its directory replaced, its state in Redis gone or not genuine): a new
index of a deleted one's name counts versions from 0 again and must not meet the old one's
answers. An answer is stored under the epoch its lookup read, and only when the published
version it read is the one that computed it (``RetrieveResponse.index_version``): a state
made afresh after a loss holds a sharded index's versions only as its shards publish them
again, and until then keys nothing. A state Redis does not hold is made afresh (a new epoch,
no versions); one that is not genuine is ignored, logged, and the index neither looked up nor
stored until a retriever makes it afresh: an insider's forged, lowered or deleted version or
epoch only causes misses. A genuine state older than one this gateway read (a lower
generation: an index's state before its deletion, written back; or a lower version under the
same epoch) is refused, or raised to what was read, the same way; and so is a model-version
record that is not genuine, or older than one read (a replay keying lookups by a model
replaced since). When Redis is unreachable the cache is skipped, never an error.

Entries are sealed with the server key (openbook.security.sealing), bound to their key: one written
or altered by anyone else (Redis's password is not enough) is a miss, logged, and the answer is
computed afresh; the active index read from Redis is trusted the same way only. Key names
and encodings are ``openbook.state.redis_protocol``'s, the Redis calls
``openbook.state.shared_state_aio``'s: this module holds the gateway's policy (what keys an answer,
what to do without Redis).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from redis.exceptions import RedisError

from openbook.config.settings import RedisOptions
from openbook.security.sealing import RateLimitedLog, Sealer
from openbook.state.redis_protocol import IndexState, answer_key, index_version_of
from openbook.state.shared_state_aio import (
    ServingState,
    async_redis_client,
    first_index_state,
    index_deleted,
    read_answer,
    read_serving,
    write_answer,
)
from openbook.validation.metadata_filter import MetadataFilter
from openbook_gateway.schemas import AnswerRequest

log = logging.getLogger(__name__)
# Replayed records: logged at most once a minute, however many lookups meet them.
replayed = RateLimitedLog(log)

# Fields of AnswerRequest that change the answer (and so belong in the cache key).
ANSWER_PARAMS = (
    "question",
    "k",
    "decoding",
    "num_beams",
    "max_new_tokens",
    "min_new_tokens",
    "num_return_sequences",
    "length_penalty",
    # None (the index's default) keys apart from the mode it names: the default can change with
    # the index's views, and the key holds the index's name, not its views.
    "retrieval",
)


# Fields that decide a sampled answer too (temperature > 0; at 0 they change nothing, and keys
# stay those of before sampling). A sample without a seed is never cached
# (AnswerRequest.cacheable).
SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "seed")


def answer_params(
    body: AnswerRequest, k: int, where: MetadataFilter | None | Literal["body"] = "body"
) -> dict[str, Any]:
    """What decides an answer, with ``k`` resolved (a request naming no k and one naming the
    model's default share their key) and the metadata filter in its canonical form (filters
    that mean the same share their key; no filter and ``{}`` share the unfiltered one's).

    ``where`` is the filter retrieval runs with, when it is not the body's alone: a key's
    tenant filter ANDed with it (issue 43). It, not the body's, keys the answer, so an answer
    computed from one tenant's passages is never found by another's lookup; with the index
    the key names (the answer key's index), the whole of what a key may read is in the key."""
    fields = set(ANSWER_PARAMS) | (set(SAMPLING_PARAMS) if body.sampling else set())
    params = {**body.model_dump(include=fields), "k": k}
    if where == "body":
        where = body.metadata_filter()
    if where is not None:
        params["filter"] = where.canonical()
    return params


class AnswerCache:
    """The gateway's answer cache, and what it saw serve last (Redis is the shared truth;
    this gateway's memory covers a Redis that lost its keys)."""

    def __init__(self, redis: RedisOptions, ttl_s: int, sealer: Sealer) -> None:
        self.ttl_s = ttl_s
        self.sealer = sealer
        self.client = async_redis_client(redis)
        # What this gateway saw serve last: covers a Redis that lost its keys.
        self.last_index: str | None = None
        self.last_versions: dict[str, str] = {}
        # Each index's version as this gateway last saw it (module docstring).
        self.last_index_versions: dict[str, int] = {}
        # Each index's (epoch, version) its last lookup keyed by, when its state in Redis was
        # genuine: what a computed answer is stored under (module docstring). Absent: no store.
        self.index_keys: dict[str, tuple[str, int]] = {}
        # The indexes whose state the last lookup found not genuine: nothing stored for them.
        self._forged: set[str] = set()
        # The newest genuine record this gateway read, by index (its generation, epoch and
        # highest version) and by service (its model record's sequence number): an older
        # one written back (a replay) is refused like a forged one (module docstring).
        self._seen_states: dict[str, tuple[int, str, int]] = {}
        self._seen_models: dict[str, int] = {}

    async def lookup(self, index: str | None, params: dict[str, Any]) -> dict[str, Any] | None:
        """The stored answer for ``params`` on ``index`` (None: the active index), if any.

        Keyed by the index and model versions that would answer now: Redis is the shared
        truth (the active index, the versions the services announced), what this gateway saw
        last fills in what Redis does not know. An index whose state in Redis is not genuine
        is not looked up (nor its answers stored) until a retriever makes it afresh, under a
        new epoch; one Redis does not hold is made afresh here."""
        serving = await self.serving()
        index = index or serving.active_index or self.last_index
        versions = {**self.last_versions, **serving.model_versions}
        if not index:
            return None
        state = serving.index_state(index)
        if state is None and index not in serving.index_states and serving.sealer is not None:
            state = await self._first_state(index)  # Redis lost it, or never had it
        published = self._newest(index, state) if state is not None else None
        if state is None or published is None:
            self.index_keys.pop(index, None)
            self._forged.add(index)
            return None
        self._forged.discard(index)
        self.index_keys[index] = (state["epoch"], published)
        if not versions or not self._models_newest(serving):
            return None
        index_version = max(published, self.last_index_versions.get(index, 0))
        return await self.get(
            index, {**params, "models": versions, **self._index_key(state["epoch"], index_version)}
        )

    def _newest(self, index: str, state: IndexState) -> int | None:
        """``index``'s published version in ``state``, at least the highest this gateway read
        under its epoch; None for a state older than one read before (replayed: logged)."""
        gen, epoch, published = state["gen"], state["epoch"], index_version_of(state)
        seen = self._seen_states.get(index)
        if seen is not None and (gen, epoch) != seen[:2]:
            if gen <= seen[0] and gen > 0:  # 0: written before states had a generation
                replayed.warning("ignoring an older state of index %r in redis (replayed)", index)
                return None
        elif seen is not None:
            published = max(published, seen[2])
        self._seen_states[index] = (gen, epoch, published)
        return published

    def _models_newest(self, serving: ServingState) -> bool:
        """Whether every model record read is genuine and none older than one read before;
        else the models that would answer are unknown: no lookup (a miss)."""
        if serving.unsealed_models:
            return False
        for service, seq in serving.model_seqs.items():
            if seq < self._seen_models.get(service, 0):
                replayed.warning("ignoring an older %s model version in redis (replayed)", service)
                return False
        self._seen_models.update(serving.model_seqs)
        return True

    async def _first_state(self, index: str) -> IndexState | None:
        try:
            return await first_index_state(self.client, self.sealer, index)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable: %s", exc)
            return None

    @staticmethod
    def _index_key(epoch: str, version: int) -> dict[str, Any]:
        return {"index_version": version, "index_epoch": epoch}

    def answered(
        self, index: str, index_version: int, versions: dict[str, str], active: bool
    ) -> None:
        """An answer was computed on ``index`` at ``index_version`` (the active one if
        ``active``) by ``versions``."""
        if active:
            self.last_index = index
        self.last_versions = versions
        self.wrote(index, index_version)

    def wrote(self, index: str, version: int) -> None:
        """``index`` is at ``version`` or later (a write's reply, an answer's index_version)."""
        self.last_index_versions[index] = max(version, self.last_index_versions.get(index, 0))

    def forget(self, index: str) -> None:
        """A new index named ``index`` starts again at version 0."""
        self.last_index_versions.pop(index, None)

    async def deleted(self, index: str) -> None:
        """``index`` was deleted: no gateway's lookup meets its answers again (its state in
        Redis made afresh, under a new epoch; without Redis there is no cache to meet)."""
        self.forget(index)
        self.index_keys.pop(index, None)
        try:
            await index_deleted(self.client, self.sealer, index)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable, deletion of index %r not shared: %s", index, exc)

    def swapped(self, active: str) -> None:
        self.last_index = active

    async def store(
        self,
        index: str,
        index_version: int,
        params: dict[str, Any],
        versions: dict[str, str],
        answer: dict[str, Any],
    ) -> None:
        """File ``answer`` under the index's epoch, its version and the model versions that
        computed it: only when the lookup found the index's state genuine and at the version
        that computed the answer (a state that lags behind, or a sharded index's state made
        afresh before every shard published again, keys no answer)."""
        key = self.index_keys.get(index)
        if key is None and index not in self._forged:
            # No lookup named this index (the active one, before this gateway or Redis knew
            # which it is): its state now.
            state = await self._first_state(index)
            published = self._newest(index, state) if state is not None else None
            key = (state["epoch"], published) if state and published is not None else None
        if key is None or key[1] != index_version:
            return
        await self.put(index, {**params, "models": versions, **self._index_key(*key)}, answer)

    async def serving(self) -> ServingState:
        """What the services announced (nothing when Redis is unreachable)."""
        try:
            return await read_serving(self.client, self.sealer)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable: %s", exc)
            return ServingState(None, {}, {})

    async def get(self, index: str, params: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return await read_answer(self.client, self.sealer, answer_key(index, params))
        except (RedisError, OSError) as exc:
            log.warning("cache read skipped, redis unavailable: %s", exc)
            return None

    async def put(self, index: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
        key = answer_key(index, params)
        try:
            await write_answer(self.client, self.sealer, key, answer, self.ttl_s)
        except (RedisError, OSError) as exc:
            log.warning("cache write skipped, redis unavailable: %s", exc)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.client.aclose()
