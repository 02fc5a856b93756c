"""Prometheus metrics of a gRPC service, exported over HTTP on a port of its own."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=MetricWrapperBase)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceMetrics:
    """Per-RPC counts and latencies, batching, and what the service is serving right now."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = self._metric(
            Counter, "openbook_rpc_total", "RPCs by method and status code", ["method", "code"]
        )
        self.rpc_seconds = self._metric(
            Histogram, "openbook_rpc_seconds", "RPC latency", ["method"], buckets=LATENCY_BUCKETS
        )
        self.batch_size = self._metric(
            Histogram,
            "openbook_batch_size",
            "Requests per batched forward pass",
            buckets=(1, 2, 4, 8, 16, 32, 64),
        )
        self.queue_depth = self._metric(
            Gauge, "openbook_queue_depth", "Requests waiting to be batched"
        )
        self.dropped = self._metric(
            Counter,
            "openbook_dropped_total",
            "Requests dropped because every caller gave up (deadline passed, cancelled), by "
            "where: 'queued' before a batch took them, 'running' between decoding steps",
            ["where"],
        )
        self.serving = self._metric(
            Gauge,
            "openbook_serving_info",
            "1 for the index or model version being served",
            ["kind", "name"],
        )
        self.passage_cache = self._metric(
            Gauge,
            "openbook_passage_cache_lookups",
            "Passage prompts looked up in the generator's passage cache since the model loaded, "
            "by result ('hit': keys/values reused, 'miss': prefilled)",
            ["result"],
        )
        self.slowdown = self._metric(
            Gauge,
            "openbook_generator_slowdown",
            "How much slower the generator's work is now than when its speed was calibrated at "
            "load (openbook_generator/speed.py), by kind ('prefill', 'step', 'scoring': "
            "RAG-Sequence thorough's): what admission plans with",
            ["kind"],
        )
        self.compute_threads = self._metric(
            Gauge,
            "openbook_compute_threads",
            "torch/OpenMP threads the service computes with now: sized to the CPU it gets "
            "(affinity, cgroup quota, what neighbours take) unless set "
            "(openbook/runtime/compute_threads.py)",
        )
        self.index_version = self._metric(
            Gauge,
            "openbook_index_version",
            "The version of each live index as last served or written here (it grows by one "
            "with every acknowledged document write; 0 for a built index)",
            ["index"],
        )
        self.service = service

    def _metric(
        self,
        kind: type[_M],
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        **options: Any,
    ) -> _M:
        """A ``kind`` metric in this registry, labelled by the service, then by ``labels``."""
        return kind(name, documentation, ["service", *labels], registry=self.registry, **options)

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
        """Report ``slowdown(kind)`` of every kind of work at every scrape."""
        for kind in ("prefill", "step", "scoring"):
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
