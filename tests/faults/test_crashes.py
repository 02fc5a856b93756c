"""Services killed or Redis hung/killed under load: clear 503s, then recovery by itself.

One stack (``openbook up``) for the module; the supervisor restarts what is killed (compose
``restart: unless-stopped``), and the gateway is never restarted.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from faultkit import (
    FACT_QUESTIONS,
    Load,
    ask,
    describe_all,
    restarted,
    service_pid,
    statuses,
    wait_until,
)

pytestmark = pytest.mark.e2e

RETRIEVE_TIMEOUT_S = 5.0
GENERATE_TIMEOUT_S = 20.0
# "Fails within the deadline rather than hanging", with room for a busy two-core machine.
FAIL_BOUND_S = 3 * (RETRIEVE_TIMEOUT_S + GENERATE_TIMEOUT_S)
RESTART_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def stack(start_stack):
    return start_stack(
        OPENBOOK_GATEWAY_RETRIEVE_TIMEOUT_S=str(RETRIEVE_TIMEOUT_S),
        OPENBOOK_GATEWAY_GENERATE_TIMEOUT_S=str(GENERATE_TIMEOUT_S),
    )


def uncached(client: int, n: int) -> dict:
    return {"question": FACT_QUESTIONS[(client + n) % len(FACT_QUESTIONS)], "use_cache": False}


def _kill_under_load(stack, service: str) -> tuple[list, float]:
    """SIGKILL ``service`` while 4 clients ask; return every reply and when it was killed,
    once a request started after the restart has been answered."""
    old_pid = service_pid(stack, service)
    with Load(stack.url, 4, uncached) as load:
        wait_until(lambda: load.count(lambda r: r.status == 200) >= 8, 120, "answers before kill")
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(
            lambda: load.count(lambda r: r.started > killed_at and r.status != 200),
            60,
            f"a request failing while {service} is down",
        )
        wait_until(restarted(stack, service, old_pid), RESTART_TIMEOUT_S, f"{service} restart")
        back_at = time.monotonic()
        wait_until(
            lambda: load.count(lambda r: r.started > back_at and r.status == 200),
            RESTART_TIMEOUT_S,
            f"answers again after {service} restarted",
        )
    return load.snapshot(), killed_at


def _check_failures(replies, service: str) -> None:
    failed = [r for r in replies if r.status != 200]
    assert failed, "killing the service failed no request"
    wrong = [
        r
        for r in failed
        if r.status != 503 or service not in r.detail or r.headers.get("retry-after") is None
    ]
    assert not wrong, f"{statuses(replies)}\n{describe_all(wrong)}"
    slow = [r for r in failed if r.seconds > FAIL_BOUND_S]
    assert not slow, describe_all(slow)


def test_killed_retriever_fails_requests_with_503_then_recovers(stack):
    gateway_pid = service_pid(stack, "gateway")
    # The active index lives in Redis: the restarted retriever must come back serving it.
    swapped = httpx.post(
        f"{stack.url}/admin/swap-index", json={"index": "facts-b"}, headers=stack.auth, timeout=60
    )
    assert swapped.status_code == 200, swapped.text

    replies, killed_at = _kill_under_load(stack, "retriever")

    _check_failures(replies, "retriever")
    assert all(r.body["index"] == "facts-b" for r in replies if r.status == 200)
    assert service_pid(stack, "gateway") == gateway_pid
    assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 200
    httpx.post(
        f"{stack.url}/admin/swap-index", json={"index": "facts-a"}, headers=stack.auth, timeout=60
    )


def test_killed_generator_fails_requests_with_503_then_recovers(stack):
    gateway_pid = service_pid(stack, "gateway")
    replies, _ = _kill_under_load(stack, "generator")
    _check_failures(replies, "generator")
    assert service_pid(stack, "gateway") == gateway_pid
    assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 200


def test_answers_keep_coming_while_redis_is_down_and_caching_resumes(stack):
    question = "What is the largest animal that ever lived?"
    assert ask(stack.url, question).status == 200
    assert ask(stack.url, question).body["cached"] is True

    def repeated(client: int, n: int) -> dict:
        return {"question": FACT_QUESTIONS[(client + n) % 3]}  # cached while Redis is up

    redis_pid = service_pid(stack, "redis")
    with Load(stack.url, 4, repeated) as load:
        wait_until(lambda: load.count(lambda r: r.body.get("cached")), 60, "cached answers")
        # A hung Redis (the worst case: every call runs into its timeout) ...
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            hung_at = time.monotonic()
            wait_until(
                lambda: load.count(lambda r: r.started > hung_at and r.status == 200) >= 8,
                120,
                "answers while Redis hangs",
            )
            direct = ask(stack.url, question)
        finally:
            # ... then a crashed one: SIGKILL ends even a stopped process; the supervisor
            # starts a fresh, empty Redis.
            os.kill(redis_pid, signal.SIGKILL)
            killed_at = time.monotonic()
        wait_until(restarted(stack, "redis", redis_pid), RESTART_TIMEOUT_S, "redis restart")
        wait_until(
            lambda: httpx.get(f"{stack.url}/readyz", timeout=10).json()["redis"],
            60,
            "the gateway to reach the new Redis",
        )
        back_at = time.monotonic()
        wait_until(
            lambda: load.count(lambda r: r.started > back_at and r.body.get("cached")),
            60,
            "cached answers from the new Redis",
        )
    replies = load.snapshot()

    failed = [r for r in replies if r.status != 200]
    assert not failed, describe_all(failed)
    assert direct.status == 200 and direct.body["cached"] is False
    during = [r for r in replies if r.started > hung_at and r.ended < killed_at]
    assert during and not any(r.body["cached"] for r in during)
    # The restarted Redis holds nothing: the retriever wrote the active index back.
    assert ask(stack.url, question).body["index"] == "facts-a"
