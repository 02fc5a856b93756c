"""A request is validated once per boundary, against one set of limits
(``openbook.validation.limits``): what the gateway accepts the retriever and generator accept, and
what it refuses they refuse, each naming the field. Only a client's mistake is a 4xx /
INVALID_ARGUMENT: a plain ``ValueError`` (or anything else) escaping a service is INTERNAL, and the
gateway's 500 names the request id."""

from __future__ import annotations

import re

import grpc
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from openbook.errors import InvalidArgument, NotFound, status_for
from openbook.rag import DecodingOptions
from openbook.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from openbook.validation import limits
from openbook_gateway.app import create_app
from openbook_gateway.retrieval import Retrieval
from openbook_gateway.routes.pages import STATIC_DIR
from openbook_gateway.schemas import AnswerRequest
from openbook_gateway.settings import GatewaySettings
from openbook_generator.servicer import validate_generate
from openbook_retriever.servicer import validate_retrieve
from openbook_testkit.stack import running_backends

TOKEN = "validation-token"
QUESTIONS = [
    "Who wrote Hamlet?",
    "Who wrote\tHamlet?\r\n",
    "x" * limits.MAX_QUESTION_CHARS,
    "x" * (limits.MAX_QUESTION_CHARS + 1),
    "",
    "   ",
    "\u200b\u00a0",
    "\x00",
    "Who wrote\x00Hamlet?",
    "Who \x1b[31mwrote?",
    "Who wrote\x85Hamlet?",
]


def _gateway_accepts(**fields) -> bool:
    try:
        AnswerRequest(**fields)
    except ValidationError:
        return False
    return True


def _retriever_accepts(**fields) -> bool:
    try:
        validate_retrieve(retriever_pb2.RetrieveRequest(**fields))
    except InvalidArgument:
        return False
    return True


def _generate_request(question: str = "q", k: int = 1, **options) -> generator_pb2.GenerateRequest:
    return generator_pb2.GenerateRequest(
        question=question,
        passages=[common_pb2.Passage(id=str(i), title="t", text="x", score=1.0) for i in range(k)],
        options=generator_pb2.DecodingOptions(**options),
    )


def _generator_accepts(question: str = "q", k: int = 1, **options) -> bool:
    try:
        validate_generate(_generate_request(question, k, **options))
    except InvalidArgument:
        return False
    return True


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_question_is_accepted_alike_at_every_boundary(question):
    gateway = _gateway_accepts(question=question)
    assert _retriever_accepts(queries=[question], k=1) == gateway
    assert _generator_accepts(question) == gateway


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_beams": limits.MAX_BEAMS, "num_return_sequences": limits.MAX_BEAMS}, None),
        ({"num_beams": limits.MAX_BEAMS + 1}, "num_beams"),
        ({"max_new_tokens": limits.MAX_NEW_TOKENS}, None),
        ({"max_new_tokens": limits.MAX_NEW_TOKENS + 1}, "max_new_tokens"),
        ({"max_new_tokens": 8, "min_new_tokens": 9}, "min_new_tokens"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"length_penalty": limits.MAX_LENGTH_PENALTY}, None),
        ({"length_penalty": limits.MAX_LENGTH_PENALTY + 1}, "length_penalty"),
        ({"length_penalty": limits.MIN_LENGTH_PENALTY - 1}, "length_penalty"),
        *[({"mode": mode}, None) for mode in limits.DECODING_MODES],
        ({"mode": "nucleus"}, "mode"),
        # sampling: one rule at the three boundaries
        ({"temperature": limits.MAX_TEMPERATURE, "top_p": 0.5, "top_k": 40, "seed": -1}, None),
        ({"temperature": 0.7, "num_return_sequences": limits.MAX_RETURN_SEQUENCES}, None),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": limits.MAX_TEMPERATURE + 0.5}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "num_beams": 2}, "num_beams"),
    ],
)
def test_the_generator_enforces_the_gateways_decoding_limits(options, field):
    body = {("decoding" if key == "mode" else key): value for key, value in options.items()}
    assert _gateway_accepts(question="q", **body) == (field is None)
    library = DecodingOptions(**options)  # RagGenerator's direct callers: the same rules
    if field is None:
        validate_generate(_generate_request("q", **options))
        library.validate()
    else:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            validate_generate(_generate_request("q", **options))
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            library.validate()


