"""The whole system, started by `openbook up` from docker-compose.yml, asked over HTTP.

Same commands and environment as `docker compose up`; only the models are tiny (a random BART)
and the indexes small, so the test checks the pipeline, not answer quality.
"""

from __future__ import annotations

import httpx
import pytest

from openbook.index import build_index
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.otlp import OtlpReceiver
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.sse import read_events
from openbook_testkit.stack import REPO_ROOT, LocalStack, build_fact_indexes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def otlp():
    """The collector the stack's three processes export their spans to (tracing on)."""
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, otlp):
    var = tmp_path_factory.mktemp("var")
    build_fact_indexes(var / "indexes")
    # The leaders snapshots alone (without SQuAD) stand in for wiki-2016 / wiki-2018.
    for year in ("2016", "2018"):
        source = REPO_ROOT / "data" / "leaders" / f"wiki{year}.jsonl"
        build_index(
            [source],
            var / "indexes" / f"wiki-{year}",
            IndexSpec(name=f"wiki-{year}"),
            BuildOptions(progress=False),
        )
    make_tiny_bart(var / "models" / "tiny-bart")
    # Tracing on, as an operator turns it on (docs/observability.md): every test of this
    # module runs through the traced stack; spans leave each process every 100 ms.
    tracing = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    stack = LocalStack(var, extra_env=tracing)
    stack.start()
    yield stack
    stack.stop()


