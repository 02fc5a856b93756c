"""The generator service batches continuously: concurrent gRPC requests with different k, modes
and lengths decode together (requests join the running batch between steps) and each gets the
answer it gets alone; the passage-cache setting reaches the model."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage
from openbook.v1 import common_pb2, generator_pb2
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import generator_service

REQUESTS = [
    (QUESTION, 3, dict(max_new_tokens=12, min_new_tokens=12)),
    ("Who wrote Hamlet?", 2, dict(max_new_tokens=3)),
    ("Where is the tower?", 5, dict(num_beams=2, max_new_tokens=6)),
    (QUESTION, 1, dict(mode="rag-sequence-thorough", num_beams=2, max_new_tokens=4)),
    ("Who wrote Hamlet?", 4, dict(mode="rag-sequence-fast", max_new_tokens=8)),
    (QUESTION, 2, dict(max_new_tokens=5)),
]


def _proto(question: str, passages: list[Passage], options: dict) -> generator_pb2.GenerateRequest:
    return generator_pb2.GenerateRequest(
        question=question,
        passages=[
            common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score) for p in passages
        ],
        options=generator_pb2.DecodingOptions(**options),
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("engine")
    model = make_tiny_causal_lm(tmp / "gemma", arch="gemma3")
    with generator_service(model, tmp, redis_server.url, passage_cache_mb=0) as running:
        yield running


def test_concurrent_requests_decode_together_with_their_lone_answers(service):
    settings, servicer, stub = service
    assert not servicer.generator.backend.passage_cache.enabled  # the setting reached it
    sizes: list[int] = []
    original = servicer.scheduler._on_step
    servicer.scheduler._on_step = lambda size, queued: sizes.append(size)
    requests = [(q, make_passages(k, seed), o) for seed, (q, k, o) in enumerate(REQUESTS)]
    start = threading.Barrier(len(requests))

    def call(request):
        start.wait()
        return stub.Generate(_proto(*request), timeout=120)

    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            replies = list(pool.map(call, requests))
    finally:
        servicer.scheduler._on_step = original
    assert max(sizes) > 1  # requests shared decoding steps
    reference = RagGenerator.load(settings.model)
    for (q, ps, o), reply in zip(requests, replies, strict=True):
        alone = reference.generate(q, ps, DecodingOptions(**o))
        assert [h.text for h in reply.hypotheses] == [h.text for h in alone.hypotheses]
        for got, want in zip(reply.hypotheses, alone.hypotheses, strict=True):
            assert got.log_prob == pytest.approx(want.log_prob, abs=1e-4)


@pytest.mark.parametrize("mode", ["rag-token", "rag-sequence-fast"])
def test_an_answer_complete_at_its_first_token_is_returned(service, mode):
    """A request whose search ends at admission (one new token) never joins the batch: the
    scheduler still returns it at its next step."""
    _, _, stub = service
    request = _proto(QUESTION, make_passages(2), dict(mode=mode, max_new_tokens=1))
    reply = stub.Generate(request, timeout=30)
    assert len(reply.hypotheses) == 1
