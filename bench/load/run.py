"""Load benchmark of the whole system: the stack ``openbook up`` starts.

N concurrent clients (default 1, 4, 16) post uncached questions to the gateway for a fixed
time each; then one client asks a question whose answer is cached. Reports requests/s,
p50/p95/p99 latency, errors and the mean batch sizes the retriever and generator formed, and
two ratios measured in the same run: throughput at the most clients over one client (target
>= 3x, from batching) and the p50 latency of a cached answer (target <= 5 ms).

    .venv/bin/python -m bench.load                     # 10 s per level, tiny BART
    .venv/bin/python -m bench.load --seconds 30 --json load.json
    .venv/bin/python bench/load/run.py --clients 1 8 32

Models: the generator is a tiny random BART (``openbook_testkit.rag.make_tiny_bart``), the
retriever MiniLM over two 30-passage indexes (``openbook_testkit.stack.build_fact_indexes``): the
benchmark measures the serving system (HTTP, gRPC, batching, cache), not model quality.

``--real`` runs what users run instead: the default stack (Gemma 3 270M, the demo index
wiki-2018, every other setting at its default) from a ``var/`` that ``openbook demo prepare``
filled, at 1, 4, 8, 16 and 32 clients asking the demo questions with the default k=5 (a refused
client waits as its Retry-After says). Per level it counts answers, 429s (and their
Retry-After), 413s, 504s and other 5xx (which must be 0), latency percentiles of the answers,
and the peak resident memory of each service process; then it measures a default request's
latency beside a running k=100 request against its latency alone, sends a request too long for
its deadline (refused at once, never a 504) and one k=100 request, and checks the generator
still answers. Ratios are against the 1-client level of the same run. ``--hog 1`` runs all of it
with a competing CPU load: a process spinning on one core, as a busy neighbour does.

    .venv/bin/python bench/load/run.py --real --var var --seconds 60 --json load-real.json
    .venv/bin/python bench/load/run.py --real --var var --seconds 45 --hog 1

Streaming (``"stream": true``) against plain answers, time to first token: bench/load/stream.py.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

# The stack and data builders: the test kit (tests/openbook_testkit, installed by
# scripts/install.sh for development only).
from openbook_testkit.index import QUESTIONS
from openbook_testkit.stack import LocalStack, build_fact_indexes

QUESTION_LIST = list(QUESTIONS.values())


@dataclass
class Level:
    name: str
    clients: int
    seconds: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    server_p50_ms: float  # the gateway's own total_ms (no client / HTTP overhead)
    retriever_batch: float  # mean requests per batch during the level
    generator_batch: float
    statuses: dict[str, int] = field(default_factory=dict)  # HTTP status (or "conn") -> count
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # service -> peak RSS
    # the Retry-After of the 429s: min, median, max seconds
    retry_after_s: dict[str, float] = field(default_factory=dict)


def _batch_stats(stack: LocalStack) -> dict[str, tuple[float, float]]:
    """Sum and count of ``openbook_batch_size`` per service."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for service, port in (("retriever", "rmetrics"), ("generator", "gmetrics")):
        text = httpx.get(f"http://127.0.0.1:{stack.ports[port]}/metrics", timeout=10).text
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "openbook_batch_size_sum":
                    total += s.value
                elif s.name == "openbook_batch_size_count":
                    count += s.value
        out[service] = (total, count)
    return out


def _mean_batch(before, after, service: str) -> float:
    total = after[service][0] - before[service][0]
    count = after[service][1] - before[service][1]
    return total / count if count else 0.0


