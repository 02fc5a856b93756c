"""Honest under pressure, on a generator made slow on purpose (openbook_testkit.throttle):

* admission by measured speed: work that cannot finish before its deadline is refused at once
  (RESOURCE_EXHAUSTED with a retry-after that reflects the wait, or OUT_OF_RANGE when it could
  not finish even alone), and what is admitted finishes before its deadline;
* fair scheduling: a large request's prefill is chunked and its rows decode in a batch of their
  own, and a small request that arrives meanwhile runs first (least attained service), instead
  of waiting behind the large one.

The service is the one ``openbook serve generator`` builds (tiny BART), called over gRPC.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from openbook.serving.grpc_server import RETRY_AFTER_TRAILER
from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from openbook_generator.server import build as build_generator
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.throttle import Throttle, throttled


def _request(
    k: int, new_tokens: int, beams: int = 1, words: int = 3
) -> generator_pb2.GenerateRequest:
    text = " ".join(["passage about Paris"] * (words // 3))
    passages = [
        common_pb2.Passage(id=str(i), title=f"t{i}", text=f"{i} {text}", score=1) for i in range(k)
    ]
    return generator_pb2.GenerateRequest(
        question="where is paris?",
        passages=passages,
        options=generator_pb2.DecodingOptions(
            num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens
        ),
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    # One compute thread for the decoding thread (set before it starts): the sleeps of the
    # throttle, not the tiny model's compute on a busy machine, make the engine's speed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("fairness")
    settings = GeneratorSettings(
        host="127.0.0.1",
        port=0,
        model=make_tiny_bart(tmp / "bart"),
        redis_url=redis_server.url,
        checkpoint_dir=tmp / "checkpoints",
        solo_rows=8,
        prefill_chunk_tokens=128,  # a few short passages per chunk
    )
    server, servicer = build_generator(settings)
    torch.set_num_threads(threads)
    server.set_serving(True)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield servicer, generator_pb2_grpc.GeneratorStub(channel)
    channel.close()
    server.stop(0)
    servicer.close()


@pytest.fixture
def slow(service):
    """The service's backend slowed down; the scheduler re-measures its speed first."""
    servicer, _ = service

    def make(**rates: float) -> Throttle:
        throttle = Throttle(**rates)
        stack.enter_context(throttled(servicer.generator.backend, throttle))
        servicer.scheduler.calibrate(servicer.generator)
        throttle.log.clear()
        return throttle

    from contextlib import ExitStack

    with ExitStack() as stack:
        yield make
    deadline = time.monotonic() + 60
    while servicer.scheduler.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    servicer.scheduler.calibrate(servicer.generator)  # the real speed again


def _outcome(future) -> tuple[grpc.StatusCode, str, dict]:
    try:
        future.result()
        return grpc.StatusCode.OK, "", {}
    except grpc.RpcError as err:
        trailers = dict(err.trailing_metadata() or ())
        return err.code(), err.details(), trailers


def test_work_that_cannot_meet_its_deadline_is_refused_at_once_and_the_rest_finishes(service, slow):
    servicer, stub = service
    # every decoding step of a batch takes 20 ms plus 10 ms per row: a request of 2 passages and
    # 12 tokens takes ~0.4 s alone; ten of them together need ~3 s, against 2.5 s deadlines
    slow(step_s=0.02, step_row_s=0.01, encode_row_s=0.002)
    deadline_s = 2.5
    with ThreadPoolExecutor(10) as pool:
        calls = [
            pool.submit(lambda: stub.Generate(_request(2, 12), timeout=deadline_s))
            for _ in range(10)
        ]
        outcomes = [_outcome(c) for c in calls]
    codes = [code for code, _, _ in outcomes]
    assert grpc.StatusCode.DEADLINE_EXCEEDED not in codes, outcomes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
    assert codes.count(grpc.StatusCode.OK) >= 2
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused, "ten requests cannot all finish in time: some must be refused"
    for _, details, trailers in refused:
        assert "deadline" in details and "retry in" in details
        assert int(trailers[RETRY_AFTER_TRAILER]) >= 1


def test_refusals_tell_how_long_the_work_ahead_takes(service, slow):
    servicer, stub = service
    # Long sleeps per step, so that the model's own compute (which a busy machine stretches:
    # CI runs two test workers on two cores) is a small part of each step: with 90 ms steps
    # ~45 ms more per step made the first request overdue and given up before it ended.
    slow(step_s=0.05, step_row_s=0.05)
    # ~3 s of work (12 steps of 4 rows at 0.25 s), due within 6 s (planned within 4.8 s,
    # given up only past 5.4 s)
    first = stub.Generate.future(_request(4, 12), timeout=6)
    while not servicer.scheduler.running():
        assert not first.done(), first.exception()
        time.sleep(0.01)
    # the same again: beside the first (8 rows, 0.45 s a step) or after it, it cannot end
    # within its 4.8 s, so it is refused with the time the work ahead takes
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_request(4, 12), timeout=6)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = int(dict(err.value.trailing_metadata())[RETRY_AFTER_TRAILER])
    assert f"retry in {retry_after}s" in err.value.details()
    assert retry_after >= 1
    assert first.result().hypotheses


