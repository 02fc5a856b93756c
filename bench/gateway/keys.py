"""What keys and tenants cost at the gateway (issue 43), measured in one run against references
taken in the same run.

1. The door on ``/answer``: the same cached answer asked for (a cache hit: no retrieval, no
   generation, so what is left is the gateway's own work) anonymously, with a key with the
   ``ask`` scope (one Redis ``GET``, a salted SHA-256), and with a tenant key that also has a
   ``filter`` and a ``rate`` (plus the rate's Redis transaction; the filter ANDed into the
   cache key). The three take turns request by request; reported: p50 and p90 of each and the
   extra milliseconds of each key against anonymous at the median.
2. Retrieval with a tenant filter: a live index of ``--docs`` documents of which 1% carry the
   tenant, searched (MCP ``search``, k = 5: retrieval only) with the tenant's key against the
   admin token without a filter, alternating; reported: p50 of each, their ratio, and whether
   every tenant search was filled to k with the tenant's passages only.

Everything runs in this process on loopback: a private Redis (as the tests start it), the real
retriever (MiniLM, flat) and a tiny generator, and the gateway under uvicorn.

    .venv/bin/python bench/gateway/keys.py --json docs/bench/gateway-keys-2026-11-29.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from openbook_testkit.stack import RedisServer, running_backends, serving_gateway

INDEX = "tenant-bench"
QUESTION = "Who wrote Hamlet?"
MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-06-18",
}


def percentiles(samples: list[float]) -> dict[str, float]:
    values = np.array(samples) * 1000
    return {"p50_ms": float(np.percentile(values, 50)), "p90_ms": float(np.percentile(values, 90))}


def timed(call: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
    """How long ``call`` took (seconds), and its reply, which must be a 200."""
    started = time.perf_counter()
    reply = call()
    seconds = time.perf_counter() - started
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
    return seconds, reply


def interleaved(rounds: int, variants: dict[str, Callable[[], float]]) -> dict[str, dict]:
    """The percentiles of each variant's seconds, the variants taking turns call by call (so
    that what drifts during the run, a cache warming, the machine's load, hits all alike)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            samples[name].append(call())
    return {name: percentiles(values) for name, values in samples.items()}


def make_key(client: httpx.Client, admin: dict, body: dict) -> dict:
    reply = client.post("/admin/keys", json=body, headers=admin)
    reply.raise_for_status()
    return {"Authorization": f"Bearer {reply.json()['key']}"}


def tenant_key(client: httpx.Client, admin: dict, name: str, **more: object) -> dict:
    """A key that asks and writes in INDEX as tenant ``t0`` (its filter), with ``more``."""
    body = {
        "name": name,
        "scopes": ["ask", "write"],
        "indexes": [INDEX],
        "filter": {"tenant": "t0"},
        **more,
    }
    return make_key(client, admin, body)


def door(client: httpx.Client, admin: dict, rounds: int) -> dict:
    """Part 1 (module docstring)."""
    variants = {
        "anonymous": {},
        "ask key": make_key(client, admin, {"name": "bench-ask", "scopes": ["ask"]}),
        "tenant key (filter, rate)": tenant_key(
            client, admin, "bench-tenant", rate={"requests_per_minute": 1_000_000}
        ),
    }
    body = {"question": QUESTION, "max_new_tokens": 4, "index": INDEX, "use_cache": True}
    for headers in variants.values():  # each one's answer computed once, then cached
        client.post("/answer", json=body, headers=headers).raise_for_status()
        hit = client.post("/answer", json=body, headers=headers).json()
        if not hit["cached"]:
            raise RuntimeError("the answer was not cached: the door would be measured with work")

    def asking(headers: dict) -> Callable[[], float]:
        return lambda: timed(lambda: client.post("/answer", json=body, headers=headers))[0]

    stats = interleaved(rounds, {name: asking(headers) for name, headers in variants.items()})
    base = stats["anonymous"]["p50_ms"]
    for name in variants:
        stats[name]["extra_p50_ms"] = stats[name]["p50_ms"] - base
    return stats


def search(client: httpx.Client, headers: dict, k: int) -> tuple[float, list[dict]]:
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "search", "arguments": {"query": QUESTION, "k": k, "index": INDEX}},
    }
    seconds, reply = timed(
        lambda: client.post("/mcp", json=call, headers={**MCP_HEADERS, **headers})
    )
    result = reply.json()["result"]
    if result.get("isError"):
        raise RuntimeError(str(result)[:300])
    return seconds, result["structuredContent"]["passages"]


def tenant_retrieval(
    client: httpx.Client, admin: dict, tenant: dict, rounds: int, k: int, own: int
) -> dict:
    """Part 2 (module docstring)."""
    filled = True

    def tenant_search() -> float:
        nonlocal filled
        seconds, passages = search(client, tenant, k)
        # filled: k passages, or every one of the tenant's (its documents are one passage each)
        filled &= len(passages) == min(k, own)
        filled &= all(p["document"].startswith("t0-") for p in passages)
        return seconds

    stats: dict = interleaved(
        rounds,
        {
            "no filter (admin)": lambda: search(client, admin, k)[0],
            "tenant filter (1%)": tenant_search,
        },
    )
    stats["ratio_p50"] = (
        stats["tenant filter (1%)"]["p50_ms"] / stats["no filter (admin)"]["p50_ms"]
    )
    stats["k_always_filled_with_the_tenants_passages"] = bool(filled)
    return stats


def fill_index(client: httpx.Client, admin: dict, tenant: dict, docs: int) -> int:
    """``docs`` documents, 1% of them written by the tenant (its field stamped), the rest by
    the admin under other tenants."""
    made = client.post("/indexes", json={"name": INDEX, "like": "facts-a"}, headers=admin)
    made.raise_for_status()
    own = max(1, docs // 100)
    others = [
        {
            "id": f"o-{i:05d}",
            "title": f"Note {i}",
            "text": f"Note {i} of tenant {1 + i % 50}: Shakespeare wrote Hamlet, play {i}.",
            "metadata": {"tenant": f"t{1 + i % 50}"},
        }
        for i in range(docs - own)
    ]
    for start in range(0, len(others), 200):
        batch = {"documents": others[start : start + 200]}
        client.post(
            f"/indexes/{INDEX}/documents:batch", json=batch, headers=admin
        ).raise_for_status()
    mine = [
        {"id": f"t0-{i:03d}", "title": f"Own {i}", "text": f"Own note {i}: Hamlet is a play."}
        for i in range(own)
    ]
    client.post(
        f"/indexes/{INDEX}/documents:batch", json={"documents": mine}, headers=tenant
    ).raise_for_status()
    return own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="requests per variant")
    parser.add_argument("--docs", type=int, default=1000, help="documents in the live index")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        os.environ["OPENBOOK_SERVER_KEY_FILE"] = str(redis.secrets.server_key)
        try:
            with running_backends(Path(tmp) / "stack", redis.url) as backends:
                settings = backends.gateway_settings(redis.url)
                admin = {"Authorization": f"Bearer {backends.admin_token}"}
                with (
                    serving_gateway(settings) as url,
                    httpx.Client(base_url=url, timeout=120) as client,
                ):
                    tenant = tenant_key(client, admin, "bench-writer")
                    own = fill_index(client, admin, tenant, args.docs)
                    results = {
                        "door_on_cached_answer": door(client, admin, args.rounds),
                        "tenant_retrieval": tenant_retrieval(
                            client, admin, tenant, args.rounds, args.k, own
                        ),
                    }
        finally:
            redis.stop()
    results["setup"] = {
        "rounds": args.rounds,
        "docs": args.docs,
        "k": args.k,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