def run_clients(client, clients: int) -> float:
    """Run ``client(i)`` for i < ``clients`` in as many threads at once; the seconds it took."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _drive(
    port: int, clients: int, seconds: float, body
) -> tuple[list, list, Counter, float, list]:
    """``clients`` threads, each with one keep-alive connection (``http.client``: the leanest
    client, so the load generator takes little CPU from the stack it measures). A refused client
    waits as its 429's Retry-After says, as a well-behaved client does. Returns the answered
    requests' latencies (client and gateway), every reply's status, the wall time and the
    Retry-After of every 429."""
    latencies: list[float] = []
    server: list[float] = []
    statuses: Counter = Counter()
    retry_after: list[float] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
        n = 0
        while time.perf_counter() < stop_at:
            payload = json.dumps(body(i, n))
            n += 1
            started = time.perf_counter()
            try:
                conn.request("POST", "/answer", payload, {"content-type": "application/json"})
                reply = conn.getresponse()
                data = reply.read()
                status = str(reply.status)
                wait = float(reply.getheader("retry-after") or 1)
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
                status = "conn"
            elapsed = time.perf_counter() - started
            with lock:
                statuses[status] += 1
                if status == "200":
                    latencies.append(elapsed)
                    server.append(json.loads(data)["timings_ms"]["total_ms"] / 1000)
            if status == "429":
                with lock:
                    retry_after.append(wait)
                time.sleep(max(0.0, min(wait, stop_at - time.perf_counter())))
        conn.close()

    return latencies, server, statuses, run_clients(client, clients), retry_after


class PeakRss:
    """Samples the resident memory of every service process of a stack while it runs."""

    SERVICES = ("gateway", "retriever", "generator")

    def __init__(self, stack: LocalStack, every_s: float = 0.25) -> None:
        self.stack = stack
        self.every_s = every_s
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            for name in self.SERVICES:
                try:
                    rss = psutil.Process(self.stack.service_pid(name)).memory_info().rss
                except (LookupError, psutil.Error):
                    continue
                self.peak[name] = max(self.peak.get(name, 0.0), rss / 2**20)
            self._stop.wait(self.every_s)


def run_level(stack: LocalStack, name: str, clients: int, seconds: float, body) -> Level:
    before = _batch_stats(stack)
    with PeakRss(stack) as rss:
        latencies, server, statuses, wall, retry_after = _drive(
            stack.ports["gateway"], clients, seconds, body
        )
    after = _batch_stats(stack)
    ms = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return Level(
        name=name,
        clients=clients,
        seconds=round(wall, 2),
        requests=len(latencies),
        errors=sum(n for status, n in statuses.items() if status != "200"),
        rps=len(latencies) / wall,
        p50_ms=float(np.percentile(ms, 50)),
        p95_ms=float(np.percentile(ms, 95)),
        p99_ms=float(np.percentile(ms, 99)),
        server_p50_ms=float(np.median(server) * 1000) if server else float("nan"),
        retriever_batch=_mean_batch(before, after, "retriever"),
        generator_batch=_mean_batch(before, after, "generator"),
        statuses=dict(statuses),
        peak_rss_mb={k: round(v) for k, v in rss.peak.items()},
        retry_after_s=(
            {
                "min": min(retry_after),
                "median": float(np.median(retry_after)),
                "max": max(retry_after),
            }
            if retry_after
            else {}
        ),
    )


def uncached(i: int, n: int) -> dict:
    # Different questions and k per client, never the cache: every request is retrieved
    # and generated.
    return {
        "question": QUESTION_LIST[(i + n) % len(QUESTION_LIST)],
        "k": 3 + (i + n) % 3,
        "use_cache": False,
    }


def cached(i: int, n: int) -> dict:
    return {"question": QUESTION_LIST[0], "k": 3}


def prepare(var: Path) -> None:
    from openbook_testkit.rag import make_tiny_bart

    build_fact_indexes(var / "indexes")
    if not (var / "models" / "tiny-bart" / "config.json").exists():
        make_tiny_bart(var / "models" / "tiny-bart")


@contextmanager
def running(var: Path, env: dict[str, str]) -> Iterator[LocalStack]:
    stack = LocalStack(var, extra_env=env)
    print("starting the stack (openbook up) ...", flush=True)
    stack.start()
    try:
        for i in range(3):  # warm-up: first requests pay for lazy loading
            httpx.post(f"{stack.url}/answer", json=uncached(i, 0), timeout=120)
        yield stack
    finally:
        stack.stop()


REAL_GENERATOR = "gemma-3-270m"
REAL_INDEX = "wiki-2018"


def demo_questions() -> list[str]:
    """The demo's questions (world leaders, SQuAD), as users of the default stack ask them."""
    root = Path(__file__).resolve().parents[2] / "data"
    questions = []
    for name in ("leaders/questions.jsonl", "squad/questions.jsonl"):
        with open(root / name) as f:
            questions.extend(json.loads(line)["question"] for line in f if line.strip())
    return questions