@pytest.mark.parametrize(("k", "ok"), [(1, True), (limits.MAX_K, True), (limits.MAX_K + 1, False)])
def test_k_is_bounded_alike_at_every_boundary(k, ok):
    assert _gateway_accepts(question="q", k=k) == ok
    assert _retriever_accepts(queries=["q"], k=k) == ok
    assert _generator_accepts("q", k) == ok  # the k passages retrieved


def test_passages_are_checked_by_the_generator():
    with pytest.raises(InvalidArgument, match="^passages"):
        validate_generate(_generate_request("q", 0))
    with pytest.raises(InvalidArgument, match="^passages"):
        validate_generate(_generate_request("q", limits.MAX_K + 1))
    with pytest.raises(InvalidArgument, match=r"^passages\[0\].score"):
        validate_generate(
            generator_pb2.GenerateRequest(
                question="q", passages=[common_pb2.Passage(text="x", score=float("nan"))]
            )
        )


def test_the_caller_a_generate_request_names_is_checked_by_the_generator():
    # who asks (the gateway's key name: the generator's fair share), bounded and printable
    request = _generate_request()
    request.caller = "tenant-a"
    assert validate_generate(request).caller == "tenant-a"
    assert validate_generate(_generate_request()).caller == ""  # anonymous
    for bad in ("x" * (limits.MAX_CALLER_CHARS + 1), "a\x00b", "a\nb"):
        request.caller = bad
        with pytest.raises(InvalidArgument, match="^caller"):
            validate_generate(request)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("facts-a", True),
        ("wiki_2018.v2", True),
        ("../etc", False),
        (".hidden", False),
        ("a/b", False),
        ("x" * 129, False),
        # re.match with "$" lets a trailing newline through: every check is a full match.
        ("facts-a\n", False),
        ("facts-a\r\n", False),
        ("facts-a\x00", False),
        ("fac\x1bts-a", False),
        ("\nfacts-a", False),
    ],
)
def test_index_names_follow_one_rule(name, ok):
    assert _gateway_accepts(question="q", index=name) == ok
    assert _retriever_accepts(queries=["q"], k=1, index=name) == ok


def test_the_http_schema_and_the_web_page_state_the_shared_limits():
    schema = create_app(GatewaySettings()).openapi()["components"]["schemas"]["AnswerRequest"]
    props = schema["properties"]
    assert props["question"]["maxLength"] == limits.MAX_QUESTION_CHARS
    assert props["k"]["anyOf"][0]["maximum"] == limits.MAX_K
    assert props["num_beams"]["maximum"] == limits.MAX_BEAMS
    assert props["max_new_tokens"]["maximum"] == limits.MAX_NEW_TOKENS
    assert props["decoding"]["enum"] == list(limits.DECODING_MODES)
    assert props["index"]["anyOf"][0]["pattern"] == limits.INDEX_NAME_PATTERN
    page = (STATIC_DIR / "index.html").read_text()
    assert f'maxlength="{limits.MAX_QUESTION_CHARS}"' in page
    assert re.search(rf'id="k"[^>]*max="{limits.MAX_K}"', page)
    assert re.search(rf'id="num-beams"[^>]*max="{limits.MAX_BEAMS}"', page)
    assert re.search(rf'id="max-new-tokens"[^>]*max="{limits.MAX_NEW_TOKENS}"', page)
    assert props["retrieval"]["anyOf"][0]["enum"] == list(limits.RETRIEVAL_MODES)

    def options(select: str) -> list[str]:
        block = re.search(rf'<select id="{select}".*?</select>', page, re.S)
        assert block, select
        return re.findall(r'<option value="([^"]*)"', block.group(0))

    assert set(options("decoding")) == set(limits.DECODING_MODES)
    # "": the index's default
    assert options("retrieval") == ["", *limits.RETRIEVAL_MODES]


