"""What the generator's speed model is told, and what admission plans, through the service
(openbook_generator/speed.py, policy.py): work is counted as the work it is. Prompt tokens whose
keys/values the passage cache gives are neither counted as prefilled (they made the prefill
look several times faster than it is for new passages, and admission then planned those too
short) nor planned as work."""

from __future__ import annotations

import pytest

from openbook.rag import DecodingOptions
from openbook.v1 import common_pb2, generator_pb2
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import generator_service


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("speed_accounting")
    model = make_tiny_causal_lm(tmp / "gemma3")
    with generator_service(model, tmp, redis_server.url, passage_cache_mb=64) as running:
        yield running


def _request(question: str, seed: int) -> generator_pb2.GenerateRequest:
    return generator_pb2.GenerateRequest(
        question=question,
        passages=[
            common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score)
            for p in make_passages(4, seed=seed)
        ],
        options=generator_pb2.DecodingOptions(max_new_tokens=3),
    )


def test_prefill_observations_count_only_the_tokens_computed(service, monkeypatch):
    _, servicer, stub = service
    backend = servicer.generator.backend
    assert backend.passage_cache.enabled
    speed = servicer.scheduler.speed
    observed: list[float] = []
    observe_prefill = speed.observe_prefill

    def recording(tokens: float, seconds: float) -> None:
        observed.append(tokens)
        observe_prefill(tokens, seconds)

    monkeypatch.setattr(speed, "observe_prefill", recording)
    passages = make_passages(4, seed=11)
    prompts = [backend.prompt_ids(QUESTION, p) for p in passages]
    heads = sum(backend.head_length(p, ids) for p, ids in zip(passages, prompts, strict=True))
    assert heads > 0

    options = DecodingOptions(max_new_tokens=3)
    before = servicer.item(QUESTION, passages, options).shape
    assert before.cached_tokens == 0 and before.input_tokens == sum(len(i) for i in prompts)
    stub.Generate(_request(QUESTION, seed=11), timeout=60)  # new passages: every token computed
    cold = sum(observed)
    observed.clear()
    after = servicer.item(QUESTION, passages, options).shape
    assert after.cached_tokens == heads  # admission plans only the question's tails
    stub.Generate(_request(QUESTION, seed=11), timeout=60)  # the same: their heads reused
    warm = sum(observed)
    assert cold == pytest.approx(before.input_tokens, rel=0.01)
    assert warm == pytest.approx(cold - heads, rel=0.01)
    # and the plan of a request whose passages are cached is the smaller by their prefill
    policy = servicer.scheduler.policy
    assert policy.work_s(after, options, after.rows, 0) < policy.work_s(before, options, 4, 0)
