"""Prometheus metrics of the gateway (one registry per app, so tests can build many apps), and
the timing of the stages of ``/answer``: both recorded here, nowhere else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "openbook_gateway_requests_total",
            "HTTP requests by route, status code and the name of the key that sent them "
            "(anonymous: none; admin-token, api-key: the admin token, the static list)",
            ["route", "status", "key"],
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "openbook_gateway_stage_seconds",
            "Time spent per stage of /answer",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.cache = Counter(
            "openbook_gateway_cache_total",
            "Answer cache lookups by outcome (hit, miss, skipped)",
            ["outcome"],
            registry=self.registry,
        )
        self.active_index = Gauge(
            "openbook_active_index_info",
            "1 for the index that served the latest answer",
            ["index"],
            registry=self.registry,
        )
        self.serving = Gauge(
            "openbook_gateway_model_info",
            "1 for the model version of each service that computed the latest answer",
            ["service", "version"],
            registry=self.registry,
        )
        self.streams = Counter(
            "openbook_gateway_streams_total",
            "Streamed responses by API (answer, openai) and how they ended: completed, or "
            "disconnected (the client went away; its generation was cancelled)",
            ["api", "outcome"],
            registry=self.registry,
        )
        self.index_versions = Gauge(
            "openbook_index_version",
            "Each index's version (its count of acknowledged document writes) as this gateway "
            "last saw it: in a listing, a write's reply or an answer",
            ["index"],
            registry=self.registry,
        )
        self._lookups = {"hit": 0, "miss": 0}
        hit_ratio = Gauge(
            "openbook_gateway_cache_hit_ratio",
            "Share of answer-cache lookups that were hits, since the gateway started",
            registry=self.registry,
        )
        hit_ratio.set_function(
            lambda: self._lookups["hit"] / max(1, self._lookups["hit"] + self._lookups["miss"])
        )

    def cache_lookup(self, hit: bool) -> None:
        outcome = "hit" if hit else "miss"
        self.cache.labels(outcome).inc()
        self._lookups[outcome] += 1

    def cache_skipped(self) -> None:
        self.cache.labels("skipped").inc()

    def stream_ended(self, api: str, outcome: str) -> None:
        self.streams.labels(api, outcome).inc()

    def answered(self, index: str, versions: dict[str, str]) -> None:
        """An answer was computed on ``index`` by these model versions (service -> version)."""
        self.active_index.clear()
        self.active_index.labels(index).set(1)
        self.serving.clear()
        for service, version in versions.items():
            self.serving.labels(service, version).set(1)

    def index_version(self, index: str, version: int) -> None:
        self.index_versions.labels(index).set(version)

    def index_deleted(self, index: str) -> None:
        with suppress(KeyError):  # never seen by this gateway
            self.index_versions.remove(index)

    def stages(self) -> StageTimer:
        return StageTimer(self)


class StageTimer:
    """The timings of one ``/answer`` request: each stage goes to the response's
    ``timings_ms`` (as ``<stage>_ms``) and to the stage histogram."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[f"{name}_ms"] = elapsed = ms_since(start)
        self.metrics.stage_seconds.labels(name).observe(elapsed / 1000)

    def done(self) -> dict[str, float]:
        """The timings, with ``total_ms`` up to now."""
        self.timings["total_ms"] = ms_since(self.started)
        return self.timings