def test_a_request_that_could_not_finish_even_alone_is_too_large(service, slow):
    _, stub = service
    slow(step_s=0.05, step_row_s=0.01)
    # 200 steps of 0.07 s is 14 s, the deadline 5 s: no wait would help
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_request(2, 200), timeout=5.0)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "deadline" in err.value.details() and "new tokens" in err.value.details()
    # the same request with the time it needs is taken
    assert stub.Generate(_request(2, 20), timeout=30).hypotheses


def test_a_small_request_runs_before_a_large_one_that_started_first(service, slow):
    servicer, stub = service
    throttle = slow(step_s=0.01, step_row_s=0.002, encode_row_s=0.02)
    # 40 long passages (a batch of its own: more rows than solo_rows), prefilled one by one
    large = stub.Generate.future(_request(40, 30, words=30), timeout=120)
    # once it has had more engine time than the small request will need in all (least
    # attained service: the small one then runs to its end before the large one goes on)
    while sum(1 for kind, _ in throttle.events() if kind == "encode") < 15:
        time.sleep(0.005)
    small = stub.Generate.future(_request(3, 5), timeout=120)
    assert small.result().hypotheses
    assert not large.done()  # the small answer did not wait for the large one
    seen = throttle.events()
    assert large.result().hypotheses
    # From the small request's first prefill to its last step, only its own work ran (beyond
    # the piece of the large request that was running when it arrived).
    first = seen.index(("encode", 3))
    last = max(i for i, work in enumerate(seen) if work == ("step", 3))
    between = seen[first : last + 1]
    assert set(between) == {("encode", 3), ("step", 3)}, between
    encodes = [rows for kind, rows in throttle.events() if kind == "encode" and rows != 3]
    assert encodes == [1] * 40  # the large prompt went in chunks


def test_waiting_requests_the_engine_can_no_longer_serve_in_time_are_refused_not_timed_out(
    service, slow, monkeypatch
):
    """Admitted at the speed measured then; the engine slows down before they start (a
    neighbour takes the CPU): each is refused at once with a retry-after (RESOURCE_EXHAUSTED,
    the gateway's 429), not left in the line until its deadline passes (a 504)."""
    servicer, stub = service
    monkeypatch.setattr(servicer.scheduler, "max_batch_size", 1)  # one request at a time
    throttle = slow(step_s=0.005, step_row_s=0.005)
    first = stub.Generate.future(_request(2, 40), timeout=60)  # ~0.6 s, a long deadline
    while not servicer.scheduler.running():
        assert not first.done(), first.exception()
        time.sleep(0.005)
    deadline_s = 4.0
    started = time.monotonic()
    waiting = [stub.Generate.future(_request(2, 12), timeout=deadline_s) for _ in range(4)]
    while servicer.scheduler.depth() < len(waiting) and not any(w.done() for w in waiting):
        time.sleep(0.005)
    throttle.step_s = 0.2  # 40 times slower: the first request alone now takes seconds
    outcomes = [_outcome(w) for w in waiting]
    elapsed = time.monotonic() - started
    assert first.result().hypotheses
    codes = [code for code, _, _ in outcomes]
    assert grpc.StatusCode.DEADLINE_EXCEEDED not in codes, outcomes
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused, outcomes
    for _, details, trailers in refused:
        assert "slowed down" in details and "retry in" in details
        assert int(trailers[RETRY_AFTER_TRAILER]) >= 1
    assert elapsed < deadline_s, "refused before their deadline, not at it"


def test_a_running_request_the_engine_can_no_longer_finish_in_time_is_given_up_at_once(
    service, slow
):
    """Admitted and started at the speed measured then; the engine becomes 20 times slower
    while it decodes: once the speed measured says even its own steps alone cannot end before
    its deadline, it is refused (RESOURCE_EXHAUSTED with a retry-after, the gateway's 429)
    while its caller can still be told, not left to run into the deadline (a 504), and its rows
    leave the batch."""
    servicer, stub = service
    throttle = slow(step_s=0.005, step_row_s=0.005)
    deadline_s = 4.0
    started = time.monotonic()
    call = stub.Generate.future(_request(2, 100), timeout=deadline_s)  # ~1.5 s at this speed
    while not servicer.scheduler.running():
        assert not call.done(), call.exception()
        time.sleep(0.005)
    throttle.step_s = 0.1  # its 100 steps now take ~11 s
    code, details, trailers = _outcome(call)
    elapsed = time.monotonic() - started
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "slowed down while this request ran" in details and "retry in" in details
    assert int(trailers[RETRY_AFTER_TRAILER]) >= 1
    assert elapsed < deadline_s, "refused before its deadline, not at it"
    # its rows leave the batch before the next step
    gone_by = time.monotonic() + 2.0
    while servicer.scheduler.running() and time.monotonic() < gone_by:
        time.sleep(0.01)
    assert not servicer.scheduler.running()
    steps = sum(1 for kind, _ in throttle.events() if kind == "step")
    assert steps < 100
