"""A generator that cannot keep up: 504 past the deadline, 429 when its queue is full.

The stack's generator batches one request at a time with room for two waiting
(``OPENBOOK_GENERATOR_MAX_BATCH_SIZE=1``, ``OPENBOOK_GENERATOR_MAX_QUEUE=2``). "Slow" is made
deterministic by freezing the generator process (SIGSTOP): it accepts connections but answers
nothing.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from faultkit import (
    FACT_QUESTIONS,
    ask,
    describe_all,
    metrics,
    sample,
    service_pid,
    statuses,
    wait_until,
)

pytestmark = pytest.mark.e2e

GENERATE_TIMEOUT_S = 15.0
RETRIEVE_TIMEOUT_S = 10.0
MAX_QUEUE = 2
FAIL_BOUND_S = 3 * (GENERATE_TIMEOUT_S + RETRIEVE_TIMEOUT_S)


@pytest.fixture(scope="module")
def stack(start_stack):
    return start_stack(
        OPENBOOK_GATEWAY_GENERATE_TIMEOUT_S=str(GENERATE_TIMEOUT_S),
        OPENBOOK_GATEWAY_RETRIEVE_TIMEOUT_S=str(RETRIEVE_TIMEOUT_S),
        OPENBOOK_GENERATOR_MAX_BATCH_SIZE="1",
        OPENBOOK_GENERATOR_MAX_QUEUE=str(MAX_QUEUE),
    )


def _generator_metrics(stack) -> dict:
    return metrics(f"http://127.0.0.1:{stack.ports['gmetrics']}/metrics")


def _ask_all(stack, n: int, **params):
    """``n`` concurrent uncached questions; returns the pool's futures."""
    pool = ThreadPoolExecutor(n)
    futures = [
        pool.submit(
            ask, stack.url, FACT_QUESTIONS[i % len(FACT_QUESTIONS)], use_cache=False, k=1 + i % 5
        )
        for i in range(n)
    ]
    pool.shutdown(wait=False)
    return futures


def test_requests_past_their_deadline_get_504_and_are_never_generated(stack):
    pid = service_pid(stack, "generator")
    before = _generator_metrics(stack)
    os.kill(pid, signal.SIGSTOP)
    try:
        replies = [f.result(timeout=FAIL_BOUND_S + 30) for f in _ask_all(stack, 6)]
    finally:
        os.kill(pid, signal.SIGCONT)

    wrong = [r for r in replies if r.status != 504 or "generator" not in r.detail]
    assert not wrong, describe_all(wrong)
    assert all("deadline" in r.detail for r in replies)
    slow = [r for r in replies if r.seconds > FAIL_BOUND_S]
    assert not slow, describe_all(slow)

    # Thawed, the generator finds those six calls expired: it drops them from its queue
    # instead of spending the next minutes generating answers nobody waits for. None of them
    # started decoding (none was dropped while running), and one answer was generated: the next.
    probe = ask(stack.url, "Who wrote Hamlet?", use_cache=False)
    assert probe.status == 200, probe.describe()
    after = _generator_metrics(stack)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert grew("openbook_dropped_total", service="generator", where="running") == 0
    assert grew("openbook_rpc_total", service="generator", method="Generate", code="OK") == 1
    assert sample(after, "openbook_queue_depth", service="generator") == 0


def test_full_generator_queue_answers_429_with_retry_after_at_once(stack):
    pid = service_pid(stack, "generator")
    gateway_url = f"{stack.url}/metrics"

    def generate_calls_sent() -> float:
        return sample(
            metrics(gateway_url), "openbook_gateway_stage_seconds_count", stage="retrieve"
        )

    sent = generate_calls_sent()
    burst = 24
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = _ask_all(stack, burst)
        # Every request has been retrieved and handed to the (frozen) generator ...
        wait_until(lambda: generate_calls_sent() >= sent + burst, 60, "the burst to reach it")
    finally:
        os.kill(pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    # ... which now sees 24 calls at once: one runs, two wait, the rest are refused.
    replies = [f.result(timeout=FAIL_BOUND_S + 30) for f in futures]

    counts = statuses(replies)
    assert set(counts) <= {200, 429}, f"{counts}\n{describe_all(replies)}"
    refused = [r for r in replies if r.status == 429]
    assert refused, f"no request refused: {counts}"
    assert counts.get(200, 0) >= 1
    assert all(r.headers.get("retry-after") for r in refused)
    assert all("queue full" in r.detail for r in refused), describe_all(refused)
    # Refused at once, not after waiting out the deadline.
    late = [r for r in refused if r.ended - thawed_at > GENERATE_TIMEOUT_S]
    assert not late, describe_all(late)
    depth = sample(_generator_metrics(stack), "openbook_queue_depth", service="generator")
    assert 0 <= depth <= MAX_QUEUE
