"""What ``POST /v1/responses`` keeps of a response, so that a later request can continue its
conversation with ``previous_response_id``.

Invariants:

* Only the conversation state is kept, never the response: the turns the next question may be
  expanded from (:func:`openbook_gateway.conversation.recent`: a few turns, each cut short), so
  an entry is small however long the conversation grew. It lives in Redis
  (``openbook.state.redis_protocol.response_key``) for ``OPENBOOK_GATEWAY_RESPONSE_TTL_S`` seconds,
  sealed with the server key: an entry written, altered or moved by anyone else reads as absent.
* A response id is random (:func:`new_response_id`, 128 bits), never the client's request id,
  so no client can pick the id another's conversation is stored under.
* An entry belongs to the key that made it (a hash of it; made without a known key, to
  everyone): another key's request naming it is told it does not exist, as for an unknown,
  expired or forged id (a 400 naming ``previous_response_id``).
* ``store: false`` keeps nothing. Redis down: nothing is kept (the reply says ``store``
  false), and a request naming a previous response is a 503: its conversation cannot be read.
"""

from __future__ import annotations

import logging
import re
import uuid

from redis.exceptions import RedisError

from openbook.state.redis_protocol import StoredConversation
from openbook.state.shared_state_aio import read_conversation, write_conversation
from openbook_gateway.conversation import Turn, recent
from openbook_gateway.openai_schemas import OpenAIRequestError
from openbook_gateway.principal import Principal
from openbook_gateway.services import Services

log = logging.getLogger(__name__)

RESPONSE_PREFIX = "resp_"
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


def new_response_id() -> str:
    return f"{RESPONSE_PREFIX}{uuid.uuid4().hex}"


def owner_of(principal: Principal) -> str:
    """Whom a stored response belongs to: a hash of the key that made it (as the door found it,
    ``openbook_gateway.access``), or "" for a request no key was known for."""
    return principal.owner


async def load_turns(services: Services, response_id: str, owner: str) -> list[Turn]:
    """The conversation stored for ``response_id`` (module docstring), or the error to answer."""
    state: StoredConversation | None = None
    if _RESPONSE_ID.fullmatch(response_id):
        try:
            cache = services.cache
            state = await read_conversation(cache.client, cache.sealer, response_id)
        except (RedisError, OSError) as exc:
            log.warning("stored responses unavailable, redis unreachable: %s", exc)
            raise OpenAIRequestError(
                "previous_response_id: stored responses cannot be read now (Redis is "
                "unreachable); send the earlier turns in input instead",
                "previous_response_id",
                "store_unavailable",
                status=503,
            ) from None
    if state is None or state["owner"] != owner:
        raise OpenAIRequestError(
            f"previous_response_id: no stored response {response_id!r} (responses are kept "
            f"{services.settings.response_ttl_s} s, and only with store not false)",
            "previous_response_id",
            "previous_response_not_found",
        )
    # open_conversation let only these two roles through
    return [
        Turn("user" if t["role"] == "user" else "assistant", t["content"]) for t in state["turns"]
    ]


async def save_turns(services: Services, response_id: str, owner: str, turns: list[Turn]) -> bool:
    """Keep the recent of ``turns`` under ``response_id``; whether it was kept."""
    kept = recent(turns)
    state = StoredConversation(
        owner=owner, turns=[{"role": t.role, "content": t.text} for t in kept]
    )
    try:
        await write_conversation(
            services.cache.client,
            services.cache.sealer,
            response_id,
            state,
            services.settings.response_ttl_s,
        )
    except (RedisError, OSError) as exc:
        log.warning("response %s not stored, redis unreachable: %s", response_id, exc)
        return False
    return True
