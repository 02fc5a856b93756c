"""Prometheus metrics of a gRPC service, exported over HTTP on a port of its own."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceMetrics:
    """Per-RPC counts and latencies, batching, and what the service is serving right now."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter(
            "openbook_rpc_total",
            "RPCs by method and status code",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "openbook_rpc_seconds",
            "RPC latency",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "openbook_batch_size",
            "Requests per batched forward pass",
            ["service"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "openbook_queue_depth",
            "Requests waiting to be batched",
            ["service"],
            registry=self.registry,
        )
        self.dropped = Counter(
            "openbook_dropped_total",
            "Requests dropped because every caller gave up (deadline passed, cancelled), by "
            "where: 'queued' before a batch took them, 'running' between decoding steps",
            ["service", "where"],
            registry=self.registry,
        )
        self.serving = Gauge(
            "openbook_serving_info",
            "1 for the index or model version being served",
            ["service", "kind", "name"],
            registry=self.registry,
        )
        self.passage_cache = Gauge(
            "openbook_passage_cache_lookups",
            "Passage prompts looked up in the generator's passage cache since the model loaded, "
            "by result ('hit': keys/values reused, 'miss': prefilled)",
            ["service", "result"],
            registry=self.registry,
        )
        self.slowdown = Gauge(
            "openbook_generator_slowdown",
            "How much slower the generator's work is now than when its speed was calibrated at "
            "load (openbook_generator/speed.py), by kind ('prefill', 'step'): what admission "
            "plans with",
            ["service", "kind"],
            registry=self.registry,
        )
        self.compute_threads = Gauge(
            "openbook_compute_threads",
            "torch/OpenMP threads the service computes with now: sized to the CPU it gets "
            "(affinity, cgroup quota, what neighbours take) unless set "
            "(openbook/runtime/compute_threads.py)",
            ["service"],
            registry=self.registry,
        )
        self.index_version = Gauge(
            "openbook_index_version",
            "The version of each live index as last served or written here (it grows by one "
            "with every acknowledged document write; 0 for a built index)",
            ["service", "index"],
            registry=self.registry,
        )
        self.service = service

    def set_index_version(self, index: str, version: int) -> None:
        self.index_version.labels(self.service, index).set(version)

    def forget_index(self, index: str) -> None:
        """An index deleted: its version is no longer reported."""
        with contextlib.suppress(KeyError):
            self.index_version.remove(self.service, index)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(self.service, method, code).inc()
        self.rpc_seconds.labels(self.service, method).observe(seconds)

    def observe_batch(self, size: int, queued: int) -> None:
        self.batch_size.labels(self.service).observe(size)
        self.queue_depth.labels(self.service).set(queued)

    def observe_dropped(self, where: str, count: int = 1) -> None:
        self.dropped.labels(self.service, where).inc(count)

    def track_queue(self, depth: Callable[[], int]) -> None:
        """Report the live queue depth at every scrape (not only when a batch starts)."""
        self.queue_depth.labels(self.service).set_function(depth)

    def track_passage_cache(self, lookups: Callable[[str], int]) -> None:
        """Report ``lookups("hit")`` and ``lookups("miss")`` at every scrape."""
        for result in ("hit", "miss"):
            self.passage_cache.labels(self.service, result).set_function(
                functools.partial(lookups, result)
            )

    def track_slowdown(self, slowdown: Callable[[str], float]) -> None:
        """Report ``slowdown("prefill")`` and ``slowdown("step")`` at every scrape."""
        for kind in ("prefill", "step"):
            self.slowdown.labels(self.service, kind).set_function(functools.partial(slowdown, kind))

    def set_compute_threads(self, n: int) -> None:
        self.compute_threads.labels(self.service).set(n)

    def set_serving(self, kind: str, name: str) -> None:
        """Record the one ``kind`` ('index', 'model') being served: ``name``."""
        (family,) = self.serving.collect()  # one labelled gauge: one metric family
        for metric in list(family.samples):
            if metric.labels["kind"] == kind:
                self.serving.remove(metric.labels["service"], kind, metric.labels["name"])
        self.serving.labels(self.service, kind, name).set(1)

    def serve_http(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", host, port)
