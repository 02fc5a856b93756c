"""Honest under pressure through the stack users run: a generator that gets a fraction of a CPU.

The generator process is throttled the way a CPU quota (a Kubernetes limit, a cgroup's
``cpu.max``) throttles it: once its threads have used a tenth of a CPU's time in a period, it is
stopped for the rest of that period (SIGSTOP/SIGCONT, ``faultkit.Throttled``). It measures how
fast it works now and admits only what it can finish before the deadline; so under 1, 4, 16 and
32 clients every request is answered or refused at once with a Retry-After (429), never left to
time out (504), never a 5xx.

"Now" is what the engine has measured: it learns a slowdown from the work it sees at the new
speed (:mod:`openbook_generator.speed`). A request admitted before any such work was seen was
planned at the old speed and may run late (no admission can know that a CPU will be taken away
mid-request; on a slow machine a tenth of a CPU cannot finish it in time). So one request is
asked first under the throttle, and its reply is not judged; every request after it is. The
test runs by itself (``alone``, after the parallel run of ``make test``): a second worker's
stack on the same two cores would take most of the tenth of a CPU it measures.

The busy-machine benchmark of the default stack is ``bench/load/run.py --real --hog 1``
(docs/benchmarks.md).
"""

from __future__ import annotations

import httpx
import pytest
from faultkit import FACT_QUESTIONS, Load, Throttled, describe_all, post, service_pid, statuses

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

GENERATE_TIMEOUT_S = 4.0
LEVELS = (1, 4, 16, 32)
SECONDS_PER_LEVEL = 5.0


@pytest.fixture(scope="module")
def stack(start_stack):
    return start_stack(
        OPENBOOK_GATEWAY_GENERATE_TIMEOUT_S=str(GENERATE_TIMEOUT_S),
        OPENBOOK_GENERATOR_MAX_BATCH_SIZE="2",
    )


def _body(client: int, n: int) -> dict:
    return {
        "question": FACT_QUESTIONS[(client + n) % len(FACT_QUESTIONS)],
        "k": 5,
        "max_new_tokens": 24,
        "min_new_tokens": 24,
        "use_cache": False,
    }


def test_a_throttled_generator_answers_or_refuses_at_once_never_times_out(stack):
    pid = service_pid(stack, "generator")
    outcome: dict[int, dict[int, int]] = {}
    with Throttled(pid, run_s=0.01, period_s=0.1):  # a tenth of a CPU
        with httpx.Client(timeout=30) as http:  # the engine sees work at its new speed
            first = post(http, f"{stack.url}/answer", _body(0, 0))
        assert first.status in (200, 413, 429, 504), first.describe()
        for clients in LEVELS:
            with Load(stack.url, clients, _body, timeout_s=30, retry_after=True) as load:
                load.wait(SECONDS_PER_LEVEL)
            replies = load.snapshot()
            counts = statuses(replies)
            outcome[clients] = counts
            assert set(counts) <= {200, 429}, f"{clients} clients: {counts}\n" + describe_all(
                [r for r in replies if r.status not in (200, 429)]
            )
            assert counts.get(200, 0) >= 1, f"{clients} clients: nothing answered: {counts}"
            refused = [r for r in replies if r.status == 429]
            assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
            # refused at admission, before any of the deadline was spent waiting
            assert all(r.seconds < GENERATE_TIMEOUT_S for r in refused), describe_all(refused)
    # the load was more than a tenth of a CPU can take in time: some requests were refused
    assert sum(c.get(429, 0) for c in outcome.values()) > 0, outcome
    assert service_pid(stack, "generator") == pid
