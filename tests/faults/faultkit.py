"""Helpers of the fault tests: concurrent load, polling with a deadline, metrics, stacks.

Everything talks to real processes on 127.0.0.1 (a ``LocalStack`` started by ``openbook up``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from openbook_testkit.index import QUESTIONS

T = TypeVar("T")

# Questions whose best passage is known in facts-a ("pNN") and facts-b ("b-pNN").
FACT_QUESTIONS: list[str] = list(QUESTIONS.values())
# No load loop runs longer than this, whatever happens to the test driving it.
HARD_CAP_S = 240.0


def wait_until(
    probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.2
) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (httpx.HTTPError, OSError, LookupError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}") from (
                last_error
            )
        time.sleep(interval_s)


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus samples at ``url``: ``(name, frozenset(labels.items())) -> value``."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, metric: str, /, **labels: str) -> float:
    """Sum of the samples called ``metric`` whose labels include ``labels`` (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == metric and wanted <= ls)


@dataclass
class Reply:
    question: str
    started: float  # time.monotonic()
    ended: float
    status: int  # 0: no HTTP answer at all (connection error, client timeout)
    body: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def detail(self) -> str:
        return str(self.body.get("detail", self.error))

    def describe(self) -> str:
        return f"{self.status} after {self.seconds:.1f}s for {self.question!r}: {self.detail}"


class Load:
    """``clients`` threads posting ``/answer`` back to back until ``stop()`` (or a hard cap).

    ``make_body(client, n)`` returns the JSON body of a client's n-th request. Every reply is
    recorded, so a test judges all of them afterwards.
    """

    def __init__(
        self,
        url: str,
        clients: int,
        make_body: Callable[[int, int], dict],
        timeout_s: float = 60.0,
        retry_after: bool = False,
    ) -> None:
        """``retry_after``: a client refused with 429 waits as its Retry-After says (a
        well-behaved client) before its next request."""
        self.url = url
        self.make_body = make_body
        self.timeout_s = timeout_s
        self.retry_after = retry_after
        self.replies: list[Reply] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)

    def wait(self, seconds: float) -> None:
        """Let the load run for ``seconds`` (then leave the ``with`` block to stop it)."""
        self._stop.wait(seconds)

    def count(self, predicate: Callable[[Reply], bool] = lambda r: True) -> int:
        with self._lock:
            return sum(1 for r in self.replies if predicate(r))

    def snapshot(self) -> list[Reply]:
        with self._lock:
            return list(self.replies)

    def _client(self, client: int) -> None:
        cap = time.monotonic() + HARD_CAP_S
        with httpx.Client(timeout=self.timeout_s) as http:
            n = 0
            while not self._stop.is_set() and time.monotonic() < cap:
                body = self.make_body(client, n)
                n += 1
                reply = post(http, f"{self.url}/answer", body)
                with self._lock:
                    self.replies.append(reply)
                if self.retry_after and reply.status == 429:
                    wait = reply.headers.get("retry-after", "1")
                    self._stop.wait(float(wait) if wait.isdigit() else 1.0)


class Throttled:
    """A process held to ``run_s`` of CPU time in every ``period_s`` the way a CPU quota holds it
    (a cgroup's ``cpu.max``: quota per period, what a Kubernetes CPU limit sets): its threads run
    freely until together they have used the quota of the current period, then the process is
    stopped (SIGSTOP) until the period ends (SIGCONT).

    As under a real quota, an idle process is never stopped: what throttles is work. (Stopping
    it for a fixed share of every period whatever it does, as this helper once did, also stalls
    its gRPC transport while it waits for requests; a reply the server finished in 0.8 s then
    reached its caller after 4 s, which no admission inside the process can see or plan for.)
    CPU time is each thread's ``/proc/PID/task/TID/schedstat`` (nanoseconds), read every
    ``poll_s``: a period may overrun its quota by about that much, as the kernel's own
    accounting overruns it by a slice."""

    def __init__(self, pid: int, run_s: float, period_s: float, poll_s: float = 0.002) -> None:
        self.pid, self.run_s, self.period_s, self.poll_s = pid, run_s, period_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def __enter__(self) -> Throttled:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_s(self) -> float:
        """CPU seconds the process's live threads have used (a thread that exits takes its
        own with it: each period counts from its own start, never below it)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                path = f"/proc/{self.pid}/task/{tid}/schedstat"
                with (
                    contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError),
                    open(path) as f,
                ):
                    total += int(f.read().split()[0])
        return total / 1e9

    def _cycle(self) -> None:
        try:
            while not self._stop.is_set():
                period_end = time.monotonic() + self.period_s
                used = self.cpu_s()
                while time.monotonic() < period_end and not self._stop.is_set():
                    now = self.cpu_s()
                    used = min(used, now)  # a thread exited with its time
                    if now - used >= self.run_s:  # the quota is spent: stopped till the end
                        os.kill(self.pid, signal.SIGSTOP)
                        self._stop.wait(max(0.0, period_end - time.monotonic()))
                        os.kill(self.pid, signal.SIGCONT)
                        break
                    self._stop.wait(self.poll_s)
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


def post(http: httpx.Client, url: str, body: dict, **kwargs) -> Reply:
    started = time.monotonic()
    try:
        response = http.post(url, json=body, **kwargs)
    except httpx.HTTPError as exc:
        return Reply(body.get("question", ""), started, time.monotonic(), 0, error=repr(exc))
    try:
        payload = response.json()
    except ValueError:
        payload = {"detail": response.text[:500]}
    return Reply(
        body.get("question", ""),
        started,
        time.monotonic(),
        response.status_code,
        payload if isinstance(payload, dict) else {"detail": payload},
        dict(response.headers),
    )


def ask(url: str, question: str, timeout_s: float = 60.0, **params) -> Reply:
    with httpx.Client(timeout=timeout_s) as http:
        return post(http, f"{url}/answer", {"question": question, **params})


def passages_match_label(body: dict) -> bool:
    """True when every passage comes from the index the answer is labelled with."""
    from_b = {p["id"].startswith("b-") for p in body["passages"]}
    return from_b == {body["index"] == "facts-b"}


def describe_all(replies: Iterable[Reply], limit: int = 10) -> str:
    lines = [r.describe() for r in replies]
    more = f"\n... and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


def service_pid(stack, service: str) -> int:
    """PID of the live ``service`` process of ``stack``."""
    return stack.service_pid(service)


def restarted(stack, service: str, old_pid: int) -> Callable[[], int | None]:
    """A probe: the pid of ``service`` once the supervisor has started a new one."""

    def probe() -> int | None:
        try:
            pid = service_pid(stack, service)
        except LookupError:
            return None
        return pid if pid != old_pid else None

    return probe


def statuses(replies: Sequence[Reply]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in replies:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts
