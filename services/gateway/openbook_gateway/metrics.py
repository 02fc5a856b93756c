"""Prometheus metrics of the gateway (one registry per app, so tests can build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "openbook_gateway_requests_total",
            "HTTP requests by route and status code",
            ["route", "status"],
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
