"""The Redis protocol every process of a deployment speaks: key names and codecs, once.

What replicas agree on through Redis, and who writes / reads it:

- the active index (``ACTIVE_INDEX_KEY``, sealed; announced on ``INDEX_SWAP_CHANNEL``):
  written by the retriever that swapped, read by every retriever and the gateway's cache;
- the model versions served (hash ``MODEL_VERSIONS_KEY``: service -> sealed
  :class:`ModelVersion`, its sequence number only raised): written by the retriever and the
  generator, read by the gateway (part of the answer-cache key);
- the desired model (hash ``DESIRED_MODEL_KEY``: the sealed request, :class:`DesiredModel`,
  and, once a replica pinned it, the sealed checkpoint it resolved to; announced on
  ``MODEL_RELOAD_CHANNEL``): written by the gateway's ``POST /admin/reload-model``, followed
  by every retriever and generator replica (never back to an older request than one it
  followed);
- each replica's state (sealed JSON under ``replica_key(service, replica)``, with a TTL):
  written by the replica, listed and waited on by the gateway (a record not sealed for its key
  is no replica);
- each index's state (hash ``INDEX_STATE_KEY``: index -> sealed :class:`IndexState`, a random
  epoch and each shard's version; versions only ever raised): written by the retriever that
  acknowledged a document write or serves the index
  (:func:`openbook.state.shared_state.publish_index_version`), made afresh (a new epoch) by the
  gateway that deleted an index or a retriever that found an index's directory removed or
  replaced out of band (:func:`openbook.state.shared_state.index_vanished`), read by every gateway
  (part of the answer-cache key, so a new index of a deleted one's name never serves the old
  one's answers);
- cached answers (sealed, under ``answer_key(index, params)``, with a TTL): the gateway's;
- stored responses (sealed, under ``response_key(response_id)``, with a TTL): the conversation
  state a ``/v1/responses`` call's ``previous_response_id`` continues, the gateway's.

Invariants: this module does no I/O and imports no Redis client; the sync half
(:mod:`openbook.state.shared_state`, the services) and the async half
(:mod:`openbook.state.shared_state_aio`, the gateway) execute these over their clients, so changing
a key or an encoding is a change here only. Every value a service acts on (the active index,
the index states, the model versions, the desired model, the replicas' states, the answers,
the stored responses) is sealed (:mod:`openbook.security.sealing`) bound to its key: opening
anything not sealed with the server key gives ``None``, read as absent. The records whose order
matters (index states, model versions, the desired model) carry a number that only grows, so
a reader that saw a record refuses an older genuine one written back (a replay).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any, TypedDict

from openbook.security.sealing import Sealer

# --- the active index -----------------------------------------------------------------------

ACTIVE_INDEX_KEY = "openbook:active-index"
# Announcements carry nothing to trust: they only make a replica re-read the key.
INDEX_SWAP_CHANNEL = "openbook:index-swaps"


def seal_active_index(sealer: Sealer, name: str) -> str:
    """``name`` as stored under :data:`ACTIVE_INDEX_KEY`."""
    return sealer.seal(ACTIVE_INDEX_KEY, name)


def open_active_index(sealer: Sealer, raw: str | bytes | None) -> str | None:
    """The active index stored as ``raw``; None if absent or not sealed with the server key
    (whoever can write to Redis cannot choose what replicas serve)."""
    return sealer.open(ACTIVE_INDEX_KEY, raw)


# --- the model versions served --------------------------------------------------------------

# Hash: service name ("retriever", "generator") -> the model version it serves, sealed
# (:class:`ModelVersion`, bound to the hash and the field). Part of the answer-cache key, so a
# reloaded model never serves answers computed by the old one. Each record carries a sequence
# number that only grows (:func:`next_seq`): a gateway that saw a record never believes an
# older genuine one written back (a replay that would key lookups by a model replaced since).
MODEL_VERSIONS_KEY = "openbook:model-versions"


class ModelVersion(TypedDict):
    version: str
    seq: int  # raised with every publication (next_seq): orders genuine records


def next_seq(previous: int | None) -> int:
    """The sequence number of a record replacing one numbered ``previous`` (None: none that
    is genuine): above it, and at least the wall clock in nanoseconds, so a record made
    afresh after its predecessor was lost still sorts after the ones a reader saw before."""
    return max((previous or 0) + 1, time.time_ns())


def model_version_seal_key(service: str) -> str:
    return f"{MODEL_VERSIONS_KEY}[{service}]"


def seal_model_version(sealer: Sealer, service: str, record: ModelVersion) -> str:
    return sealer.seal(model_version_seal_key(service), json.dumps(record, sort_keys=True))


def open_model_version(
    sealer: Sealer, service: str, raw: str | bytes | None
) -> ModelVersion | None:
    """``service``'s model version stored as ``raw``; None if absent, not genuine or not a
    record (an insider's plain ``HSET`` reads as no version: the cache is not looked up)."""
    record = _sequenced(sealer.open_json(model_version_seal_key(service), raw), "version")
    if record is None:
        return None
    return ModelVersion(version=record["version"], seq=record["seq"])


def _sequenced(record: object, name: str) -> dict[str, Any] | None:
    """``record`` if it is a sequenced record named by ``name`` (a dict with a non-empty
    string ``name`` and an int ``seq``: a model version, a desired model), else None."""
    if (
        isinstance(record, dict)
        and isinstance(record.get(name), str)
        and record[name]
        and type(record.get("seq")) is int
    ):
        return record
    return None


# --- model reloads that reach every replica -------------------------------------------------
#
# ``POST /admin/reload-model`` records the *desired* checkpoint (a hash: a fresh request
# ``id``, the ``checkpoint`` as the client named it, ``at``) and announces it; every retriever
# and generator replica loads it with its own verified-load path and switches atomically, or
# records why it could not. Each replica publishes its own state under
# ``replica_key(service, replica)`` with a TTL, so a replica that is gone drops out of the
# listing by itself.

DESIRED_MODEL_KEY = "openbook:desired-model"
# The desired-model hash's fields, each sealed bound to the hash and the field: the request
# (:class:`DesiredModel`) and, once a replica pinned it, the checkpoint it resolved to
# (:class:`PinnedModel`, naming its request so that no pin is carried over to another).
DESIRED_RECORD_FIELD = "record"
MODEL_RELOAD_CHANNEL = "openbook:model-reloads"
REPLICA_KEY_PREFIX = "openbook:replica:"
# Every replica's state key (a SCAN pattern).
REPLICA_KEY_PATTERN = REPLICA_KEY_PREFIX + "*"
# Fields of the desired-model hash: the request's id, the checkpoint as the client named it
# ('' : the latest), when it was asked for (time.time()).
REQUEST_FIELD, CHECKPOINT_FIELD, AT_FIELD = "id", "checkpoint", "at"
# The checkpoint the first replica resolved the request to (relative to the checkpoint root):
# the others load that one, so a checkpoint written meanwhile ("latest" moving) cannot split
# the replicas across two versions.
RESOLVED_FIELD = "resolved"
REPLICA_TTL_S = 15

# States a replica reports about the latest desired model.
CONVERGED, FAILED, LOADING = "converged", "failed", "loading"


def replica_key(service: str, replica: str) -> str:
    return f"{REPLICA_KEY_PREFIX}{service}:{replica}"


def desired_model_record(request: str, checkpoint: str, at: float) -> dict[str, str]:
    """The desired model of reload ``request`` (its id) asking for ``checkpoint``, as the
    gateway reports it (``GET /admin/replicas``)."""
    return {REQUEST_FIELD: request, CHECKPOINT_FIELD: checkpoint, AT_FIELD: str(at)}


def desired_checkpoint(desired: Mapping[str, str]) -> str:
    """What a replica loads for ``desired``: the checkpoint pinned by the first replica, else
    the one the client named ('' : the latest)."""
    return desired.get(RESOLVED_FIELD) or desired.get(CHECKPOINT_FIELD, "")


class DesiredModel(TypedDict):
    id: str  # the reload request's id
    checkpoint: str  # as the client named it ('' : the latest)
    at: float  # time.time() of the request
    seq: int  # next_seq over the request before it: a replica never goes back to an older one


def _desired_seal_key(field: str) -> str:
    return f"{DESIRED_MODEL_KEY}[{field}]"


def seal_desired_model(sealer: Sealer, record: DesiredModel) -> str:
    """``record`` as stored in the desired-model hash's ``DESIRED_RECORD_FIELD``."""
    return sealer.seal(_desired_seal_key(DESIRED_RECORD_FIELD), json.dumps(record, sort_keys=True))


def seal_pinned_model(sealer: Sealer, request: str, resolved: str) -> str:
    """The checkpoint ``request`` resolved to, as stored in ``RESOLVED_FIELD``."""
    payload = json.dumps({"request": request, "resolved": resolved}, sort_keys=True)
    return sealer.seal(_desired_seal_key(RESOLVED_FIELD), payload)


def open_desired_model(sealer: Sealer, fields: Mapping[str, str]) -> DesiredModel | None:
    """The desired model in the hash's ``fields``; None if absent, not genuine or not one
    (an insider's plain ``HSET``: no reload to follow)."""
    raw = fields.get(DESIRED_RECORD_FIELD)
    record = _sequenced(sealer.open_json(_desired_seal_key(DESIRED_RECORD_FIELD), raw), "id")
    if record is None or not (
        isinstance(record.get("checkpoint"), str) and isinstance(record.get("at"), int | float)
    ):
        return None
    return DesiredModel(
        id=record["id"], checkpoint=record["checkpoint"], at=float(record["at"]), seq=record["seq"]
    )


def open_pinned_model(sealer: Sealer, request: str, raw: str | bytes | None) -> str | None:
    """The checkpoint pinned for ``request`` as stored in ``raw``; None if absent, not
    genuine, or pinned for another request."""
    pinned = sealer.open_json(_desired_seal_key(RESOLVED_FIELD), raw)
    if pinned is None:
        return None
    if not (
        isinstance(pinned, dict)
        and pinned.get("request") == request
        and isinstance(pinned.get("resolved"), str)
    ):
        return None
    return str(pinned["resolved"])


def desired_fields(sealer: Sealer, fields: Mapping[str, str]) -> dict[str, str]:
    """What the hash's ``fields`` ask for, as :func:`desired_model_record` (with
    ``RESOLVED_FIELD`` once genuinely pinned); empty when no genuine reload was asked for."""
    desired = open_desired_model(sealer, fields)
    if desired is None:
        return {}
    record = desired_model_record(desired["id"], desired["checkpoint"], desired["at"])
    pinned = open_pinned_model(sealer, desired["id"], fields.get(RESOLVED_FIELD))
    if pinned:
        record[RESOLVED_FIELD] = pinned
    return record


class ReplicaState(TypedDict):
    """One replica's own state, as it publishes it under :func:`replica_key`."""

    service: str
    replica: str
    version: str  # the model version it serves now
    state: str  # CONVERGED, FAILED or LOADING: how the latest desired model went
    request: str  # the desired model's id it last acted on ('' : none)
    checkpoint: str  # the checkpoint it was asked for (relative to its root)
    error: str  # why it refused, if it did
    updated: float  # time.time() of this state


def encode_replica_state(sealer: Sealer, key: str, state: ReplicaState) -> str:
    """``state`` as stored under ``key`` (its :func:`replica_key`; sealed: bound to it)."""
    return sealer.seal(key, json.dumps(state))


_REPLICA_STR_FIELDS = ("service", "replica", "version", "state", "request", "checkpoint", "error")


def decode_replica_state(sealer: Sealer, key: str, raw: str | bytes | None) -> ReplicaState | None:
    """The replica's state stored under ``key`` as ``raw``; None if absent, not sealed with the
    server key for that key, or not a state of the replica the key names. A forged record is
    no replica: never listed, never waited on."""
    state = sealer.open_json(key, raw)
    if state is None:
        return None
    if not (
        isinstance(state, dict)
        and all(isinstance(state.get(name), str) for name in _REPLICA_STR_FIELDS)
        and state["state"] in (CONVERGED, FAILED, LOADING)
        and isinstance(state.get("updated"), int | float)
        and key == replica_key(state["service"], state["replica"])
    ):
        return None
    return ReplicaState(
        service=state["service"],
        replica=state["replica"],
        version=state["version"],
        state=state["state"],
        request=state["request"],
        checkpoint=state["checkpoint"],
        error=state["error"],
        updated=float(state["updated"]),
    )


# --- each index's state: its epoch and version ----------------------------------------------
#
# An index's version grows by one with every acknowledged document write. The gateway looks a
# cached answer up before it retrieves, so it must know the version then: the retriever that
# acknowledged a write publishes it here, and the answer-cache key holds it, so no cached answer
# outlives the knowledge it came from. A sharded index's shards publish each under their own
# label; its version is the sum of theirs (every write lands in one shard and raises it by one).
#
# One sealed record per index name (hash ``INDEX_STATE_KEY``: index -> sealed
# :class:`IndexState`), bound to the index's name: its ``epoch``, a random token made afresh
# whenever the record is made (the index deleted, its directory replaced out of band, or the
# record gone or not genuine), and its shards' versions under that epoch. The answer-cache key
# holds both. A record that is absent or not sealed with the server key is no state at all:
# the gateway neither looks answers up nor stores them for that index until a retriever
# writes a new record, under a new epoch, which no cached answer was ever keyed by. So an
# insider's forged, lowered or deleted version or epoch can only cause misses. Writers raise
# a shard's version only (compare-and-set over ``WATCH``; scripts are not in the ACL).

INDEX_STATE_KEY = "openbook:index-state"


class IndexState(TypedDict):
    epoch: str  # random hex, new with every record made afresh
    versions: dict[str, int]  # shard label ("": unsharded) -> version
    # next_seq over the record it replaced (0: a record from before it was kept): orders the
    # epochs of one index, so a gateway that saw a newer one never believes an older record
    # written back (a deleted index's state replayed after its name was reused).
    gen: int


def index_state_seal_key(index: str) -> str:
    """What an index's record is sealed for: the hash and the field (a record cannot be moved
    to another index)."""
    return f"{INDEX_STATE_KEY}[{index}]"


def new_index_state(previous: IndexState | None = None) -> IndexState:
    """A state made afresh: a new epoch, no versions, a generation after ``previous``'s (the
    genuine state it replaces, if one could be read)."""
    gen = next_seq(previous["gen"] if previous is not None else None)
    return IndexState(epoch=secrets.token_hex(16), versions={}, gen=gen)


def seal_index_state(sealer: Sealer, index: str, state: IndexState) -> str:
    return sealer.seal(index_state_seal_key(index), json.dumps(state, sort_keys=True))


def open_index_state(sealer: Sealer, index: str, raw: str | bytes | None) -> IndexState | None:
    """``index``'s state stored as ``raw``; None if absent, not genuine or not a state."""
    state = sealer.open_json(index_state_seal_key(index), raw)
    if state is None:
        return None
    if not isinstance(state, dict):
        return None
    epoch, versions, gen = state.get("epoch"), state.get("versions"), state.get("gen", 0)
    if not (
        isinstance(epoch, str)
        and epoch
        and type(gen) is int
        and isinstance(versions, dict)
        and all(
            isinstance(shard, str) and type(v) is int and v >= 0 for shard, v in versions.items()
        )
    ):
        return None
    return IndexState(epoch=epoch, versions=versions, gen=gen)


def index_version_of(state: IndexState) -> int:
    """The index's version: the sum over its shards (0 when none published one)."""
    return sum(state["versions"].values())


def raised_index_state(state: IndexState | None, shard: str, version: int) -> IndexState | None:
    """``state`` with ``shard`` at ``version`` (a new epoch if ``state`` is None); None when
    it already holds that version or a later one (nothing to write)."""
    if state is None:
        state = new_index_state()
    elif state["versions"].get(shard, -1) >= version:
        return None
    return IndexState(
        epoch=state["epoch"], versions={**state["versions"], shard: version}, gen=state["gen"]
    )


# --- cached answers -------------------------------------------------------------------------

ANSWER_KEY_PREFIX = "openbook:answer:"


def answer_key(index: str, params: Mapping[str, Any]) -> str:
    """The key of the answer computed on ``index`` with ``params`` (everything else that
    decides it: the question, the decoding options, the model versions)."""
    blob = json.dumps({"index": index, **params}, sort_keys=True, ensure_ascii=False)
    return ANSWER_KEY_PREFIX + hashlib.sha256(blob.encode()).hexdigest()


def seal_answer(sealer: Sealer, key: str, answer: Mapping[str, Any]) -> str:
    """``answer`` as stored under ``key`` (sealed: bound to that key)."""
    return sealer.seal(key, json.dumps(answer))


def open_answer(sealer: Sealer, key: str, raw: str | bytes | None) -> dict[str, Any] | None:
    """The answer stored under ``key`` as ``raw``; None if absent or not genuine."""
    payload = sealer.open(key, raw)
    return json.loads(payload) if payload else None


# --- stored responses -----------------------------------------------------------------------
#
# What ``POST /v1/responses`` keeps of a response so that a later one can name it as its
# ``previous_response_id``: not the response, only the conversation state the next question is
# expanded from (a few turns, each cut short: openbook_gateway.conversation.recent) and the
# owner it belongs to (a hash of the API key that made it; "" when /v1 has no keys). Sealed
# like an answer: an entry written or moved by anyone else reads as absent.

RESPONSE_KEY_PREFIX = "openbook:response:"


class StoredConversation(TypedDict):
    owner: str
    turns: list[dict[str, str]]  # {"role": "user" | "assistant", "content": text}, oldest first


def response_key(response_id: str) -> str:
    return RESPONSE_KEY_PREFIX + response_id


def seal_conversation(sealer: Sealer, key: str, state: StoredConversation) -> str:
    return sealer.seal(key, json.dumps(state, ensure_ascii=False))


def open_conversation(
    sealer: Sealer, key: str, raw: str | bytes | None
) -> StoredConversation | None:
    """The state stored under ``key`` as ``raw``; None if absent, not genuine or not a state."""
    state = sealer.open_json(key, raw)
    if state is None:
        return None
    if not (isinstance(state, dict) and isinstance(state.get("owner"), str)):
        return None
    turns = state.get("turns")
    if not isinstance(turns, list) or not all(
        isinstance(t, dict)
        and t.get("role") in ("user", "assistant")
        and isinstance(t.get("content"), str)
        for t in turns
    ):
        return None
    return StoredConversation(owner=state["owner"], turns=turns)
