"""Faults against what users run: the default stack (Gemma 3 270M, the demo index wiki-2018,
every limit at its default), not the tiny models of the other fault tests.

Needs a ``var/`` that ``openbook demo prepare`` filled (minutes, and a 1 GB model conversion),
so it runs only when ``OPENBOOK_TEST_DEFAULT_VAR`` names one, never in CI:

    OPENBOOK_TEST_DEFAULT_VAR=var .venv/bin/python -m pytest tests/faults/test_default_stack.py

``OPENBOOK_TEST_CPU_HOG=1`` runs it all on a busy machine: one process spinning on one core
(``openbook_testkit.hog``) for the whole module, as a neighbour on a shared node does.

CI keeps the same guarantees on tiny models (tests/services/test_generator_admission.py, the
other fault tests); results of this module are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from faultkit import (
    ask,
    describe_all,
    metrics,
    restarted,
    sample,
    service_pid,
    statuses,
    wait_until,
)

from openbook_generator.settings import GeneratorSettings
from openbook_testkit.hog import CpuHog
from openbook_testkit.stack import LocalStack

pytestmark = pytest.mark.e2e

VAR = os.environ.get("OPENBOOK_TEST_DEFAULT_VAR", "")
HOG = int(os.environ.get("OPENBOOK_TEST_CPU_HOG", "0") or 0)
GENERATOR = "gemma-3-270m"
QUESTIONS = [
    "Who is the President of Peru?",
    "Who is the Prime Minister of Canada?",
    "When did the 1973 oil crisis begin?",
    "Who is the Chancellor of Germany?",
]


@pytest.fixture(scope="module")
def stack():
    if not VAR or not (Path(VAR) / "models" / GENERATOR / "config.json").is_file():
        pytest.skip("set OPENBOOK_TEST_DEFAULT_VAR to a var/ filled by `openbook demo prepare`")
    # what users run: the generator's own precision policy, not the suite's float32 pin
    # (tests/conftest.py); bf16 on a CPU with native bf16 arithmetic
    stack = LocalStack(
        Path(VAR),
        generator=GENERATOR,
        default_index="wiki-2018",
        extra_env={"OPENBOOK_GENERATOR_DTYPE": "auto"},
    )
    stack.start(timeout_s=600)
    with CpuHog(HOG):
        yield stack
    stack.stop()


def _generator_metrics(stack) -> dict:
    return metrics(f"http://127.0.0.1:{stack.ports['gmetrics']}/metrics")


def test_k100_is_answered_or_refused_cleanly_and_the_generator_stays_up(stack):
    pid = service_pid(stack, "generator")
    reply = ask(stack.url, "peru", timeout_s=300, k=100, max_new_tokens=4, use_cache=False)
    assert reply.status in (200, 413, 429), reply.describe()
    after = ask(stack.url, QUESTIONS[0], timeout_s=300, use_cache=False)
    assert after.status == 200, after.describe()
    assert service_pid(stack, "generator") == pid


def test_a_default_question_is_not_held_hostage_by_a_large_request(stack):
    """Chunked prefill, a batch of its own and least attained service: the default question
    asked while a large request runs (k=60, 64 tokens: k=100 with 64 tokens needs more than the
    default memory budget in bf16) is answered before it (its latency against its latency alone
    is measured by bench/load/run.py --real, docs/benchmarks.md)."""
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(ask, stack.url, "peru", 300, k=60, max_new_tokens=64, use_cache=False)
        time.sleep(3)  # the large request is being prefilled or decoded by now
        small = ask(stack.url, QUESTIONS[0], timeout_s=300, use_cache=False)
        assert small.status == 200, small.describe()
        big = large.result()
    assert big.status in (200, 413, 429), big.describe()
    if big.status == 200:
        assert small.ended < big.ended


def test_a_request_too_long_for_its_deadline_is_refused_at_once(stack):
    reply = ask(
        stack.url,
        QUESTIONS[0],
        timeout_s=300,
        k=5,
        num_beams=16,
        max_new_tokens=512,
        min_new_tokens=512,
        decoding="rag-sequence-thorough",
        use_cache=False,
    )
    assert reply.status in (200, 413, 429), reply.describe()
    if reply.status != 200:
        assert "deadline" in reply.detail, reply.describe()
        assert reply.seconds < 30, reply.describe()  # refused up front, not after the deadline


@pytest.mark.parametrize(
    "body",
    [
        '{"question": "x", "k": NaN}',
        '{"question": "x", "k": 1e400}',
        '{"question": "x", "k": "5"}',
        '{"question": "x", "use_cache": "yes"}',
        '{"question": "\\u0000"}',
        '{"question": "x", "length_penalty": Infinity}',
    ],
)
def test_hostile_bodies_get_422(stack, body):
    import httpx

    reply = httpx.post(
        f"{stack.url}/answer",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 422, reply.text
    json.loads(reply.text)  # valid JSON, whatever was echoed


def test_oversize_body_gets_a_readable_413(stack):
    body = b'{"question": "' + b"x" * (5 * 2**20) + b'"}'
    with socket.create_connection(("127.0.0.1", stack.ports["gateway"]), timeout=30) as sock:
        head = (
            f"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        status_line = sock.makefile("rb").readline().decode()
    assert " 413 " in status_line, status_line


def test_a_flood_gets_answers_and_429s_never_5xx(stack):
    """More concurrent requests than the generator's queue and batch hold: the excess is
    refused at once (429 with Retry-After), everything else answered, nothing times out."""
    settings = GeneratorSettings()
    burst = settings.max_queue + settings.max_batch_size + 16
    with ThreadPoolExecutor(burst) as pool:
        futures = [
            pool.submit(ask, stack.url, QUESTIONS[i % len(QUESTIONS)], 300, use_cache=False)
            for i in range(burst)
        ]
        replies = [f.result() for f in futures]
    counts = statuses(replies)
    assert set(counts) <= {200, 429}, f"{counts}\n{describe_all(replies)}"
    refused = [r for r in replies if r.status == 429]
    assert len(refused) >= burst - settings.max_queue - settings.max_batch_size, counts
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert counts.get(200, 0) >= settings.max_batch_size


def test_a_client_that_leaves_has_its_generation_stopped(stack):
    before = sample(_generator_metrics(stack), "openbook_dropped_total", where="running")
    # A request that takes a while (the prefill of 50 passages: stop strings end the answer
    # itself early, whatever min_new_tokens says; 2.4 s in bf16 on a 2-core AVX512-BF16 machine,
    # longer in float32); the client gives up after one second.
    gone = ask(stack.url, QUESTIONS[1], timeout_s=1, use_cache=False, k=50, max_new_tokens=8)
    assert gone.status == 0, gone.describe()  # the client timed out and closed its connection
    wait_until(
        lambda: (
            sample(_generator_metrics(stack), "openbook_dropped_total", where="running") > before
        ),
        120,
        "the generator to stop the abandoned request between decoding steps",
    )
    after = ask(stack.url, QUESTIONS[2], timeout_s=300, use_cache=False)
    assert after.status == 200, after.describe()


def test_a_killed_generator_comes_back_and_answers(stack):
    pid = service_pid(stack, "generator")
    os.kill(pid, signal.SIGKILL)
    wait_until(restarted(stack, "generator", pid), 120, "a new generator process")
    reply = wait_until(
        lambda: (
            (r := ask(stack.url, QUESTIONS[3], timeout_s=300, use_cache=False)).status == 200 and r
        ),
        600,
        "the restarted generator to answer",
        interval_s=2,
    )
    assert reply.body["answer"] is not None
