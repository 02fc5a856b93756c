"""The gateway's edge, attacked over raw sockets as a client on the network would (issue 29).

The gateway runs as users run it: the ``openbook-gateway`` command in a process of its own
(what compose and ``openbook up`` start), in front of the real retriever and generator. Its
request-head timeout is set small (``OPENBOOK_GATEWAY_HEADER_TIMEOUT_S``) so that the tests
wait for the server's own timeout, with generous bounds on the client side.

* slowloris connections (a head sent byte by byte, never finished) are closed after the
  timeout, with a 408; a connection that sends nothing is closed too;
* a 1 MB header and 10,000 headers get a readable 431 (never reaching the app), limits that
  are settings, and heads within them are still answered;
* every malformed body (not UTF-8, nested 10,000 deep, truncated, not sent as JSON) is one
  422 naming ``body`` (under ``/v1`` OpenAI's 400), on every route that takes a body.
"""

from __future__ import annotations

import json
import selectors
import socket
import time

import httpx
import pytest

from openbook_testkit.stack import gateway_process, running_backends

TOKEN = "edge-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADER_COUNT = 100
# How long a client waits for the server to act on its 1 s timeout before failing the test:
# generous, since the machine may be busy.
CLIENT_PATIENCE_S = 60.0


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("edge")
    with running_backends(tmp / "backends", redis_server.url, admin_token=TOKEN) as backends:
        env = {
            **backends.gateway_environment(redis_server.url),
            "OPENBOOK_GATEWAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "OPENBOOK_GATEWAY_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
            "OPENBOOK_GATEWAY_MAX_HEADER_COUNT": str(MAX_HEADER_COUNT),
        }
        with gateway_process(tmp, env) as url:
            yield url


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` whole, then read until the server closes. A connection reset (the
    answer lost) fails the test."""
    with socket.create_connection(_address(url), timeout=CLIENT_PATIENCE_S) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(64 * 1024):
            received += chunk
    return received


def _parse(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def _get(path: str, fields: list[bytes]) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: gateway\r\n%sConnection: close\r\n\r\n" % (
        path.encode(),
        b"".join(field + b"\r\n" for field in fields),
    )


def _many_fields(count: int) -> list[bytes]:
    return [b"X-Field-%d: value" % i for i in range(count)]


# ------------------------------------------------------------------ the head's size


@pytest.mark.parametrize(
    ("fields", "setting"),
    [
        ([b"X-Big: " + b"a" * 1_000_000], "OPENBOOK_GATEWAY_MAX_HEADER_BYTES"),
        (_many_fields(10_000), "OPENBOOK_GATEWAY_MAX_HEADER_COUNT"),
    ],
    ids=["1MB-header", "10000-headers"],
)
def test_oversized_heads_get_a_readable_431(gateway_url, fields, setting):
    status, headers, body = _parse(_exchange(gateway_url, _get("/healthz", fields)))
    assert status == 431, body[:300]
    assert setting in json.loads(body)["detail"]
    assert headers["connection"] == "close"
    assert headers["x-request-id"]


def test_oversized_heads_under_v1_get_openai_errors(gateway_url):
    status, _, body = _parse(_exchange(gateway_url, _get("/v1/models", _many_fields(10_000))))
    assert status == 431
    error = json.loads(body)["error"]
    assert "OPENBOOK_GATEWAY_MAX_HEADER_COUNT" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_large_request_target_counts_toward_the_head(gateway_url):
    status, _, _ = _parse(_exchange(gateway_url, _get("/healthz?" + "q" * 100_000, [])))
    assert status == 431


def test_heads_within_the_limits_are_answered(gateway_url):
    # Host and Connection are two of the fields: the head holds exactly the maximum.
    fields = _many_fields(MAX_HEADER_COUNT - 2)
    status, _, body = _parse(_exchange(gateway_url, _get("/healthz", fields)))
    assert status == 200, body[:300]
    status, _, body = _parse(_exchange(gateway_url, _get("/healthz", [*fields, b"X-One: more"])))
    assert status == 431
    # A single large header well within the byte limit.
    big = [b"X-Big: " + b"a" * (MAX_HEADER_BYTES - 1024)]
    status, _, body = _parse(_exchange(gateway_url, _get("/healthz", big)))
    assert status == 200, body[:300]


def test_the_limits_do_not_count_the_body(gateway_url):
    # A body far larger than the head limit, arriving in the same packets as the head.
    body = json.dumps({"question": "Who wrote Hamlet?", "k": 2, "x": "y" * 40_000}).encode()
    request = (
        b"POST /answer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    status, _, content = _parse(_exchange(gateway_url, request))
    assert status == 422, content[:300]  # the extra field, not the head
    assert "x" in {part for err in json.loads(content)["detail"] for part in err["loc"]}


def _statuses(response: bytes) -> list[int]:
    """The statuses of the responses in ``response``, in order."""
    return [int(part[:3]) for part in response.split(b"HTTP/1.1 ")[1:]]


def test_pipelined_requests_are_answered_in_order_up_to_a_refused_head(gateway_url):
    get = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
    body = json.dumps({"question": "Who wrote Hamlet?", "x": "y" * 30_000}).encode()
    post = (
        b"POST /answer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    closing = _get("/healthz", [])
    assert _statuses(_exchange(gateway_url, get * 4 + post + closing)) == [200] * 4 + [422, 200]
    # The refusal waits for the responses before it, then ends the connection.
    oversized = _get("/healthz", [b"X-Big: " + b"a" * (2 * MAX_HEADER_BYTES)])
    assert _statuses(_exchange(gateway_url, post + oversized + get)) == [422, 431]
    stalled = b"GET /healthz HTTP/1.1\r\nHost: gate"  # and no more: times out
    assert _statuses(_exchange(gateway_url, post + get + stalled)) == [422, 200, 408]


# ------------------------------------------------------------------ the head's time


def test_slowloris_connections_are_closed_after_the_header_timeout(gateway_url):
    """100 connections each sending a head one byte at a time, never finishing it: the server
    closes every one (with a 408 first) while the client would go on forever."""
    head = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Slow: " + b"a" * 1_000_000
    selector = selectors.DefaultSelector()
    sent: dict[socket.socket, int] = {}
    received: dict[socket.socket, bytes] = {}
    for _ in range(100):
        sock = socket.create_connection(_address(gateway_url))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        sent[sock], received[sock] = 0, b""
    open_socks = set(sent)
    # Meanwhile the gateway answers everyone else.
    assert httpx.get(f"{gateway_url}/healthz", timeout=30).status_code == 200
    deadline = time.monotonic() + CLIENT_PATIENCE_S
    while open_socks and time.monotonic() < deadline:
        for sock in list(open_socks):  # one more byte on every connection still open
            try:
                sock.send(head[sent[sock] : sent[sock] + 1])
                sent[sock] += 1
            except OSError:  # closed by the server (after its answer)
                pass
        for key, _ in selector.select(timeout=0.05):
            sock = key.fileobj
            try:
                chunk = sock.recv(4096)
            except OSError:
                chunk = b""
            received[sock] += chunk
            if not chunk:
                open_socks.discard(sock)
                selector.unregister(sock)
    still_open = len(open_socks)
    for sock in sent:
        sock.close()
    assert still_open == 0, f"{still_open} slowloris connections still open"
    answers = [_parse(answer) for answer in received.values() if answer]
    assert answers, "no slowloris connection was answered before being closed"
    assert {status for status, _, _ in answers} == {408}
    assert "OPENBOOK_GATEWAY_HEADER_TIMEOUT_S" in json.loads(answers[0][2])["detail"]


def test_a_connection_that_sends_nothing_is_closed(gateway_url):
    with socket.create_connection(_address(gateway_url), timeout=CLIENT_PATIENCE_S) as sock:
        assert sock.recv(1024) == b""  # closed without an answer: there was no request


def test_a_slow_second_request_on_a_kept_alive_connection_times_out(gateway_url):
    with socket.create_connection(_address(gateway_url), timeout=CLIENT_PATIENCE_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        first = b""
        while b'{"status":"ok"}' not in first:
            first += sock.recv(4096)
        assert _parse(first)[0] == 200
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gate")  # and no more
        second = b""
        while chunk := sock.recv(4096):
            second += chunk
    assert _parse(second)[0] == 408


def test_a_head_sent_slowly_but_within_the_timeout_is_answered(gateway_url):
    head = _get("/healthz", [])
    with socket.create_connection(_address(gateway_url), timeout=CLIENT_PATIENCE_S) as sock:
        sock.sendall(head[:10])
        time.sleep(HEADER_TIMEOUT_S / 4)
        sock.sendall(head[10:])
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert _parse(answer)[0] == 200


# ------------------------------------------------------------------ malformed bodies

NOT_UTF8 = b'{"question": "Who wrote \xff\xfe Hamlet?"}'
DEEP_ARRAY = b"[" * 10_000 + b"]" * 10_000
# 60 KB: within the body limit (64 KiB)
DEEP_FIELD = b'{"question": "q", "x": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}"
TRUNCATED = b'{"question": "Who wrote Hamlet?"'
MALFORMED = {
    "not-utf8": (NOT_UTF8, "application/json", "not UTF-8"),
    "deep-array": (DEEP_ARRAY, "application/json", "nested too deeply"),
    "deep-field": (DEEP_FIELD, "application/json", "nested too deeply"),
    "truncated": (TRUNCATED, "application/json", "JSON decode error"),
    "text-plain": (b'{"question": "q"}', "text/plain", "content-type"),
    "form": (b"question=q", "application/x-www-form-urlencoded", "content-type"),
}
BODY_ROUTES = ("/answer", "/admin/swap-index", "/admin/reload-model")


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_bodies_are_one_422_naming_the_body(gateway_url, route, case):
    body, content_type, says = MALFORMED[case]
    reply = httpx.post(
        f"{gateway_url}{route}",
        content=body,
        headers={"content-type": content_type, **AUTH},
        timeout=30,
    )
    assert reply.status_code == 422, reply.text[:300]
    [error] = reply.json()["detail"]
    assert error["loc"][0] == "body"
    assert says in error["msg"]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_bodies_under_v1_are_openai_400s(gateway_url, case):
    body, content_type, says = MALFORMED[case]
    reply = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        content=body,
        headers={"content-type": content_type},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert error["message"].startswith("body: ")
    assert says in error["message"]


def test_json_in_other_unicode_encodings_is_still_read(gateway_url):
    # RFC 8259 asks for UTF-8, but a UTF-8 BOM or UTF-16 is read as Python's json reads it.
    question = {"question": "Who wrote Hamlet?", "k": 2}
    for body in (
        b"\xef\xbb\xbf" + json.dumps(question).encode(),
        json.dumps(question).encode("utf-16"),
    ):
        reply = httpx.post(
            f"{gateway_url}/answer",
            content=body,
            headers={"content-type": "application/json; charset=utf-8"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text[:300]


def _refusals(url: str) -> dict[str, float]:
    """The gateway's count of requests refused while their head was read, by status."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("openbook_gateway_requests_total{") and (
            'route="(request head)"' in line
        ):
            status = line.split('status="')[1].split('"')[0]
            counts[status] = float(line.rsplit(" ", 1)[1])
    return counts


def test_refused_heads_are_counted_in_the_metrics(gateway_url):
    """A 431 or 408 never reaches the app, so the app's request counter cannot see it: the
    server counts it under the route "(request head)", so a flood of them shows on a
    dashboard."""
    before = _refusals(gateway_url)
    _exchange(gateway_url, _get("/healthz", _many_fields(10_000)))
    with socket.create_connection(_address(gateway_url), timeout=CLIENT_PATIENCE_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gate")  # never finished: a 408
        while sock.recv(4096):
            pass
    after = _refusals(gateway_url)
    assert after.get("431", 0) == before.get("431", 0) + 1, after
    assert after.get("408", 0) == before.get("408", 0) + 1, after