def real_body(questions: list[str]):
    def body(i: int, n: int) -> dict:
        # Each client walks the questions from its own offset; default k, decoding and lengths.
        return {"question": questions[(i * 97 + n) % len(questions)], "use_cache": False}

    return body


def k100_probe(stack: LocalStack) -> dict:
    """One k=100 request on the running stack, then a default one: the first must answer or
    be refused cleanly, and the generator must still be the same process, answering."""
    pid = stack.service_pid("generator")
    started = time.perf_counter()
    reply = httpx.post(
        f"{stack.url}/answer",
        json={"question": "peru", "k": 100, "max_new_tokens": 4, "use_cache": False},
        timeout=300,
    )
    seconds = time.perf_counter() - started
    after = httpx.post(
        f"{stack.url}/answer",
        json={"question": "Who is the President of Peru?", "use_cache": False},
        timeout=300,
    )
    return {
        "status": reply.status_code,
        "seconds": round(seconds, 2),
        "detail": reply.json().get("detail") if reply.status_code != 200 else None,
        "next_request_status": after.status_code,
        "generator_restarted": stack.service_pid("generator") != pid,
    }


def _ask(stack: LocalStack, body: dict, timeout_s: float = 300) -> tuple[int, float, dict]:
    started = time.perf_counter()
    reply = httpx.post(f"{stack.url}/answer", json=body, timeout=timeout_s)
    return reply.status_code, time.perf_counter() - started, reply.json()


def fairness_probe(stack: LocalStack, questions: list[str], repeats: int = 3) -> dict:
    """A default request's latency alone and while a large request (64 new tokens) runs (the
    issue's target: within 2x); the large request's own outcome. The large request has k=100
    passages, or the most of 100, 80 and 60 that the generator's memory budget admits (a
    refused one is a 413 at once)."""
    alone = [_ask(stack, {"question": questions[i], "use_cache": False})[1] for i in range(repeats)]
    big: dict = {}
    refused: list[dict] = []

    def large() -> None:
        for k in (100, 80, 60):
            body = {"question": "peru", "k": k, "max_new_tokens": 64, "use_cache": False}
            status, seconds, reply = _ask(stack, body)
            outcome = {"k": k, "status": status, "seconds": round(seconds, 2)}
            if status != 413:
                big.update(outcome, detail=reply.get("detail"))
                return
            refused.append({**outcome, "detail": reply.get("detail")})

    thread = threading.Thread(target=large)
    thread.start()
    time.sleep(3.0)  # the large request is prefilling or decoding by now
    beside = []
    for i in range(repeats):
        status, seconds, _ = _ask(stack, {"question": questions[repeats + i], "use_cache": False})
        beside.append(seconds if status == 200 else float("nan"))
    overlapped = thread.is_alive()
    thread.join()
    ratio = float(np.median(beside) / np.median(alone))
    return {
        "alone_s": [round(x, 3) for x in alone],
        "beside_large_s": [round(x, 3) for x in beside],
        "ratio_median": round(ratio, 2),
        "large_still_running_after": overlapped,
        "large": big,
        "refused_for_memory": refused,
    }


def too_long_probe(stack: LocalStack) -> dict:
    """A request that cannot finish within the deadline (16 beams, 512 tokens, thorough): it
    must be refused at once (413 or 429), or answered; never a 504."""
    body = {
        "question": "Who is the President of Peru?",
        "k": 5,
        "num_beams": 16,
        "max_new_tokens": 512,
        "min_new_tokens": 512,
        "decoding": "rag-sequence-thorough",
        "use_cache": False,
    }
    status, seconds, reply = _ask(stack, body)
    return {"status": status, "seconds": round(seconds, 2), "detail": reply.get("detail")}


