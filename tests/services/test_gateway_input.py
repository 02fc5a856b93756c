"""Client input the gateway must refuse cleanly (issue 14: no 5xx from any client input).

Bad JSON bodies are a 422 naming the field, rendered as strict JSON even when the client sent
NaN or Infinity; bodies over OPENBOOK_GATEWAY_MAX_BODY_BYTES are a 413 the client can read, over a
real socket, however the body is sent. The gateway runs under uvicorn on 127.0.0.1 in front
of the real retriever and generator, so the requests that must still be answered are.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from starlette.exceptions import HTTPException

from openbook_gateway.cache import ANSWER_PARAMS, SAMPLING_PARAMS, answer_params
from openbook_gateway.middleware import BodySizeLimit
from openbook_gateway.schemas import AnswerRequest
from openbook_testkit.stack import running_backends, serving_gateway

TOKEN = "input-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
MAX_BODY_BYTES = 64 * 1024
FIVE_MB = 5 * 1024 * 1024
LIMIT_TEXT = f"{MAX_BODY_BYTES} bytes (OPENBOOK_GATEWAY_MAX_BODY_BYTES)"

INT_FIELDS = ("k", "num_beams", "max_new_tokens", "min_new_tokens", "num_return_sequences")
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400")  # 1e400 reads as inf


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, redis_server):
    with running_backends(tmp_path_factory.mktemp("backends"), redis_server.url) as backends:
        settings = backends.gateway_settings(
            redis_server.url, admin_token=TOKEN, max_body_bytes=MAX_BODY_BYTES
        )
        with serving_gateway(settings) as url:
            yield url


def _strict_json(text: str):
    """Parse ``text`` as JSON that has no NaN or Infinity, which many clients cannot read."""

    def refuse(constant: str):
        raise AssertionError(f"response holds the non-JSON number {constant}")

    return json.loads(text, parse_constant=refuse)


def _fields_named(body: dict) -> set[str]:
    return {str(part) for error in body["detail"] for part in error["loc"]}


# (path, raw JSON body, the field the 422 must name)
BAD_BODIES = [
    *[
        ("/answer", f'{{"question": "q", "{field}": {value}}}', field)
        for field in (*INT_FIELDS, "length_penalty")
        for value in NON_FINITE
    ],
    ("/answer", '{"question": "q", "k": "5"}', "k"),
    ("/answer", '{"question": "q", "k": true}', "k"),
    ("/answer", '{"question": "q", "k": false}', "k"),
    ("/answer", '{"question": "q", "k": 5.0}', "k"),
    ("/answer", '{"question": "q", "k": 1' + "0" * 4299 + "}", "k"),  # 4300 digits: parses
    ("/answer", '{"question": "q", "num_beams": "2"}', "num_beams"),
    ("/answer", '{"question": "q", "max_new_tokens": 32.0}', "max_new_tokens"),
    ("/answer", '{"question": "q", "min_new_tokens": true}', "min_new_tokens"),
    ("/answer", '{"question": "q", "num_return_sequences": "1"}', "num_return_sequences"),
    ("/answer", '{"question": "q", "length_penalty": "1.0"}', "length_penalty"),
    ("/answer", '{"question": "q", "length_penalty": true}', "length_penalty"),
    ("/answer", '{"question": "q", "use_cache": "yes"}', "use_cache"),
    ("/answer", '{"question": "q", "use_cache": "true"}', "use_cache"),
    ("/answer", '{"question": "q", "use_cache": 1}', "use_cache"),
    ("/answer", '{"question": "q", "use_cache": null}', "use_cache"),
    ("/answer", '{"question": "q", "decoding": 1}', "decoding"),
    # sampling: temperature in [0, 2], top_p in (0, 1], top_k >= 0, seed a 64-bit integer
    ("/answer", '{"question": "q", "temperature": -0.5}', "temperature"),
    ("/answer", '{"question": "q", "temperature": 2.5}', "temperature"),
    ("/answer", '{"question": "q", "temperature": NaN}', "temperature"),
    ("/answer", '{"question": "q", "temperature": "1"}', "temperature"),
    ("/answer", '{"question": "q", "temperature": 1, "top_p": 0}', "top_p"),
    ("/answer", '{"question": "q", "temperature": 1, "top_p": 1.5}', "top_p"),
    ("/answer", '{"question": "q", "temperature": 1, "top_k": -1}', "top_k"),
    ("/answer", '{"question": "q", "temperature": 1, "top_k": 2.0}', "top_k"),
    ("/answer", '{"question": "q", "temperature": 1, "seed": 1e30}', "seed"),
    ("/answer", '{"question": "q", "temperature": 1, "seed": 9223372036854775808}', "seed"),
    ("/answer", '{"question": "q", "index": 5}', "index"),
    ("/answer", '{"question": "q", "unknown": NaN}', "unknown"),
    ("/answer", '{"question": 5}', "question"),
    ("/answer", '{"question": true}', "question"),
    ("/answer", '{"question": NaN}', "question"),
    ("/answer", '{"question": "\\u0000"}', "question"),
    ("/answer", '{"question": "\\u0000\\u0000\\u0000"}', "question"),
    ("/answer", '{"question": " \\t\\u0001\\n\\u001f\\r "}', "question"),
    ("/answer", '{"question": "\\u200b\\u00a0"}', "question"),  # zero-width and no-break space
    ("/answer", '{"question": "Who wrote\\u0000Hamlet?"}', "question"),
    ("/answer", '{"question": "Who wrote Hamlet?\\u0000"}', "question"),
    ("/answer", '{"question": "Who \\u001b[31mwrote Hamlet?"}', "question"),
    ("/answer", '{"question": "Who wrote\\u0085Hamlet?"}', "question"),
    ("/admin/swap-index", '{"index": NaN}', "index"),
    ("/admin/swap-index", '{"index": 5}', "index"),
    ("/admin/swap-index", '{"index": true}', "index"),
    ("/admin/swap-index", '{"index": "facts-a", "extra": Infinity}', "extra"),
    ("/admin/reload-model", '{"checkpoint": NaN}', "checkpoint"),
    ("/admin/reload-model", '{"checkpoint": 1e400}', "checkpoint"),
    ("/admin/reload-model", '{"checkpoint": 5}', "checkpoint"),
    ("/admin/reload-model", '{"checkpoint": false}', "checkpoint"),
    ("/admin/reload-model", '{"checkpoint": "/ckpt\\u0000/x"}', "checkpoint"),
    ("/admin/reload-model", '{"checkpoint": "/ckpt/\\u0007"}', "checkpoint"),
    ("/admin/reload-model", '{"path": -Infinity}', "path"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_bad_bodies_are_422_naming_the_field(gateway_url, path, body, field):
    reply = httpx.post(
        f"{gateway_url}{path}", content=body.encode(), headers={**JSON, **AUTH}, timeout=30
    )
    assert reply.status_code == 422, reply.text
    assert field in _fields_named(_strict_json(reply.text)), reply.text


@pytest.mark.parametrize(
    ("question", "says"),
    [
        ("\x00", "blank"),
        ("Who wrote\x00Hamlet?", "NUL characters (U+0000 at index 9)"),
        ("Who \x1b[31mwrote?", "control characters (U+001B at index 4"),
    ],
)
def test_question_errors_say_what_is_wrong(gateway_url, question, says):
    reply = httpx.post(f"{gateway_url}/answer", json={"question": question}, timeout=30)
    assert reply.status_code == 422, reply.text
    assert says in " ".join(error["msg"] for error in reply.json()["detail"])


def test_sampling_with_beams_is_a_422_naming_num_beams(gateway_url):
    body = {"question": "q", "temperature": 0.7, "num_beams": 3}
    reply = httpx.post(f"{gateway_url}/answer", json=body, timeout=30)
    assert reply.status_code == 422, reply.text
    (error,) = reply.json()["detail"]
    assert error["msg"].removeprefix("Value error, ").startswith("num_beams must be 1")


def test_sampled_answers_are_cached_only_with_their_seed(gateway_url):
    """A seeded sample is the same answer every time: cached under its parameters and seed. An
    unseeded one must be drawn anew: never served from the cache."""
    ask = {"question": "Who wrote Hamlet?", "k": 3, "max_new_tokens": 6, "temperature": 1.5}

    def answer(**more) -> dict:
        reply = httpx.post(f"{gateway_url}/answer", json={**ask, **more}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()

    seeded = [answer(seed=12345, num_return_sequences=3) for _ in range(2)]
    assert [a["cached"] for a in seeded] == [False, True]
    fresh = answer(seed=12345, num_return_sequences=3, use_cache=False)
    texts = [[h["text"] for h in a["hypotheses"]] for a in (*seeded, fresh)]
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) == 3
    other = answer(seed=12346, num_return_sequences=3)
    assert not other["cached"]
    assert not any(answer()["cached"] for _ in range(2))


def test_non_finite_input_is_echoed_as_strings(gateway_url):
    reply = httpx.post(
        f"{gateway_url}/answer", content=b'{"question": "q", "k": 1e400}', headers=JSON, timeout=30
    )
    assert reply.status_code == 422
    assert _strict_json(reply.text)["detail"][0]["input"] == "Infinity"


@pytest.mark.parametrize(
    "body",
    [
        # An int is a fine float; tab, newline and carriage return are fine in a question.
        {"question": "Who wrote\tHamlet?\r\n", "k": 2, "length_penalty": 1},
        {"question": "Who wrote Hamlet?", "k": 2, "length_penalty": -2.5, "use_cache": False},
    ],
)
def test_well_typed_bodies_are_still_answered(gateway_url, body):
    reply = httpx.post(f"{gateway_url}/answer", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["answer"] is not None


def test_deeply_nested_bodies_are_always_a_422(gateway_url):
    # Around the depth where Python's json gives up, the echoed input is nested too deep for
    # the 422 to repeat, or too deep to parse at all: the gateway must still answer 422.
    statuses = set()
    with httpx.Client(base_url=gateway_url, headers=JSON, timeout=30) as client:
        for depth in range(880, 1010, 2):
            for body in (
                "[" * depth + "]" * depth,
                "[" * depth + "NaN" + "]" * depth,
                '{"question": "q", "x": ' + '{"a": ' * depth + "1" + "}" * depth + "}",
            ):
                reply = client.post("/answer", content=body.encode())
                assert reply.status_code < 500, f"depth {depth}: {reply.text[:200]}"
                statuses.add(reply.status_code)
    assert statuses == {422}


# ------------------------------------------------------------------ bodies over the limit


def _big_body(size: int = FIVE_MB) -> bytes:
    return b'{"question": "' + b"x" * size + b'"}'


def _chunked(data: bytes, size: int = 64 * 1024) -> bytes:
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def _raw_exchange(url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` and ``body`` over a plain socket, read until the server closes; return
    the status, headers and body of the answer. A connection reset fails the test."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        received = b""
        while chunk := sock.recv(64 * 1024):
            received += chunk
    status_and_headers, _, content = received.partition(b"\r\n\r\n")
    status_line, *header_lines = status_and_headers.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, content


def _assert_readable_413(status: int, headers: dict[str, str], content: bytes) -> None:
    assert status == 413, content[:300]
    assert LIMIT_TEXT in json.loads(content)["detail"]
    assert headers["x-request-id"]


def test_5mb_declared_body_is_a_readable_413_over_a_raw_socket(gateway_url):
    big = _big_body()
    head = (
        b"POST /answer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(big)
    )
    _assert_readable_413(*_raw_exchange(gateway_url, head, big))


def test_5mb_chunked_body_is_a_readable_413_over_a_raw_socket(gateway_url):
    head = (
        b"POST /answer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    _assert_readable_413(*_raw_exchange(gateway_url, head, _chunked(_big_body())))


def test_expect_continue_gets_the_413_without_sending_the_body(gateway_url):
    head = (
        b"POST /answer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % FIVE_MB
    )
    status, headers, content = _raw_exchange(gateway_url, head, b"")
    _assert_readable_413(status, headers, content)  # a 100 Continue first would fail here


def test_5mb_bodies_are_a_readable_413_with_httpx(gateway_url):
    big = _big_body()
    with httpx.Client(base_url=gateway_url, headers=JSON, timeout=30) as client:
        declared = client.post("/answer", content=big)
        streamed = client.post(
            "/answer", content=(big[i : i + 64 * 1024] for i in range(0, len(big), 64 * 1024))
        )
        for reply in (declared, streamed):
            assert reply.status_code == 413, reply.text[:300]
            assert LIMIT_TEXT in reply.json()["detail"]
        # The refused bodies leave nothing behind: the next request is answered.
        within = client.post("/answer", json={"question": "Who wrote Hamlet?", "k": 2})
        assert within.status_code == 200, within.text


# ------------------------------------------------------------------ the drain stops at its cap


def _run_limit(declared: int | None, chunks: int, drain_max_bytes: int) -> tuple[int, int]:
    """Drive BodySizeLimit with a client sending ``chunks`` chunks of 64 KiB; return the status
    it answered and how many chunks it read."""
    chunk = b"x" * (64 * 1024)
    read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:  # reads the whole body, as FastAPI does
        while (await receive()).get("more_body"):
            pass
        raise AssertionError("the app must not get a body over the limit")

    async def run() -> None:
        headers = [(b"content-length", str(declared).encode())] if declared is not None else []
        scope = {"type": "http", "method": "POST", "path": "/answer", "headers": headers}
        limit = BodySizeLimit(app, max_bytes=1024, drain_max_bytes=drain_max_bytes)
        try:
            await limit(scope, receive, send)
        except HTTPException as err:  # streamed: FastAPI turns it into the 413 response
            sent.append({"type": "http.response.start", "status": err.status_code})

    asyncio.run(run())
    return sent[0]["status"], read


def test_drain_reads_the_rest_of_the_body_up_to_its_cap():
    mib = 1024 * 1024
    # Within the cap: the whole body is read before answering, declared or streamed.
    assert _run_limit(declared=80 * 64 * 1024, chunks=80, drain_max_bytes=16 * mib) == (413, 80)
    assert _run_limit(declared=None, chunks=80, drain_max_bytes=16 * mib) == (413, 80)
    # Past the cap: a declared body is not read at all, a streamed one only up to the cap.
    assert _run_limit(declared=10**12, chunks=10**9, drain_max_bytes=mib) == (413, 0)
    status, read = _run_limit(declared=None, chunks=10**9, drain_max_bytes=mib)
    assert status == 413
    assert read == mib // (64 * 1024) + 1


def test_cache_keys_hold_sampling_params_only_when_sampling():
    """Greedy keys stay those of before sampling (top_p, top_k and seed change nothing at
    temperature 0); a sample's key holds all four, and only a seeded sample is cacheable."""
    greedy = AnswerRequest(question="q", top_p=0.5, top_k=3, seed=1)
    assert set(answer_params(greedy, 3)) == {*ANSWER_PARAMS}
    assert greedy.cacheable
    seeded = AnswerRequest(question="q", temperature=0.7, seed=1)
    assert answer_params(seeded, 3)["seed"] == 1
    assert set(answer_params(seeded, 3)) == {*ANSWER_PARAMS, *SAMPLING_PARAMS}
    assert seeded.cacheable
    assert not AnswerRequest(question="q", temperature=0.7).cacheable
