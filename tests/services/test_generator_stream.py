"""GenerateStream: greedy tokens as they are decided, then the reply Generate gives; a cancelled
stream leaves the batch at once; bad input fails the stream with INVALID_ARGUMENT naming the
field."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from openbook.v1 import common_pb2, generator_pb2
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import generator_service


def _request(k: int = 3, **options) -> generator_pb2.GenerateRequest:
    return generator_pb2.GenerateRequest(
        question=QUESTION,
        passages=[
            common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score)
            for p in make_passages(k, seed=7)
        ],
        options=generator_pb2.DecodingOptions(**options),
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("stream")
    model = make_tiny_causal_lm(tmp / "llama", arch="llama")
    with generator_service(model, tmp, redis_server.url) as (_, servicer, stub):
        yield servicer, stub


def _split(events):
    tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
    done = [e.done for e in events if e.WhichOneof("event") == "done"]
    assert len(done) == 1 and events[-1].WhichOneof("event") == "done"
    return tokens, done[0]


def test_rag_token_stream_ends_with_the_unary_reply(service):
    _, stub = service
    request = _request(max_new_tokens=10)
    tokens, done = _split(list(stub.GenerateStream(request, timeout=60)))
    unary = stub.Generate(request, timeout=60)
    # the same passages read just before: their prompts' keys/values came from the passage
    # cache (the question's tail did not), so the unary reply reports them as cached
    assert 0 < unary.cached_prompt_tokens < unary.prompt_tokens
    assert done.cached_prompt_tokens <= unary.cached_prompt_tokens
    unary.cached_prompt_tokens = done.cached_prompt_tokens
    assert done == unary
    best = done.hypotheses[0]
    assert [t.token for t in tokens] == [t.token for t in best.tokens]
    for event, final in zip(tokens, best.tokens, strict=True):
        assert not event.HasField("passage")
        assert list(event.doc_posterior) == pytest.approx(list(final.doc_posterior), abs=1e-5)
    assert best.text.startswith("".join(t.text for t in tokens))
    assert best.num_tokens == len(tokens)
    assert best.finish_reason in ("stop", "length")
    assert done.prompt_tokens > 3  # three passage prompts, each more than a token


def test_rag_sequence_streams_per_passage_and_beam_search_only_the_end(service):
    _, stub = service
    tokens, _ = _split(
        list(stub.GenerateStream(_request(mode="rag-sequence-fast", max_new_tokens=5)))
    )
    assert {t.passage for t in tokens} == {0, 1, 2}
    assert all(t.HasField("passage") and not t.doc_posterior for t in tokens)
    tokens, done = _split(list(stub.GenerateStream(_request(num_beams=2, max_new_tokens=5))))
    assert tokens == [] and done.hypotheses


def test_a_seeded_sampled_stream_repeats_and_ends_with_the_unary_reply(service):
    """Sampling over gRPC: the same seed draws the same answer, streamed token by token or
    not; n samples come whole at the end."""
    _, stub = service
    request = _request(max_new_tokens=8, temperature=1.5, top_p=0.95, top_k=50, seed=2**40)
    tokens, done = _split(list(stub.GenerateStream(request, timeout=60)))
    unary = stub.Generate(request, timeout=60)
    assert [h.text for h in done.hypotheses] == [h.text for h in unary.hypotheses]
    assert [t.token for t in tokens] == [t.token for t in done.hypotheses[0].tokens]
    tokens, done = _split(
        list(
            stub.GenerateStream(_request(max_new_tokens=4, temperature=1.0, num_return_sequences=3))
        )
    )
    assert tokens == [] and len(done.hypotheses) == 3


def test_a_length_limited_answer_says_so(service):
    _, stub = service
    reply = stub.Generate(_request(max_new_tokens=4, min_new_tokens=4), timeout=60)
    assert reply.hypotheses[0].num_tokens == 4
    assert reply.hypotheses[0].finish_reason == "length"


def test_a_cancelled_stream_leaves_the_batch(service):
    servicer, stub = service
    drops: list[tuple[str, int]] = []
    original = servicer.scheduler._on_running_drop
    servicer.scheduler._on_running_drop = lambda where, n: drops.append((where, n))
    try:
        call = stub.GenerateStream(_request(max_new_tokens=400, min_new_tokens=400), timeout=120)
        first = next(call)
        assert first.WhichOneof("event") == "token"
        call.cancel()
        deadline = time.monotonic() + 30
        while servicer.scheduler.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servicer.scheduler.running() == 0
        assert ("running", 1) in drops
    finally:
        servicer.scheduler._on_running_drop = original
    # the service goes on answering
    assert stub.Generate(_request(max_new_tokens=3), timeout=60).hypotheses


def test_streams_share_the_batch_with_unary_requests(service):
    servicer, stub = service
    sizes: list[int] = []
    original = servicer.scheduler._on_step
    servicer.scheduler._on_step = lambda size, queued: sizes.append(size)
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def unary():
        start.wait()
        results["unary"] = stub.Generate(_request(k=2, max_new_tokens=30, min_new_tokens=30))

    def streamed():
        start.wait()
        results["stream"] = list(stub.GenerateStream(_request(max_new_tokens=30)))

    threads = [threading.Thread(target=unary), threading.Thread(target=streamed)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        servicer.scheduler._on_step = original
    assert max(sizes) == 2
    _, done = _split(results["stream"])
    _assert_same_reply(done, stub.Generate(_request(max_new_tokens=30), timeout=60))


def _assert_same_reply(got, expected) -> None:
    """Equal tokens and text; probabilities equal up to float32 rounding (a row decoded beside
    another runs padded matrix products, whose sums round differently, ~1e-7 relative)."""

    def same(a, b, where: str) -> None:
        if isinstance(a, float) or isinstance(b, float):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), where
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    same(MessageToDict(got), MessageToDict(expected), "reply")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request(num_beams=0, num_return_sequences=3), "num_return_sequences"),
        (_request(temperature=3.0), "temperature"),
        (_request(temperature=1.0, top_k=-2), "top_k"),
        (generator_pb2.GenerateRequest(question=QUESTION), "passages"),
        (generator_pb2.GenerateRequest(question="", passages=_request().passages), "question"),
    ],
)
def test_bad_input_fails_the_stream_naming_the_field(service, request_, field):
    _, stub = service
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(request_, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
