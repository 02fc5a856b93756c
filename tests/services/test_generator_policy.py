"""The generator's scheduling policy alone (openbook_generator/policy.py): no model, no engine,
no thread. Requests are the policy's typed requests with a stand-in for the engine's progress,
batches are plain names, the speed model is set by hand and the clock is a number."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from openbook.errors import Overloaded, TooLarge
from openbook.rag.memory import RequestShape
from openbook.rag.options import DecodingOptions
from openbook.rag.rag_sequence import scoring_tokens
from openbook_generator import policy as policy_module
from openbook_generator.policy import (
    DEADLINE_SHARE,
    INITIAL_STEPS_SHARE,
    BatchWork,
    Request,
    SchedulingOptions,
    SchedulingPolicy,
    WorkKind,
)

NOW = 1000.0
OPTIONS = DecodingOptions(max_new_tokens=20, min_new_tokens=1)


@dataclass
class Progress:
    """What the engine would report of a started request."""

    cost_s: float = 0.0
    steps: int = 0
    prefilled: int = 0


def shape(passages: int = 5, beams: int = 1, prompt: int = 200) -> RequestShape:
    return RequestShape(
        passages=passages,
        beams=beams,
        prompt_tokens=prompt,
        new_tokens=OPTIONS.max_new_tokens,
        input_tokens=passages * prompt,
    )


def started(
    s: RequestShape,
    *,
    seq: int,
    cost_s: float = 0.0,
    deadline: float | None = None,
    solo: bool = False,
) -> Request:
    return Request(
        s, OPTIONS, deadline, admitted_at=NOW, seq=seq, solo=solo, progress=Progress(cost_s)
    )


def waiting(s: RequestShape, deadline: float | None, admitted_at: float = NOW) -> Request:
    return Request(s, OPTIONS, deadline, admitted_at=admitted_at)


def policy(fits=lambda shapes: True, **options) -> SchedulingPolicy:
    return SchedulingPolicy(SchedulingOptions(**options), fits)


def measured(**options) -> SchedulingPolicy:
    """A policy whose engine prefills 1000 tokens/s and decodes a step in 10 ms + 1 ms a row."""
    p = policy(**options)
    p.speed.calibrate([(100, 0.1), (1000, 1.0)], [(1, 0.011), (101, 0.111)])
    return p


def test_work_kinds_are_an_enum_that_reads_as_the_metrics_label():
    assert WorkKind("prefill") is WorkKind.PREFILL
    assert WorkKind.STEP == "step" and str(WorkKind.PREFILL) == "prefill"


# ------------------------------------------------------------------ starting requests


def test_small_requests_share_a_batch_and_large_ones_decode_alone():
    p = policy(solo_rows=16)
    assert p.joins_shared(shape(passages=16))
    assert not p.joins_shared(shape(passages=5, beams=4))


def test_a_prompt_is_prefilled_in_chunks_of_whole_passages():
    p = policy(chunk_tokens=1024)
    assert p.chunk_passages(shape(prompt=300)) == 3
    assert p.chunk_passages(shape(prompt=5000)) == 1  # one passage at least


def test_the_memory_budget_holds_beside_others_but_a_request_alone_always_starts():
    p = policy(fits=lambda shapes: len(shapes) < 3, max_batch_size=8)
    assert p.fits_beside([], shape())
    assert p.fits_beside([shape()], shape())
    assert not p.fits_beside([shape(), shape()], shape())
    assert p.room(7) and not p.room(8)


# ------------------------------------------------------------------ fair share across callers


def of(caller: str, n: int = 1, deadline: float | None = None) -> list[Request]:
    """``n`` waiting requests of ``caller`` (an API key name; "": anonymous)."""
    return [Request(shape(), OPTIONS, deadline, admitted_at=NOW, caller=caller) for _ in range(n)]


def test_a_key_with_one_request_starts_before_another_keys_flood():
    # key A floods the line with 20 requests, then key B asks once: B's starts next
    p = policy(max_batch_size=1)
    line = of("a", 20) + of("b")
    running = [started(shape(), seq=1)]
    running[0].caller = "a"
    order = p.start_order(running, line)
    assert order[0] == 20
    # and with nothing running, A's oldest first, then B's, then A's in their order
    assert p.start_order([], line)[:3] == [0, 20, 1]


def test_a_key_just_served_goes_after_one_that_waits_even_with_nothing_running():
    # one answer at a time: when A's ends, nothing runs, and B (never served) goes first,
    # then they take turns while both wait
    p = policy(max_batch_size=1)
    line = of("a", 4) + of("b", 2)
    p.started(line[0])
    assert (p.last_started("a"), p.last_started("b")) == (1, None)
    assert p.start_order([], line[1:]) == [3, 0, 4, 1, 2]  # positions in line[1:]
    p.started(line[4])  # B's started: A's turn next
    assert p.start_order([], line[1:4] + line[5:]) == [0, 3, 1, 2]


def test_the_round_robin_remembers_a_bounded_number_of_callers(monkeypatch):
    monkeypatch.setattr(policy_module, "MAX_CALLERS_REMEMBERED", 2)
    p = policy()
    for caller in ("a", "b", "c"):
        p.started(of(caller)[0])
    # "a", the least recent, is forgotten: it goes first, as a caller never seen does
    assert p.start_order([], of("c") + of("b") + of("a")) == [2, 1, 0]


def test_fair_share_is_round_robin_across_keys_and_first_come_within_one():
    p = policy()
    line = of("a", 3) + of("b", 2) + of("", 2)  # "": the anonymous callers, one class
    order = p.start_order([], line)
    assert order == [0, 3, 5, 1, 4, 6, 2]
    assert [line[i].caller for i in order] == ["a", "b", "", "a", "b", "", "a"]


def test_one_key_alone_is_served_in_arrival_order():
    p = policy()
    running = [started(shape(), seq=1)]
    assert p.start_order(running, of("a", 5)) == [0, 1, 2, 3, 4]
    assert p.start_order([], of("", 4)) == [0, 1, 2, 3]
    assert p.displaced(of("a", 32), "a") is None


def test_a_key_with_fewer_started_goes_first_until_they_are_even():
    p = policy()
    running = [started(shape(), seq=i) for i in range(3)]
    for r in running:
        r.caller = "a"
    order = p.start_order(running, of("a", 2) + of("b", 4))
    assert order == [2, 3, 4, 0, 5, 1]  # b has 3 to catch up, then they alternate


def test_a_full_line_makes_room_for_a_key_holding_fewer_places():
    p = policy()
    line = of("a", 30) + of("b", 2)
    assert p.displaced(line, "c") == 29  # A's newest gives its place
    assert p.displaced(line, "b") == 29
    assert p.displaced(of("a", 16) + of("b", 16), "a") is None  # A holds no fewer than B
    assert p.displaced(of("a", 16) + of("b", 15), "b") is None  # they would trade back
    assert p.displaced([], "a") is None


def test_another_keys_flood_waiting_behind_a_request_is_not_work_due_before_it():
    p = measured()
    flood = of("a", 20, deadline=NOW + 5.0)
    # the same request is refused behind its own key's flood, admitted beside another's
    with pytest.raises(Overloaded):
        p.admission(shape(), OPTIONS, 6.0, NOW, [], flood, caller="a")
    assert p.admission(shape(), OPTIONS, 6.0, NOW, [], flood, caller="b") > 0


def test_a_waiting_request_is_shed_in_fair_order():
    p = measured()
    running = started(shape(passages=10, prompt=500), seq=1, solo=True)  # ~5 s left
    running.caller = "a"
    # B's request starts before A's waiting ones: only the work running is ahead of it
    flood = of("a", 10, deadline=NOW + 6.0)
    mine = of("b", deadline=NOW + 8.0)
    refused = {id(r.request) for r in p.hopeless(NOW, [running], flood + mine)}
    assert id(mine[0]) not in refused
    assert refused  # A's flood does not all fit


# ------------------------------------------------------------------ ordering


def test_the_least_served_request_goes_first():
    p = policy()
    served = started(shape(), seq=1, cost_s=2.0)
    fresh = started(shape(), seq=2, cost_s=0.0)
    batches = [
        BatchWork("shared", prefilling=[], decoding=[served], steppable=True),
        BatchWork("solo", prefilling=[fresh], decoding=[], steppable=False),
    ]
    work = p.choose(batches, NOW, [served, fresh], [])
    assert work is not None
    assert (work.kind, work.batch, work.request) == (WorkKind.PREFILL, "solo", fresh)
    fresh.progress = Progress(cost_s=3.0)
    work = p.choose(batches, NOW, [served, fresh], [])
    assert work is not None
    assert (work.kind, work.batch, work.request) == (WorkKind.STEP, "shared", None)


def test_equal_service_goes_by_arrival():
    p = policy()
    first, second = started(shape(), seq=1), started(shape(), seq=2)
    batches = [
        BatchWork("b", prefilling=[second], decoding=[], steppable=False),
        BatchWork("a", prefilling=[first], decoding=[], steppable=False),
    ]
    work = p.choose(batches, NOW, [first, second], [])
    assert work is not None and work.request is first


def test_nothing_to_do_is_none():
    p = policy()
    assert p.choose([BatchWork("idle", [], [], steppable=False)], NOW, [], []) is None


def _urgent_and_small(p: SchedulingPolicy, share_of_time: float) -> tuple[Request, Request]:
    """A large request whose remaining work takes ``share_of_time`` of the time it has left,
    and a small one that has had less service."""
    large = started(shape(passages=10), seq=1, cost_s=5.0, solo=True)
    small = started(shape(passages=1), seq=2, cost_s=0.0)
    shared = p.shared_batch_rows([large, small], [])
    remaining = p.remaining_s(large, shared)
    large.deadline = NOW + remaining / share_of_time / DEADLINE_SHARE
    return large, small


def _next(p: SchedulingPolicy, large: Request, small: Request) -> Request | None:
    batches = [
        BatchWork("solo", prefilling=[large], decoding=[], steppable=False),
        BatchWork("shared", prefilling=[small], decoding=[], steppable=False),
    ]
    work = p.choose(batches, NOW, [large, small], [])
    assert work is not None
    return work.request


def test_a_request_whose_deadline_nears_gets_every_other_piece_of_work():
    p = measured()
    large, small = _urgent_and_small(p, share_of_time=0.7)  # more than half its time left
    assert [_next(p, large, small) for _ in range(4)] == [small, large, small, large]


def test_a_critical_request_gets_every_piece_of_work():
    p = measured()
    large, small = _urgent_and_small(p, share_of_time=1.2)  # its work fills its time
    assert [_next(p, large, small) for _ in range(3)] == [large, large, large]


def test_without_a_measured_speed_nothing_is_urgent():
    p = policy()
    large, small = _urgent_and_small(measured(), share_of_time=1.2)
    assert [_next(p, large, small) for _ in range(2)] == [small, small]


# ------------------------------------------------------------------ admission


def test_nothing_is_refused_before_the_speed_is_measured():
    p = policy()
    huge = shape(passages=100, prompt=500)
    assert p.admission(huge, OPTIONS, 0.1, NOW, [], []) == 0.0
    assert p.hopeless(NOW, [], [waiting(huge, NOW + 0.1)]) == []


def test_a_request_that_fits_is_admitted_with_its_plan():
    p = measured()
    planned = p.admission(shape(), OPTIONS, 10.0, NOW, [], [])
    assert planned == pytest.approx(p.work_s(shape(), OPTIONS, shape().rows, 0))
    assert 0 < planned < 10.0


def test_a_request_too_large_even_alone_is_too_large():
    p = measured()
    with pytest.raises(TooLarge, match="fewer passages"):
        p.admission(shape(passages=100, prompt=200), OPTIONS, 5.0, NOW, [], [])


def test_a_request_that_fits_its_deadline_but_arrived_late_is_overloaded_not_too_large():
    p = measured()
    s = shape(passages=5, prompt=400)  # 2 s of prefill alone, and the steps
    alone = p.work_s(s, OPTIONS, s.rows, 0, worst=True)
    # its caller gave it 4 s; 1.5 s were left when it reached the generator
    assert alone < 4.0 * DEADLINE_SHARE and alone > 1.5 * DEADLINE_SHARE
    with pytest.raises(Overloaded, match="were left when it reached the generator") as refused:
        p.admission(s, OPTIONS, 1.5, NOW, [], [], budget_s=4.0)
    assert not isinstance(refused.value, TooLarge)
    assert refused.value.retry_after_s == 1.0
    # a caller that did not say its budget: the time left is all it has
    with pytest.raises(TooLarge, match="allows 2s"):
        p.admission(s, OPTIONS, 1.5, NOW, [], [])
    # too large for the whole budget is too large, whenever it arrives
    with pytest.raises(TooLarge, match="allows 2s"):
        p.admission(s, OPTIONS, 1.0, NOW, [], [], budget_s=2.0)


def test_a_request_behind_too_much_earlier_work_is_overloaded_with_a_retry_after():
    p = measured()
    # 5 s of prefill left, due before the newcomer's deadline
    ahead = started(shape(passages=10, prompt=500), seq=1, deadline=NOW + 4.0, solo=True)
    with pytest.raises(Overloaded) as refused:
        p.admission(shape(passages=1), OPTIONS, 5.0, NOW, [ahead], [])
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0


def test_a_request_that_would_push_an_admitted_one_past_its_deadline_is_refused():
    p = measured()
    admitted = started(shape(passages=10, prompt=500), seq=1, deadline=NOW + 6.5, solo=True)
    # ~5.2 s of work left and 6.5 s x 0.8 = 5.2 s to do it in: no room for more before it
    newcomer = shape(passages=1, prompt=400)
    assert p.admission(newcomer, OPTIONS, 100.0, NOW, [], []) > 0  # alone it is fine
    with pytest.raises(Overloaded):
        p.admission(newcomer, OPTIONS, 1.0, NOW, [admitted], [])


def test_a_waiting_request_that_can_no_longer_make_its_deadline_is_refused():
    p = measured()
    running = started(shape(passages=10, prompt=500), seq=1, solo=True)  # ~5 s left
    late = waiting(shape(), NOW + 2.0, admitted_at=NOW - 1.0)
    patient = waiting(shape(), None)
    fine = waiting(shape(), NOW + 100.0)
    refused = p.hopeless(NOW, [running], [late, patient, fine])
    assert [r.request for r in refused] == [late]
    retry = refused[0].error.retry_after_s
    assert retry == pytest.approx(p.lateness.factor * p.remaining_s(running, 1), rel=0.01)


def test_a_running_request_that_cannot_finish_even_alone_is_given_up_before_its_deadline():
    p = measured()
    # ~5 s of work left, alone; admitted 1 s ago with 5 s to its deadline: it cannot make it
    doomed = started(shape(passages=10, prompt=500), seq=1, solo=True, deadline=NOW + 4.0)
    doomed.admitted_at = NOW - 1.0
    fine = started(shape(), seq=2, deadline=NOW + 100.0)
    patient = started(shape(), seq=3)  # no deadline: never given up
    refused = p.overdue(NOW, [doomed, fine, patient])
    assert [r.request for r in refused] == [doomed]
    error = refused[0].error
    assert isinstance(error, Overloaded) and "retry" in str(error)
    # told to come back when the next of the others ends
    shared = p.shared_batch_rows([fine, patient], [])
    assert error.retry_after_s == pytest.approx(p.remaining_s(fine, shared))


def test_a_running_request_is_judged_by_its_own_rows_alone_within_the_reply_margin():
    """A lower bound of when it ends: its own rows' steps only, unscaled by the lateness (which
    may be large after a slowdown); the reply needs a tenth of its whole time to reach the
    caller."""
    p = measured()
    request = started(shape(), seq=1, deadline=NOW + 10.0)  # its own work: well under 1 s
    p.lateness.ratios.extend([50.0] * 10)  # plans are scaled 50x; the lower bound is not
    crowd = [started(shape(passages=16), seq=i) for i in range(2, 9)]
    assert p.overdue(NOW, [request, *crowd]) == []
    alone = p.remaining_s(request, request.shape.rows)
    # ending after deadline - 10% of its time: given up; a little before: kept
    assert p.overdue(NOW + 9.0 - alone + 0.01, [request]) != []
    assert p.overdue(NOW + 9.0 - alone - 0.01, [request]) == []


def test_nothing_running_is_given_up_before_the_speed_is_measured():
    request = started(shape(passages=10, prompt=500), seq=1, deadline=NOW + 0.01)
    assert policy().overdue(NOW, [request]) == []


def test_the_retry_after_is_the_shortest_remaining_work():
    p = measured()
    short = started(shape(passages=1), seq=1)
    long = started(shape(passages=10, prompt=500), seq=2, solo=True)
    shared = p.shared_batch_rows([short, long], [])
    assert p.retry_after_s([short, long], []) == pytest.approx(p.remaining_s(short, shared))
    assert p.retry_after_s([], []) == 1.0


# ------------------------------------------------------------------ estimates and learning


def test_remaining_work_shrinks_as_the_prompt_is_prefilled_and_steps_are_taken():
    p = measured()
    request = started(shape(passages=10), seq=1, solo=True)
    whole = p.remaining_s(request, 1)
    request.progress = Progress(prefilled=5)
    half = p.remaining_s(request, 1)
    request.progress = Progress(prefilled=10, steps=5)
    decoding = p.remaining_s(request, 1)
    assert whole > half > decoding > 0


def test_the_shared_batch_counts_running_and_waiting_small_requests_only():
    p = policy(solo_rows=16, max_batch_size=2)
    small = started(shape(passages=4), seq=1)
    solo = started(shape(passages=40), seq=2, solo=True)
    queued_small, queued_large = waiting(shape(passages=8), None), waiting(shape(passages=40), None)
    assert p.shared_batch_rows([], []) == 1
    assert p.shared_batch_rows([small, solo], [queued_large]) == 4
    # two of mean 6 rows run at once (max_batch_size 2)
    assert p.shared_batch_rows([small, solo], [queued_small, queued_large]) == 12


def test_a_finished_request_teaches_the_answer_length_and_the_lateness():
    p = measured()
    request = started(shape(), seq=1, deadline=NOW + 3.0)
    request.progress = Progress(steps=OPTIONS.max_new_tokens)  # used every token
    request.planned_s = 1.0
    p.finished(request, NOW + 2.0)
    assert p.steps_share > INITIAL_STEPS_SHARE
    assert p.lateness.factor == pytest.approx(2.0)


def test_a_late_spell_does_not_refuse_tight_requests_for_good():
    """After requests ran 4x later than planned, one planned to fill half its time is refused
    (4 x 0.5 > DEADLINE_SHARE): with no such request admitted, none would finish to teach the
    lateness otherwise. Once no tight request has finished for a while
    (LATENESS_RELAX_S e-folds), it is admitted again."""
    p = measured()
    for i in range(10):
        late = started(shape(), seq=i, deadline=NOW + 4.0)
        late.planned_s = 1.0
        p.finished(late, NOW + 4.0)  # 4 s taken of a 1 s plan
    assert p.lateness.at(NOW + 4.0) == pytest.approx(4.0)
    time_s = 2 * p.work_s(shape(), OPTIONS, 5, 0, worst=True)  # it alone fills half of it
    with pytest.raises(TooLarge):
        p.admission(shape(), OPTIONS, time_s, NOW + 5.0, [], [])
    later = NOW + 4.0 + 5 * policy_module.LATENESS_RELAX_S
    assert p.lateness.at(later) == pytest.approx(1.0, abs=0.05)
    assert p.admission(shape(), OPTIONS, time_s, later, [], []) > 0


def test_thorough_scoring_is_planned_at_the_longest_hypothesis():
    """RAG-Sequence thorough scores every hypothesis, padded to the longest, under every
    passage, in one piece at its end: planned at max_new_tokens however short answers have
    been, as the engine measures it (rag_sequence.scoring_tokens of what was found)."""
    p = measured()
    p.steps_share = 0.1  # answers have been short
    thorough = DecodingOptions(mode="rag-sequence-thorough", num_beams=2, max_new_tokens=20)
    greedy = DecodingOptions(mode="rag-sequence-fast", num_beams=2, max_new_tokens=20)
    s = shape(passages=5, beams=2)
    scoring = p.work_s(s, thorough, s.rows, 0) - p.work_s(s, greedy, s.rows, 0)
    assert scoring == pytest.approx(p.speed.scoring_s(scoring_tokens(s.rows, 5, 20)))


def test_a_request_never_started_teaches_nothing():
    p = measured()
    p.finished(waiting(shape(), NOW + 3.0), NOW + 2.0)
    assert p.steps_share == INITIAL_STEPS_SHARE and p.lateness.factor == 1.0
