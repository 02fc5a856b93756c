"""Bearer tokens, checked one way everywhere: the gateway's ``/admin`` (the admin token) and
``/v1`` (API keys), and the retriever's and generator's admin RPCs (the admin token the gateway
forwards).

A credential is ``Bearer <token>``: the scheme in any letter case (RFC 9110 §11.1: schemes are
case-insensitive), one space, then the token exactly as configured. Nothing is trimmed or
tolerated around it, so a token that one boundary accepts every other accepts, and a padded or
truncated one passes none (HTTP parsers drop whitespace around a header value; gRPC metadata
keeps it: trimming in one place and not the other made them disagree).

Tokens are compared in constant time: the SHA-256 digests of the presented and the expected
token, with ``hmac.compare_digest``, so the time taken tells neither how much of a token was
right nor how long the expected one is; with several tokens (API keys) every one is compared.
An empty expected token matches nothing.

Torch-free and framework-free: the gateway imports it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

SCHEME = "bearer"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>``, exactly as sent; None when
    the value is missing or not a bearer credential (another scheme, no token)."""
    scheme, space, token = (authorization or "").partition(" ")
    if scheme.lower() != SCHEME or not space or not token:
        return None
    return token


def token_matches(presented: str | None, expected: Iterable[str]) -> bool:
    """Whether ``presented`` equals one of the non-empty ``expected`` tokens (constant time)."""
    digest = _digest(presented or "")
    matched = False
    for token in expected:
        # every token compared, no early exit: the time does not tell which one matched
        same = hmac.compare_digest(digest, _digest(token))
        matched |= same and bool(token) and presented is not None
    return matched


def bearer_matches(authorization: str | None, expected: Iterable[str]) -> bool:
    """Whether ``authorization`` is ``Bearer <one of the expected tokens>``."""
    return token_matches(bearer_token(authorization), expected)


def _digest(token: str) -> bytes:
    # surrogateescape: a header value decoded as latin-1 or metadata with odd bytes still
    # hashes (and simply does not match)
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
