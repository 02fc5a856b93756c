"""The gateway's HTTP input: generated requests (schemathesis) never get a 5xx; limits hold.

The gateway runs under uvicorn on 127.0.0.1, in front of a real retriever and a real generator
gRPC server (tiny BART) and a real Redis. The generator decodes at most a few tokens with at
most two beams whatever the request asks (``BoundedCost``): every generated request still
runs the real validation, tokenisation and model, but hundreds of them fit in a minute.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from openbook.rag.generator import validate_request
from openbook_testkit.stack import running_backends, serving_gateway

TOKEN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY_BYTES = 16 * 1024

# (path, method) -> examples per generation mode; /answer gets most of them.
BUDGET = {
    ("/answer", "POST"): 220,
    ("/admin/swap-index", "POST"): 40,
    ("/admin/reload-model", "POST"): 40,
    ("/indexes", "GET"): 5,
    ("/healthz", "GET"): 5,
    ("/readyz", "GET"): 5,
    ("/metrics", "GET"): 5,
}


class BoundedCost:
    """A generator that validates requests as asked but decodes them cheaply."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def engine(self, *args, **kwargs):
        """The inner engine, admitting every (validated) request with cheap options."""
        engine = self.inner.engine(*args, **kwargs)
        add = engine.add

        def cheap_add(question, passages, options, **more):
            validate_request(question, passages, options)
            return add(question, passages, _cheap(options), **more)

        engine.add = cheap_add
        return engine


def _cheap(options):
    beams, tokens = min(options.num_beams, 2), min(options.max_new_tokens, 4)
    return dataclasses.replace(
        options,
        num_beams=beams,
        max_new_tokens=tokens,
        min_new_tokens=min(options.min_new_tokens, tokens),
        num_return_sequences=min(options.num_return_sequences, beams),
    )


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, redis_server):
    with running_backends(
        tmp_path_factory.mktemp("backends"), redis_server.url, admin_token=TOKEN
    ) as backends:
        servicer = backends.generator_servicer
        servicer.generator = BoundedCost(servicer.generator)
        settings = backends.gateway_settings(
            redis_server.url,
            admin_token=TOKEN,
            max_body_bytes=MAX_BODY_BYTES,
            retrieve_timeout_s=30,
            generate_timeout_s=60,
        )
        with serving_gateway(settings) as url:
            yield url


def _fuzz(url: str, operation, mode, examples: int, headers, outcomes: list) -> None:
    """Send ``examples`` generated requests for ``operation``; record each status."""

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same requests on every run: failures reproduce
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=120)
        outcomes.append(
            (response.status_code, f"{case.as_curl_command(headers)}: {response.text[:300]}")
        )

    fuzz()


def test_generated_requests_never_get_a_5xx(gateway_url):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    operations = {
        (op.path, op.method.upper()): op for op in (r.ok() for r in schema.get_all_operations())
    }
    assert set(BUDGET) <= set(operations), sorted(operations)
    outcomes: list[tuple[int, str]] = []
    for (path, method), examples in BUDGET.items():
        headers = AUTH if path.startswith("/admin/") else None
        # Operations without a body or parameters have no invalid form to generate.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
        for mode in modes:
            _fuzz(gateway_url, operations[(path, method)], mode, examples, headers, outcomes)

    server_errors = [f"{status} for {what}" for status, what in outcomes if status >= 500]
    assert server_errors == [], "\n".join(server_errors[:10])
    assert len(outcomes) >= 500
    assert any(status == 200 for status, _ in outcomes)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"question": "x" * 2001}, "question"),
        ({"question": "q", "k": 101}, "k"),
        ({"question": "q", "num_beams": 17}, "num_beams"),
        ({"question": "q", "max_new_tokens": 513}, "max_new_tokens"),
        ({"question": "q", "min_new_tokens": 40, "max_new_tokens": 32}, "min_new_tokens"),
        ({"question": "q", "num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"question": "q", "length_penalty": 11}, "length_penalty"),
        ({"question": "q", "unknown": 1}, "unknown"),
    ],
)
def test_limits_are_422_naming_the_field(gateway_url, body, field):
    reply = httpx.post(f"{gateway_url}/answer", json=body, timeout=30)
    assert reply.status_code == 422, reply.text
    assert field in reply.text


def test_lone_surrogates_are_a_422_not_a_crash(gateway_url):
    body = b'{"question": "who \\ud800 wrote", "k": 2}'
    reply = httpx.post(
        f"{gateway_url}/answer",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 422, reply.text


def test_bodies_over_the_limit_are_413_whether_declared_or_streamed(gateway_url):
    big = b'{"question": "' + b"x" * MAX_BODY_BYTES + b'"}'
    declared = httpx.post(
        f"{gateway_url}/answer",
        content=big,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert declared.status_code == 413
    assert str(MAX_BODY_BYTES) in declared.json()["detail"]
    assert declared.headers["x-request-id"]

    def chunks():  # no Content-Length: sent chunked
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    streamed = httpx.post(
        f"{gateway_url}/answer",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert streamed.status_code == 413
    assert str(MAX_BODY_BYTES) in streamed.json()["detail"]

    within = httpx.post(f"{gateway_url}/answer", json={"question": "Who wrote Hamlet?"}, timeout=60)
    assert within.status_code == 200, within.text