def real_table(levels: list[Level]) -> str:
    head = (
        "| clients | answered | 429 | Retry-After s (min/med/max) | 413 | 504 | other 5xx "
        "| no reply | answers/s | vs 1 client | p50 ms | p99 ms "
        "| peak RSS MB gateway / retriever / generator |\n"
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    base = min(levels, key=lambda lv: lv.clients).rps
    rows = []
    for lv in levels:
        st = lv.statuses
        other_5xx = sum(n for code, n in st.items() if code.startswith("5") and code != "504")
        rss = lv.peak_rss_mb
        ra = lv.retry_after_s
        waits = f"{ra['min']:.0f} / {ra['median']:.0f} / {ra['max']:.0f}" if ra else "-"
        rows.append(
            f"| {lv.clients} | {lv.requests} | {st.get('429', 0)} | {waits} | {st.get('413', 0)} "
            f"| {st.get('504', 0)} | {other_5xx} | {st.get('conn', 0)} | {lv.rps:.2f} "
            f"| {lv.rps / base if base else float('nan'):.2f}x | {lv.p50_ms:.0f} | {lv.p99_ms:.0f} "
            f"| {rss.get('gateway', 0):.0f} / {rss.get('retriever', 0):.0f} "
            f"/ {rss.get('generator', 0):.0f} |"
        )
    return head + "\n".join(rows)


def main_real(args) -> int:
    var = (args.var or Path("var")).resolve()
    if not (var / "models" / REAL_GENERATOR / "config.json").exists():
        print(f"{var}/models/{REAL_GENERATOR} is missing: run `openbook demo prepare` first")
        return 2
    from openbook_testkit.hog import CpuHog

    env = {}
    if args.threads is not None:
        env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    questions = demo_questions()
    body = real_body(questions)
    levels: list[Level] = []
    stack = LocalStack(var, generator=REAL_GENERATOR, default_index=REAL_INDEX, extra_env=env)
    print("starting the default stack (openbook up, Gemma 3 270M) ...", flush=True)
    stack.start(timeout_s=600)
    hog = CpuHog(args.hog)
    try:
        for i in range(2):  # warm-up: first requests pay for lazy loading
            httpx.post(f"{stack.url}/answer", json=body(i, 0), timeout=300)
        if args.hog:
            print(f"competing load: {args.hog} process(es) spinning on CPU {hog.cpus()}")
        with hog:
            for clients in args.clients:
                print(f"{clients} client(s), uncached, {args.seconds:.0f} s ...", flush=True)
                levels.append(run_level(stack, "real", clients, args.seconds, body))
                print(real_table(levels[-1:]).splitlines()[-1], flush=True)
            print("a default request beside a k=100 request ...", flush=True)
            fairness = fairness_probe(stack, questions[100:])
            print(f"  {fairness}", flush=True)
            print("a request too long for its deadline ...", flush=True)
            too_long = too_long_probe(stack)
            print("one k=100 request ...", flush=True)
            probe = k100_probe(stack)
    finally:
        hog.stop()
        stack.stop()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    load = f"; competing load on CPU {hog.cpus()}" if args.hog else "; no competing load"
    print()
    print(f"machine: {machine}; default stack ({REAL_GENERATOR}, {REAL_INDEX}){load}")
    print(real_table(levels))
    print()
    print(f"default request beside k=100: {fairness}")
    print(f"too long for its deadline: {too_long}")
    print(f"k=100 request: {probe}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "hog_cpus": hog.cpus() if args.hog else [],
                    "levels": [asdict(lv) for lv in levels],
                    "fairness": fairness,
                    "too_long": too_long,
                    "k100": probe,
                },
                indent=2,
            )
        )
    server_errors = sum(
        n for lv in levels for code, n in lv.statuses.items() if code.startswith("5")
    )
    clean_k100 = probe["status"] in (200, 413, 429) and not probe["generator_restarted"]
    clean = too_long["status"] in (200, 413, 429) and fairness["large"].get("status") != 504
    ok = server_errors == 0 and clean_k100 and clean and probe["next_request_status"] == 200
    return 0 if ok else 1


