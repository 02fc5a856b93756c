"""The Redis protocol every process of a deployment speaks: key names and codecs, once.

What replicas agree on through Redis, and who writes / reads it:

- the active index (``ACTIVE_INDEX_KEY``, sealed; announced on ``INDEX_SWAP_CHANNEL``):
  written by the retriever that swapped, read by every retriever and the gateway's cache;
- the model versions served (hash ``MODEL_VERSIONS_KEY``: service -> version): written by the
  retriever and the generator, read by the gateway (part of the answer-cache key);
- the desired model (hash ``DESIRED_MODEL_KEY``: ``id``, ``checkpoint``, ``at`` and, once a
  replica pinned it, ``resolved``; announced on ``MODEL_RELOAD_CHANNEL``): written by the
  gateway's ``POST /admin/reload-model``, followed by every retriever and generator replica;
- each replica's state (JSON under ``replica_key(service, replica)``, with a TTL): written by
  the replica, listed by the gateway;
- each index's version (sorted set ``INDEX_VERSIONS_KEY``: member ``index_version_member(index,
  shard)``, score the version; only ever raised): written by the retriever that acknowledged a
  document write (:func:`openbook.shared_state.publish_index_version`), read by the gateway
  (part of the answer-cache key);
- each index name's epoch (hash ``INDEX_EPOCHS_KEY``: index -> count of its deletions): raised
  by the gateway that deleted an index, or by a retriever that found an index's directory
  removed or replaced out of band (:func:`openbook.shared_state.index_vanished`), read by
  every gateway (part of the answer-cache key, so
  a new index of a deleted one's name never serves the old one's answers);
- cached answers (sealed, under ``answer_key(index, params)``, with a TTL): the gateway's;
- stored responses (sealed, under ``response_key(response_id)``, with a TTL): the conversation
  state a ``/v1/responses`` call's ``previous_response_id`` continues, the gateway's.

Invariants: this module does no I/O and imports no Redis client; the sync half
(:mod:`openbook.shared_state`, the services) and the async half
(:mod:`openbook.shared_state_aio`, the gateway) execute these over their clients, so changing
a key or an encoding is a change here only. Values whose trust matters (the active index, the
answers, the stored responses) are sealed (:mod:`openbook.sealing`) bound to their key:
opening anything not sealed with the server key gives ``None``, read as absent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypedDict

from openbook.sealing import Sealer

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

# Hash: service name ("retriever", "generator") -> model version it serves. Part of the
# answer-cache key, so a reloaded model never serves answers computed by the old one.
MODEL_VERSIONS_KEY = "openbook:model-versions"


# --- model reloads that reach every replica -------------------------------------------------
#
# ``POST /admin/reload-model`` records the *desired* checkpoint (a hash: a fresh request
# ``id``, the ``checkpoint`` as the client named it, ``at``) and announces it; every retriever
# and generator replica loads it with its own verified-load path and switches atomically, or
# records why it could not. Each replica publishes its own state under
# ``replica_key(service, replica)`` with a TTL, so a replica that is gone drops out of the
# listing by itself.

DESIRED_MODEL_KEY = "openbook:desired-model"
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
    """The desired-model hash of reload ``request`` (its id) asking for ``checkpoint``."""
    return {REQUEST_FIELD: request, CHECKPOINT_FIELD: checkpoint, AT_FIELD: str(at)}


def desired_checkpoint(desired: Mapping[str, str]) -> str:
    """What a replica loads for ``desired``: the checkpoint pinned by the first replica, else
    the one the client named ('' : the latest)."""
    return desired.get(RESOLVED_FIELD) or desired.get(CHECKPOINT_FIELD, "")


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


def encode_replica_state(state: ReplicaState) -> str:
    return json.dumps(state)


def decode_replica_state(raw: str | bytes | None) -> dict[str, Any] | None:
    """A replica's state as stored; None if absent or not a JSON object. Not sealed: a
    listing to show and wait on, never a source of what to load."""
    if raw is None:
        return None
    try:
        state = json.loads(raw)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


# --- each index's version -------------------------------------------------------------------
#
# An index's version grows by one with every acknowledged document write. The gateway looks a
# cached answer up before it retrieves, so it must know the version then: the retriever that
# acknowledged a write publishes it here, and the answer-cache key holds it, so no cached answer
# outlives the knowledge it came from. A sorted set, so a publish is one ``ZADD GT`` (only ever
# raising a version: two writers publishing out of order cannot move it back; scripts are not
# in the ACL). A sharded index's shards publish each under their own member; its version is
# the sum of theirs (every write lands in one shard and raises it by one).

INDEX_VERSIONS_KEY = "openbook:index-versions"
# Separates an index's name from its shard's label in a member (neither can hold it).
SHARD_SEPARATOR = "|"


def index_version_member(index: str, shard: str = "") -> str:
    """The member of :data:`INDEX_VERSIONS_KEY` that holds ``index``'s version on ``shard``
    (``""``: an unsharded index)."""
    return f"{index}{SHARD_SEPARATOR}{shard}" if shard else index


# Hash: index name -> how many times an index of that name was deleted. A new index of a deleted
# one's name counts its versions from 0 again, so (name, version) alone would meet the old
# index's cached answers: the epoch tells the two apart.
INDEX_EPOCHS_KEY = "openbook:index-epochs"


def index_version_members(index: str, members: list[str]) -> list[str]:
    """Those of ``members`` (of :data:`INDEX_VERSIONS_KEY`) that hold ``index``'s versions."""
    prefix = index + SHARD_SEPARATOR
    return [member for member in members if member == index or member.startswith(prefix)]


def index_version_of(index: str, entries: Mapping[str, float]) -> int:
    """``index``'s version from :data:`INDEX_VERSIONS_KEY`'s ``entries`` (member -> score):
    the sum over its shards (0 when none published one)."""
    return int(sum(entries[member] for member in index_version_members(index, list(entries))))


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
    payload = sealer.open(key, raw)
    if not payload:
        return None
    try:
        state = json.loads(payload)
    except ValueError:
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
