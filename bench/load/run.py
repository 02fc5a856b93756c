"""Load benchmark of the whole system: the stack ``openbook up`` starts, with small models.

N concurrent clients (default 1, 4, 16) post uncached questions to the gateway for a fixed
time each; then one client asks a question whose answer is cached. Reports requests/s,
p50/p95/p99 latency, errors and the mean batch sizes the retriever and generator formed, and
two ratios measured in the same run: throughput at the most clients over one client (target
>= 3x, from batching) and the p50 latency of a cached answer (target <= 5 ms).

    .venv/bin/python -m bench.load                     # 10 s per level, tiny BART
    .venv/bin/python -m bench.load --seconds 30 --json load.json
    .venv/bin/python bench/load/run.py --clients 1 8 32

Models: the generator is a tiny random BART (``openbook.rag.testing.make_tiny_bart``), the
retriever MiniLM over two 30-passage indexes (``openbook.testing.build_fact_indexes``): the
benchmark measures the serving system (HTTP, gRPC, batching, cache), not model quality.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from openbook.index.testing import QUESTIONS  # noqa: E402
from openbook.testing import LocalStack, build_fact_indexes  # noqa: E402

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


def _drive(port: int, clients: int, seconds: float, body) -> tuple[list, list, int, float]:
    """``clients`` threads, each with one keep-alive connection (``http.client``: the leanest
    client, so the load generator takes little CPU from the stack it measures)."""
    latencies: list[float] = []
    server: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        nonlocal errors
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        n = 0
        while time.perf_counter() < stop_at:
            payload = json.dumps(body(i, n))
            n += 1
            started = time.perf_counter()
            try:
                conn.request("POST", "/answer", payload, {"content-type": "application/json"})
                reply = conn.getresponse()
                data = reply.read()
                ok = reply.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                ok = False
            elapsed = time.perf_counter() - started
            with lock:
                if ok:
                    latencies.append(elapsed)
                    server.append(json.loads(data)["timings_ms"]["total_ms"] / 1000)
                else:
                    errors += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, server, errors, time.perf_counter() - started


def run_level(stack: LocalStack, name: str, clients: int, seconds: float, body) -> Level:
    before = _batch_stats(stack)
    latencies, server, errors, wall = _drive(stack.ports["gateway"], clients, seconds, body)
    after = _batch_stats(stack)
    ms = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return Level(
        name=name,
        clients=clients,
        seconds=round(wall, 2),
        requests=len(latencies),
        errors=errors,
        rps=len(latencies) / wall,
        p50_ms=float(np.percentile(ms, 50)),
        p95_ms=float(np.percentile(ms, 95)),
        p99_ms=float(np.percentile(ms, 99)),
        server_p50_ms=float(np.median(server) * 1000) if server else float("nan"),
        retriever_batch=_mean_batch(before, after, "retriever"),
        generator_batch=_mean_batch(before, after, "generator"),
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
    from openbook.rag.testing import make_tiny_bart

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
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
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
        "--threads",
        type=int,
        default=1,
        help="torch threads per service process (default 1: three model-serving processes\n"
        "share the CPUs; more threads per process only oversubscribe a small machine)",
    )
    args = ap.parse_args(argv)

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
            off = {"OPENBOOK_MAX_BATCH_SIZE": "1", "OPENBOOK_RETRIEVER_MAX_BATCH_SIZE": "1"}
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