def table(levels: list[Level]) -> str:
    head = (
        "| load | clients | requests | req/s | p50 ms | p95 ms | p99 ms | errors "
        "| gateway p50 ms | mean batch retriever / generator |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = [
        f"| {lv.name} | {lv.clients} | {lv.requests} | {lv.rps:.1f} | {lv.p50_ms:.1f} "
        f"| {lv.p95_ms:.1f} | {lv.p99_ms:.1f} | {lv.errors} | {lv.server_p50_ms:.2f} "
        f"| {lv.retriever_batch:.1f} / {lv.generator_batch:.1f} |"
        for lv in levels
    ]
    return head + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=None,
        help="default: 1 4 16; with --real 1 4 8 16 32",
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="per level (default 10)")
    ap.add_argument("--cached-seconds", type=float, default=5.0)
    ap.add_argument("--var", type=Path, default=None, help="reuse/prepare data here (default: tmp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--compare-unbatched",
        action="store_true",
        help="also run the most clients against a second stack with batching off\n"
        "(batch size 1 in retriever and generator): how much of the gain is batching",
    )
    ap.add_argument(
        "--real",
        action="store_true",
        help="the default stack (Gemma 3 270M, demo index) from --var (default ./var)",
    )
    ap.add_argument(
        "--hog",
        type=int,
        default=0,
        help="with --real: this many processes spinning, each pinned to one of the last CPUs\n"
        "(a busy neighbour; 1 on a 2-core machine takes one core)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per service process (default 1: three model-serving processes\n"
        "share the CPUs; more threads per process only oversubscribe a small machine);\n"
        "with --real: torch's own default, as users run it",
    )
    args = ap.parse_args(argv)
    if args.real:
        args.clients = args.clients or [1, 4, 8, 16, 32]
        return main_real(args)
    args.clients = args.clients or [1, 4, 16]
    args.threads = args.threads or 1

    with tempfile.TemporaryDirectory(prefix="openbook-load-") as tmp:
        var = args.var or Path(tmp)
        print(f"preparing indexes and a tiny BART in {var} ...", flush=True)
        prepare(var)
        threads = str(args.threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        levels = []
        with running(var, env) as stack:
            for clients in args.clients:
                print(f"{clients} client(s), uncached, {args.seconds:.0f} s ...", flush=True)
                levels.append(run_level(stack, "uncached", clients, args.seconds, uncached))
            httpx.post(f"{stack.url}/answer", json=cached(0, 0), timeout=120)  # fill the cache
            print(f"1 client, cached, {args.cached_seconds:.0f} s ...", flush=True)
            levels.append(run_level(stack, "cached", 1, args.cached_seconds, cached))
        if args.compare_unbatched:
            off = {
                "OPENBOOK_GENERATOR_MAX_BATCH_SIZE": "1",
                "OPENBOOK_RETRIEVER_MAX_BATCH_SIZE": "1",
            }
            with running(var, {**env, **off}) as stack:
                clients = max(args.clients)
                print(f"{clients} clients, uncached, batching off ...", flush=True)
                levels.append(
                    run_level(stack, "uncached, batching off", clients, args.seconds, uncached)
                )

    uncached_levels = [lv for lv in levels if lv.name == "uncached"]
    lo = min(uncached_levels, key=lambda lv: lv.clients)
    hi = max(uncached_levels, key=lambda lv: lv.clients)
    speedup = hi.rps / lo.rps if lo.rps else float("nan")
    cached_level = next(lv for lv in levels if lv.name == "cached")
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{args.threads} torch thread(s) per service"
    )
    print()
    print(f"machine: {machine}")
    print(table(levels))
    print()
    print(
        f"throughput {hi.clients} clients / {lo.clients}: {speedup:.1f}x (target >= 3x); "
        f"cached answer p50: {cached_level.p50_ms:.2f} ms at the client, "
        f"{cached_level.server_p50_ms:.2f} ms in the gateway (target <= 5 ms)"
    )
    unbatched = [lv for lv in levels if lv.name == "uncached, batching off"]
    if unbatched and unbatched[0].rps:
        print(
            f"batching at {hi.clients} clients: {hi.rps / unbatched[0].rps:.1f}x the throughput "
            "with batching off"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "levels": [asdict(lv) for lv in levels],
                    "speedup": speedup,
                    "cached_p50_ms": cached_level.p50_ms,
                },
                indent=2,
            )
        )
    return 0 if all(lv.errors == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
