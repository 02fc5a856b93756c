"""openbook.security.auth: the one bearer-token check of the gateway and the services."""

from __future__ import annotations

import hmac

import pytest

from openbook.security import auth
from openbook.security.auth import bearer_matches, bearer_token, token_matches


@pytest.mark.parametrize(
    ("authorization", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER abc", "abc"),
        ("Bearer abc ", "abc "),  # kept: the comparison then refuses it
        ("Bearer  abc", " abc"),
        ("Bearer ", None),
        ("Bearer", None),
        ("Basic abc", None),
        ("abc", None),
        (" Bearer abc", None),
        ("", None),
        (None, None),
    ],
)
def test_the_token_is_taken_exactly_as_sent(authorization, token):
    assert bearer_token(authorization) == token


def test_only_an_exact_non_empty_token_matches():
    assert bearer_matches("Bearer secret", ["secret"])
    assert bearer_matches("bearer secret", ["other", "secret"])
    for presented in ("Bearer secret ", "Bearer  secret", "Bearer Secret", "Bearer secre"):
        assert not bearer_matches(presented, ["secret"]), presented
    assert not bearer_matches("Bearer ", [""])
    assert not token_matches("", [""])
    assert not token_matches(None, ["secret"])
    assert not bearer_matches(None, [])


def test_every_expected_token_is_compared_on_equal_lengths(monkeypatch):
    compared: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    # The first key matches: the others are compared all the same.
    assert token_matches("k1", ["k1", "a-much-longer-key-2", "k3"])
    assert compared == [(32, 32)] * 3  # sha256 digests: nothing about the lengths leaks