@pytest.mark.parametrize(
    ("mode", "ok"),
    [("dense", True), ("bm25", True), ("hybrid", True), ("sparse", False), ("Dense", False)],
)
def test_retrieval_modes_follow_one_rule(mode, ok):
    assert _gateway_accepts(question="q", retrieval=mode) == ok
    assert _retriever_accepts(queries=["q"], k=1, retrieval=mode) == ok


def test_only_client_mistakes_map_to_a_client_status():
    from openbook.index import IndexLoadError
    from openbook.storage.checkpoint import CheckpointError

    assert status_for(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    # Refused checkpoints and indexes a request named (declared by the servicers).
    assert status_for(CheckpointError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(IndexLoadError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    # Everything else is a bug: a library's ValueError that got past a boundary included.
    for exc in (ValueError("x"), KeyError("x"), TimeoutError(), TypeError()):
        assert status_for(exc) == grpc.StatusCode.INTERNAL, exc


# ------------------------------------------------------------------ over the wire


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    with running_backends(
        tmp_path_factory.mktemp("validation"), redis_server.url, admin_token=TOKEN
    ) as running:
        yield running


@pytest.fixture
def client(backends, redis_url):
    with TestClient(create_app(backends.gateway_settings(redis_url, admin_token=TOKEN))) as c:
        yield c


def test_a_value_error_inside_the_generator_is_internal_not_invalid_argument(
    backends, monkeypatch, client
):
    def broken(*args, **kwargs):
        raise ValueError("a bug deep inside")

    # a decoding step fails: every request of the running batch fails with it
    monkeypatch.setattr(backends.generator_servicer.generator.backend, "step", broken)
    with grpc.insecure_channel(f"127.0.0.1:{backends.generator_port}") as channel:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(_generate_request("Who wrote Hamlet?", 2), timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        # A client's mistake is still refused at the boundary, naming the field.
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(_generate_request("Who wrote Hamlet?", 2, num_beams=99), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("num_beams")
    reply = client.post(
        "/answer",
        json={"question": "Who wrote Hamlet?", "use_cache": False},
        headers={"X-Request-ID": "req-bug-1"},
    )
    assert reply.status_code == 500, reply.text
    assert reply.json() == {"detail": "internal error in the generator", "request_id": "req-bug-1"}
    assert reply.headers["x-request-id"] == "req-bug-1"


def test_a_value_error_inside_the_retriever_is_internal_not_invalid_argument(backends, monkeypatch):
    from openbook.index import LoadedIndex

    def broken(self, *args, **kwargs):
        raise ValueError("a bug deep inside")

    # every mode searches through search (dense by the batch's query vectors)
    monkeypatch.setattr(LoadedIndex, "search", broken)
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Retrieve(retriever_pb2.RetrieveRequest(queries=["q"], k=2), timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        for request, field in [
            (retriever_pb2.RetrieveRequest(queries=["q"], k=2, index="../x"), "index"),
            (retriever_pb2.RetrieveRequest(queries=["q\x00"], k=2), "queries[0]"),
            (retriever_pb2.RetrieveRequest(queries=["x" * 2001], k=2), "queries[0]"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Retrieve(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(field)


def test_an_unexpected_failure_in_the_gateway_is_a_500_naming_the_request_id(client, monkeypatch):
    async def broken(self, *args, **kwargs):
        raise ValueError("a bug in the gateway")

    monkeypatch.setattr(Retrieval, "retrieve", broken)
    reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "use_cache": False})
    assert reply.status_code == 500, reply.text
    body = reply.json()
    assert body == {"detail": "internal error", "request_id": reply.headers["x-request-id"]}
    assert "a bug" not in reply.text  # never the exception's text or a stack trace
    # The same request, well-formed, with a client's mistake is still a 422 naming the field.
    reply = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 0})
    assert reply.status_code == 422