def test_question_flows_through_every_service(stack):
    question = {"question": "Who wrote Hamlet?", "k": 3}
    reply = httpx.post(f"{stack.url}/answer", json=question, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["index"] == "facts-a"
    assert body["passages"][0]["id"] == "p21"
    assert len(body["passages"]) == 3
    assert isinstance(body["answer"], str)
    assert body["model_version"] and body["retriever_version"]
    again = httpx.post(f"{stack.url}/answer", json=question, timeout=60)
    assert again.json()["cached"] is True


def test_swap_index_over_http_changes_the_answering_index(stack):
    question = {"question": "Who discovered penicillin?", "k": 2}
    before = httpx.post(f"{stack.url}/answer", json=question, timeout=60).json()
    assert before["index"] == "facts-a"
    swap = f"{stack.url}/admin/swap-index"
    assert httpx.post(swap, json={"index": "facts-b"}, timeout=60).status_code == 401
    swapped = httpx.post(swap, json={"index": "facts-b"}, headers=stack.auth, timeout=60)
    assert swapped.status_code == 200, swapped.text
    assert swapped.json() == {"previous": "facts-a", "active": "facts-b"}
    after = httpx.post(f"{stack.url}/answer", json=question, timeout=60).json()
    assert after["index"] == "facts-b"
    assert after["cached"] is False
    assert after["passages"][0]["id"] == "b-p18"
    unknown = httpx.post(swap, json={"index": "wiki-1999"}, headers=stack.auth, timeout=60)
    assert unknown.status_code == 422
    assert "wiki-1999" in unknown.json()["detail"]
    assert httpx.get(f"{stack.url}/indexes", timeout=10).json()["active"] == "facts-b"


def test_bad_input_is_422_naming_the_fields(stack):
    reply = httpx.post(f"{stack.url}/answer", json={"question": "", "k": 500}, timeout=10)
    assert reply.status_code == 422
    assert {err["loc"][-1] for err in reply.json()["detail"]} == {"question", "k"}


def test_every_service_exports_metrics(stack):
    gateway = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert "openbook_gateway_requests_total" in gateway
    retriever = httpx.get(f"http://127.0.0.1:{stack.ports['rmetrics']}/metrics", timeout=10).text
    assert 'method="Retrieve"' in retriever
    generator = httpx.get(f"http://127.0.0.1:{stack.ports['gmetrics']}/metrics", timeout=10).text
    assert "openbook_batch_size" in generator


def test_openbook_ask_shows_answer_and_provenance(stack):
    from typer.testing import CliRunner

    from openbook_cli.app import app

    result = CliRunner().invoke(
        app, ["ask", "Who wrote Hamlet?", "--url", stack.url, "--k", "3"], env={"COLUMNS": "160"}
    )
    assert result.exit_code == 0, result.output
    assert "Passages" in result.output and "Shakespeare" in result.output
    assert "RAG-Token" in result.output  # the per-token posterior table
    assert "confidence" in result.output
    withheld = CliRunner().invoke(
        app, ["ask", "Who wrote Hamlet?", "--url", stack.url, "--min-confidence", "1"]
    )
    assert withheld.exit_code == 0, withheld.output
    assert "Not confident enough to answer" in withheld.output
    bad = CliRunner().invoke(app, ["ask", "   ", "--url", stack.url])
    assert bad.exit_code == 1
    assert "HTTP 422" in bad.output


def test_hot_swap_experiment_swaps_the_live_index(stack, tmp_path):
    from typer.testing import CliRunner

    from openbook_cli.app import app

    report = tmp_path / "results.md"
    result = CliRunner().invoke(
        app,
        [
            "experiments",
            "hot-swap",
            "--url",
            stack.url,
            "--admin-token",
            stack.admin_token,
            "--limit",
            "3",
            "--out",
            str(tmp_path),
            "--report",
            str(report),
        ],
    )
    assert result.exit_code == 0, result.output
    text = report.read_text()
    assert "| wiki-2016 |" in text and "| wiki-2018 |" in text
    assert "openbook experiments hot-swap" in text
    import json

    rows = json.loads((tmp_path / "hot_swap.json").read_text())["predictions"]
    assert [r["index"] for r in rows] == ["wiki-2016"] * 3 + ["wiki-2018"] * 3


# --- issue 29: an authenticated Redis whose contents are not trusted blindly ---------------


def test_secrets_are_made_on_first_start_private_and_never_shown(stack):
    import stat

    files = stack.secrets
    for path in (files.password, files.acl, files.server_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    password = files.password.read_text().strip()
    assert len(password) >= 40
    assert password not in files.acl.read_text()  # stored as its SHA-256
    assert password not in stack.log_tail(10_000_000)


def test_redis_of_the_stack_refuses_a_process_without_the_password(stack):
    import redis

    anonymous = stack.redis(password=False)
    for attack in (
        lambda: anonymous.set("openbook:active-index", "wiki-2016"),
        lambda: anonymous.publish("openbook:index-swaps", "wiki-2016"),
        lambda: anonymous.keys("openbook:answer:*"),
    ):
        with pytest.raises(redis.AuthenticationError):
            attack()
    assert stack.redis().ping()


def _active(stack) -> str:
    return httpx.get(f"{stack.url}/indexes", timeout=10).json()["active"]


def test_an_insider_cannot_poison_a_cached_answer(stack):
    import json
    import time

    question = {"question": "Who painted the Mona Lisa?", "k": 2}
    first = httpx.post(f"{stack.url}/answer", json=question, timeout=60).json()
    assert httpx.post(f"{stack.url}/answer", json=question, timeout=60).json()["cached"] is True
    insider = stack.redis()
    poisoned = json.dumps({**first, "answer": "POISONED: visit evil.example"})
    for key in insider.scan_iter(match="openbook:answer:*"):
        insider.set(key, poisoned)
    again = httpx.post(f"{stack.url}/answer", json=question, timeout=60).json()
    assert again["cached"] is False
    assert again["answer"] == first["answer"]
    deadline = time.monotonic() + 10  # the gateway's log line reaches the stack log
    while "not sealed with this deployment's server key" not in stack.log_tail(10_000_000):
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)


def test_an_insider_cannot_switch_the_index_replicas_serve(stack):
    import time

    from openbook.security.sealing import load_sealer

    active = _active(stack)
    other = "wiki-2016"  # a real index of the stack: only who decides is wrong
    insider = stack.redis()
    insider.set("openbook:active-index", other)
    insider.publish("openbook:index-swaps", other)
    # The replica re-reads the key, rejects it and writes back its own, sealed.
    key = load_sealer(stack.secrets.server_key)
    deadline = time.monotonic() + 30
    while key.open("openbook:active-index", insider.get("openbook:active-index")) != active:
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    assert _active(stack) == active
    reply = httpx.post(f"{stack.url}/answer", json={"question": "Who wrote Hamlet?"}, timeout=60)
    assert reply.json()["index"] == active


def test_a_bad_shared_index_name_is_logged_once_not_every_two_seconds(stack):
    import time

    from openbook.security.sealing import load_sealer

    active = _active(stack)
    insider = stack.redis()
    # Sealed with the deployment's own key (an index deleted since, say): genuine, yet not
    # something the registry can load.
    sealed = load_sealer(stack.secrets.server_key).seal("openbook:active-index", "wiki-1999")
    insider.set("openbook:active-index", sealed)
    insider.publish("openbook:index-swaps", "wiki-1999")
    line = "not following the shared active index 'wiki-1999'"
    try:
        deadline = time.monotonic() + 30
        while line not in stack.log_tail(10_000_000):
            assert time.monotonic() < deadline, stack.log_tail()
            time.sleep(0.2)
        time.sleep(6.5)  # three of the retriever's periodic re-reads (every 2 s)
        assert stack.log_tail(10_000_000).count(line) == 1
        assert _active(stack) == active
    finally:
        key = load_sealer(stack.secrets.server_key)
        insider.set("openbook:active-index", key.seal("openbook:active-index", active))
        insider.publish("openbook:index-swaps", active)


def test_one_question_is_one_trace_across_the_three_services(stack, otlp):
    request_id = "trace-me-0001"
    question = {"question": "Which path does a traced question take?", "k": 2}
    reply = httpx.post(
        f"{stack.url}/answer", json=question, headers={"X-Request-ID": request_id}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["cached"] is False  # a question no other test asks: the whole pipeline ran

    def roots(spans):
        return [s for s in spans if s.attributes.get("openbook.request_id") == request_id]

    def complete(spans):
        mine = roots(spans)
        names = {s.name for s in spans if mine and s.trace_id == mine[0].trace_id}
        return {"POST /answer", "openbook.generation", f"retrieval {body['index']}"} <= names

    otlp.wait_for(complete)
    root = next(s for s in roots(otlp.spans) if s.service == "openbook-gateway")
    spans = otlp.trace(root.trace_id)
    # One trace, from three processes
    assert {s.service for s in spans} == {
        "openbook-gateway",
        "openbook-retriever",
        "openbook-generator",
    }
    by_name = {(s.service, s.name): s for s in spans}
    by_id = {s.span_id: s for s in spans}

    def span(service: str, name: str):
        assert (service, name) in by_name, sorted(by_name)
        return by_name[(service, name)]

    def under_root(s) -> bool:
        """``s`` descends from the root (FastAPI's own spans, such as ``fastapi.endpoint``,
        may lie between the request's span and the pipeline's)."""
        while s.parent_id:
            s = by_id[s.parent_id]
        return s is root

    assert all(under_root(s) for s in spans)  # no span of the trace is orphaned

    # The gateway: the request (root, with the request id), cache, retrieval, generation
    assert root.name == "POST /answer" and root.kind == "SERVER" and root.parent_id == ""
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["http.route"] == "/answer"
    cache = span("openbook-gateway", "openbook.cache.lookup")
    assert cache.attributes["openbook.cache.hit"] is False
    retrieval = span("openbook-gateway", f"retrieval {body['index']}")
    assert retrieval.kind == "CLIENT" and retrieval.parent_id == cache.parent_id
    assert retrieval.attributes["gen_ai.operation.name"] == "retrieval"
    assert retrieval.attributes["gen_ai.retrieval.top_k"] == 2
    assert retrieval.attributes["gen_ai.data_source.id"] == body["index"]
    assert retrieval.attributes["openbook.retrieval.passages"] == 2
    model = body["model_version"]
    completion = span("openbook-gateway", f"text_completion {model}")
    assert completion.kind == "CLIENT" and completion.parent_id == cache.parent_id
    assert completion.attributes["gen_ai.response.model"] == model
    assert completion.attributes["gen_ai.usage.input_tokens"] > 0
    assert completion.attributes["gen_ai.usage.output_tokens"] > 0

    # The retriever: its RPC continues the gateway's retrieval span (traceparent in metadata)
    rpc = span("openbook-retriever", "openbook.v1.Retriever/Retrieve")
    assert rpc.kind == "SERVER" and rpc.parent_id == retrieval.span_id
    assert rpc.attributes["openbook.request_id"] == request_id
    assert rpc.attributes["rpc.grpc.status_code"] == 0
    search = span("openbook-retriever", f"retrieval {body['index']}")
    assert search.parent_id == rpc.span_id
    assert search.attributes["gen_ai.retrieval.top_k"] == 2
    assert search.attributes["openbook.retrieval.passages"] == 2

    # The generator: its RPC continues the gateway's generation span; admission, queueing and
    # generation are its children
    generate = span("openbook-generator", "openbook.v1.Generator/Generate")
    assert generate.kind == "SERVER" and generate.parent_id == completion.span_id
    assert generate.attributes["openbook.request_id"] == request_id
    for stage in ("openbook.admission", "openbook.queue", "openbook.generation"):
        assert span("openbook-generator", stage).parent_id == generate.span_id
    assert span("openbook-generator", "openbook.admission").attributes["openbook.admitted"]
    generation = span("openbook-generator", "openbook.generation")
    assert generation.attributes["gen_ai.response.model"] == model
    assert (
        generation.attributes["gen_ai.usage.input_tokens"]
        == completion.attributes["gen_ai.usage.input_tokens"]
    )
    assert (
        generation.attributes["gen_ai.usage.output_tokens"]
        == completion.attributes["gen_ai.usage.output_tokens"]
    )
    # Probes are not traced
    assert not [s for s in otlp.spans if "Health" in s.name or s.name.endswith("/healthz")]


def test_a_streamed_answer_is_traced_through_generate_stream(stack, otlp):
    request_id = "trace-me-stream"
    question = {"question": "Who discovered gravity?", "k": 2, "stream": True, "use_cache": False}
    with httpx.stream(
        "POST",
        f"{stack.url}/answer",
        json=question,
        headers={"X-Request-ID": request_id},
        timeout=60,
    ) as reply:
        assert reply.status_code == 200
        events = list(read_events(reply.iter_lines()))
    assert events[-1].event == "answer", events[-1]

    def rpc(spans):
        return [
            s
            for s in spans
            if s.name == "openbook.v1.Generator/GenerateStream"
            and s.attributes.get("openbook.request_id") == request_id
        ]

    def complete(spans):
        """The RPC's generation span, and the request's root (the gateway ends it, and sends
        it, once the stream is written)."""
        found = rpc(spans)
        return (
            bool(found)
            and any(
                s.name == "openbook.generation" and s.parent_id == found[0].span_id for s in spans
            )
            and any(s.trace_id == found[0].trace_id and not s.parent_id for s in spans)
        )

    spans = otlp.wait_for(complete)
    stream_rpc = rpc(spans)[0]
    root = next(s for s in otlp.trace(stream_rpc.trace_id) if not s.parent_id)
    assert root.name == "POST /answer" and root.service == "openbook-gateway"
    generation = next(
        s for s in spans if s.name == "openbook.generation" and s.parent_id == stream_rpc.span_id
    )
    assert generation.attributes["gen_ai.usage.output_tokens"] > 0


@pytest.mark.parametrize(
    ("service", "port", "rpc"),
    [
        ("openbook.v1.Retriever", "retriever", "Retrieve"),
        ("openbook.v1.Generator", "generator", "GenerateStream"),
    ],
)
def test_both_services_answer_grpc_server_reflection(stack, service, port, rpc):
    import grpc
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(f"127.0.0.1:{stack.ports[port]}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {service, "grpc.health.v1.Health"} <= services, services
        # the service's file descriptor (and those it imports), fetched from the server alone
        described = DescriptorPool(database).FindServiceByName(service)
        assert rpc in described.methods_by_name
        assert described.file.package == "openbook.v1"
