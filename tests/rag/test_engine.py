"""Continuous batching (openbook/rag/engine.py): requests that join a running decode between steps,
with different k, modes, beams and lengths, decode exactly as each would alone, and rows leave
the batch the step their search ends."""

from __future__ import annotations

import random

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook.rag import cache as rows_module
from openbook.rag.errors import Abandoned
from openbook_testkit.rag import QUESTION, make_passages

KINDS = ("bart", "llama", "gemma3")

TOKEN_BEAM = DecodingOptions(num_beams=3, max_new_tokens=7, num_return_sequences=2)
TOKEN_GREEDY = DecodingOptions(max_new_tokens=4)
LONG_GREEDY = DecodingOptions(max_new_tokens=9, min_new_tokens=9)
THOROUGH = DecodingOptions(mode="rag-sequence-thorough", num_beams=2, max_new_tokens=5)
FAST = DecodingOptions(mode="rag-sequence-fast", num_beams=3, max_new_tokens=6)
SEQ_GREEDY = DecodingOptions(mode="rag-sequence-thorough", max_new_tokens=3)

# (step the request arrives at, question, k, options)
ARRIVALS = [
    (0, QUESTION, 3, LONG_GREEDY),
    (0, "Who wrote Hamlet?", 2, TOKEN_BEAM),
    (1, "Where is the tower?", 5, TOKEN_GREEDY),
    (2, QUESTION, 1, THOROUGH),
    (3, "Who wrote Hamlet?", 4, FAST),
    (3, QUESTION, 2, SEQ_GREEDY),
    (6, "Where is the tower?", 3, TOKEN_BEAM),
    (8, QUESTION, 2, LONG_GREEDY),
]


def _generator(dirs, load, kind):
    return load(dirs.bart(0) if kind == "bart" else dirs.causal(kind))


def _assert_same(got, alone):
    assert got.doc_prior == pytest.approx(alone.doc_prior, abs=1e-6)
    assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in alone.hypotheses]
    for a, b in zip(got.hypotheses, alone.hypotheses, strict=True):
        assert a.text == b.text
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
        if b.doc_posterior is not None:
            assert a.doc_posterior == pytest.approx(b.doc_posterior, abs=1e-4)
        if b.token_doc_posteriors is not None:
            for x, y in zip(a.token_doc_posteriors, b.token_doc_posteriors, strict=True):
                assert x == pytest.approx(y, abs=1e-4)


def _decode_schedule(gen, arrivals: list[int], requests: list) -> tuple[dict, list[int]]:
    """``requests`` (question, passages, options) through one engine, request i added before
    step ``arrivals[i]``: their outcomes by index, and the batch's rows after every step."""
    results: dict = {}
    rows_per_step = []
    with torch.inference_mode():
        engine = gen.engine()
        step = 0
        while len(results) < len(requests):
            for i, arrives in enumerate(arrivals):
                if arrives == step:
                    q, ps, o = requests[i]
                    assert engine.accepts(len(ps) * o.num_beams)
                    engine.add(q, ps, o, tag=i)
            for tag, outcome in engine.step():
                assert tag not in results
                results[tag] = outcome
            rows_per_step.append(engine.rows)
            step += 1
    return results, rows_per_step


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("growth_slots", (1, rows_module.GROWTH_SLOTS))
def test_requests_joining_mid_decode_decode_as_if_alone(
    dirs, load, kind, growth_slots, monkeypatch
):
    """Also with a cache that outgrows its spare slots every other step (growth_slots=1)."""
    monkeypatch.setattr(rows_module, "GROWTH_SLOTS", growth_slots)
    gen = _generator(dirs, load, kind)
    requests = [(q, make_passages(k, seed), o) for seed, (_, q, k, o) in enumerate(ARRIVALS)]
    results, rows_per_step = _decode_schedule(gen, [a for a, *_ in ARRIVALS], requests)
    # requests really overlapped: later ones joined while earlier ones were decoding
    assert max(rows_per_step) > max(len(ps) * o.num_beams for _, ps, o in requests)
    for i, (q, ps, o) in enumerate(requests):
        _assert_same(results[i], gen.generate(q, ps, o))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_leave_the_step_their_search_ends(dirs, load, kind):
    gen = _generator(dirs, load, kind)
    short = DecodingOptions(max_new_tokens=2, min_new_tokens=2)
    long = DecodingOptions(max_new_tokens=8, min_new_tokens=8)
    with torch.inference_mode():
        engine = gen.engine()
        engine.add(QUESTION, make_passages(3, 1), short, tag="short")
        engine.add(QUESTION, make_passages(4, 2), long, tag="long")
        assert engine.rows == 7
        # token 1 was chosen from the prefill; one step chooses token 2, ending the short answer
        done = engine.step()
        assert [tag for tag, _ in done] == ["short"]
        assert engine.rows == 4  # its 3 rows left at once; the long request goes on alone
        finished = {}
        while len(engine):
            finished.update(engine.step())
            assert engine.rows in (0, 4)
    assert len(dict(done)["short"].hypotheses[0].token_ids) == 2
    assert len(finished["long"].hypotheses[0].token_ids) == 8


@pytest.mark.parametrize("kind", ("bart", "gemma3"))
def test_a_passage_search_of_rag_sequence_leaves_before_its_request_ends(dirs, load, kind):
    """RAG-Sequence searches one passage at a time: a passage whose answer ended frees its rows
    while the request's other passages still decode."""
    gen = _generator(dirs, load, kind)
    options = DecodingOptions(mode="rag-sequence-fast", max_new_tokens=12)
    passages = make_passages(5, 3)
    alone = gen.generate(QUESTION, passages, options)
    with torch.inference_mode():
        engine = gen.engine()
        engine.add(QUESTION, passages, options, tag=0)
        rows = [engine.rows]
        out = []
        while len(engine):
            out += engine.step()
            rows.append(engine.rows)
    _assert_same(out[0][1], alone)
    assert rows == sorted(rows, reverse=True)  # rows only ever leave


def test_an_abandoned_request_leaves_and_the_others_finish(dirs, load):
    gen = _generator(dirs, load, "gemma3")
    options = DecodingOptions(max_new_tokens=6, min_new_tokens=6)
    a, b = make_passages(2, 0), make_passages(3, 1)
    gave_up = {"b": False}
    with torch.inference_mode():
        engine = gen.engine()
        engine.add(QUESTION, a, options, tag="a")
        engine.add(QUESTION, b, options, tag="b", gave_up=lambda: gave_up["b"])
        engine.step()
        gave_up["b"] = True
        out = dict(engine.step())
        assert isinstance(out["b"], Abandoned)
        assert engine.rows == 2
        while len(engine):
            out.update(engine.step())
    _assert_same(out["a"], gen.generate(QUESTION, a, options))


def test_max_rows_bounds_what_joins(dirs, load):
    gen = _generator(dirs, load, "llama")
    options = DecodingOptions(num_beams=2, max_new_tokens=3)
    with torch.inference_mode():
        engine = gen.engine(max_rows=8)
        assert engine.accepts(10)  # too many rows, but an empty engine takes it
        assert not engine.accepts(10, joining=2)  # unless others join with it
        engine.add(QUESTION, make_passages(3), options)  # 6 rows
        assert engine.accepts(2)
        assert not engine.accepts(4)
        assert not engine.accepts(2, joining=2)


def test_a_request_complete_at_admission_is_returned_by_the_next_step(dirs, load):
    gen = _generator(dirs, load, "gemma3")
    options = DecodingOptions(max_new_tokens=1)
    with torch.inference_mode():
        engine = gen.engine()
        engine.add(QUESTION, make_passages(2), options, tag="one")
        assert engine.rows == 0 and len(engine) == 1  # not decoding, not yet returned
        out = engine.step()
    assert [tag for tag, _ in out] == ["one"] and len(engine) == 0
    _assert_same(out[0][1], gen.generate(QUESTION, make_passages(2), options))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "options", (TOKEN_BEAM, THOROUGH, LONG_GREEDY), ids=("token", "seq", "greedy")
)
def test_a_prompt_prefilled_in_chunks_decodes_as_if_prefilled_at_once(dirs, load, kind, options):
    """Chunked prefill: a request's passages are encoded a few at a time, with another
    request decoding between the chunks, and joined once all are encoded; every row is the row
    one prefill would have given (the families that cannot concatenate encoded passages
    prefill the whole prompt in one call instead)."""
    gen = _generator(dirs, load, kind)
    big, small = make_passages(7, 5), make_passages(2, 6)
    with torch.inference_mode():
        engine = gen.engine()
        engine.add(QUESTION, small, LONG_GREEDY, tag="small")
        request = engine.add("Who wrote Hamlet?", big, options, tag="big", chunk_passages=3)
        assert engine.prefilling == [request] and request.prefilled == 0
        chunks = 0
        out = {}
        while engine.prefilling:
            engine.prefill(request)
            chunks += 1
            out.update(engine.step())  # the other request decodes between the chunks
        assert chunks == (3 if gen.backend.concats_encoded() else 1)
        while len(engine):
            out.update(engine.step())
    _assert_same(out["big"], gen.generate("Who wrote Hamlet?", big, options))
    _assert_same(out["small"], gen.generate(QUESTION, small, LONG_GREEDY))


def test_rows_of_requests_still_prefilling_count_against_max_rows(dirs, load):
    gen = _generator(dirs, load, "llama")
    with torch.inference_mode():
        engine = gen.engine(max_rows=8)
        engine.add(QUESTION, make_passages(6), TOKEN_GREEDY, chunk_passages=2)
        assert engine.rows == 0 and len(engine.prefilling) == 1
        assert engine.accepts(2)
        assert not engine.accepts(3)


def test_a_prefilling_request_whose_caller_gave_up_is_dropped(dirs, load):
    gen = _generator(dirs, load, "gemma3")
    gave_up = {"now": False}
    with torch.inference_mode():
        engine = gen.engine()
        request = engine.add(
            QUESTION,
            make_passages(4),
            TOKEN_GREEDY,
            tag="x",
            gave_up=lambda: gave_up["now"],
            chunk_passages=1,
        )
        engine.prefill(request)
        assert not engine.pending()
        gave_up["now"] = True
        assert engine.pending()
        out = engine.step()
    assert [tag for tag, _ in out] == ["x"] and isinstance(out[0][1], Abandoned)
    assert len(engine) == 0 and not engine.prefilling


@pytest.mark.parametrize("kind", ("llama", "gemma3"))
def test_rows_leaving_make_room_that_joining_rows_fill_in_place(dirs, load, kind, monkeypatch):
    """Steady traffic of greedy requests: a request's rows leave in place (the rows after them
    move up) and the next request's rows are written into the room they left, not the batch
    copied (openbook/rag/cache.py keep_in_place / join_in_place); every request decodes as it
    would alone."""
    from openbook.rag.backends import causal

    taken = {"join_in_place": 0, "keep_in_place": 0}
    for name in taken:

        def counted(*args, _real=getattr(causal, name), _name=name, **kwargs):
            done = _real(*args, **kwargs)
            taken[_name] += done
            return done

        monkeypatch.setattr(causal, name, counted)
    gen = _generator(dirs, load, kind)
    # (arrival step, k, new tokens): short answers leave while long ones decode; the next
    # arrivals join into their room
    arrivals = [(0, 2, 3), (0, 4, 12), (0, 3, 12), (4, 2, 3), (8, 2, 3), (9, 1, 2), (12, 3, 4)]
    requests = [
        (QUESTION, make_passages(k, seed), DecodingOptions(max_new_tokens=n, min_new_tokens=n))
        for seed, (_, k, n) in enumerate(arrivals)
    ]
    results, _ = _decode_schedule(gen, [a for a, *_ in arrivals], requests)
    assert taken["keep_in_place"] >= 2 and taken["join_in_place"] >= 2, taken
    for i, (q, ps, o) in enumerate(requests):
        _assert_same(results[i], gen.generate(q, ps, o))


# Questions of several lengths: a joining prompt longer than the batch's takes slots before it.
_QUESTIONS = (
    QUESTION,
    "Why?",
    "Who wrote Hamlet?",
    "In what year did the long and winding river first flood the old town by the sea?",
)
_OPTIONS = (
    TOKEN_GREEDY,
    LONG_GREEDY,
    DecodingOptions(max_new_tokens=2),
    TOKEN_BEAM,
    FAST,
    SEQ_GREEDY,
    DecodingOptions(mode="rag-sequence-fast", max_new_tokens=7, min_new_tokens=7),
)


@pytest.mark.parametrize("kind", ("llama", "gemma3"))
@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_decode_as_if_alone(dirs, load, kind, seed, monkeypatch):
    """Seeded random traffic, as the service drives the engine: requests of any mode, k,
    length and question arrive at random steps, some prefilled in chunks between steps, some
    waiting until the batch has room (``accepts``), some given up by their caller mid-decode;
    drafting on for some seeds; half the seeds with room enough that most joins and leaves
    happen in place (cache.py). Every request decodes as it would alone (seeds 0-299 of both
    families passed when this was written)."""
    rnd = random.Random(seed)
    if seed % 2:
        monkeypatch.setattr(rows_module, "ROOM_ROWS", 1.0)
        monkeypatch.setattr(rows_module, "ROOM_SLOTS", 0.5)
        monkeypatch.setattr(rows_module, "SPARE_SHARE", 3.0)
    gen = _generator(dirs, load, kind)
    n = rnd.randint(5, 10)
    arrivals = sorted(rnd.randint(0, 12) for _ in range(n))
    requests = [
        (rnd.choice(_QUESTIONS), make_passages(rnd.randint(1, 5), rnd.randint(0, 99)), o)
        for o in (rnd.choice(_OPTIONS) for _ in range(n))
    ]
    chunks = [rnd.choice((None, None, 1, 2)) for _ in range(n)]
    # a caller that gives up at a random step (None: never): its rows leave mid-batch
    gives_up = [rnd.choice((None,) * 5 + (rnd.randint(0, 16),)) for _ in range(n)]
    gen.set_draft_tokens(rnd.choice((0, 0, 2, 4)))
    try:
        results: dict = {}
        waiting: list[int] = []
        with torch.inference_mode():
            engine = gen.engine(max_rows=rnd.choice((12, 40)))
            step = 0
            clock = {"step": step}  # what a caller's gave_up reads
            while len(results) < n:
                waiting += [i for i, arrives in enumerate(arrivals) if arrives == step]
                while waiting:
                    i = waiting[0]
                    q, ps, o = requests[i]
                    if not engine.accepts(len(ps) * o.rows_per_passage):
                        break
                    waiting.pop(0)
                    gave_up = None
                    if gives_up[i] is not None:
                        gave_up = lambda at=gives_up[i]: clock["step"] >= at  # noqa: E731
                    engine.add(q, ps, o, tag=i, chunk_passages=chunks[i], gave_up=gave_up)
                for request in engine.prefilling[:1]:  # one chunk between two steps
                    engine.prefill(request)
                for tag, outcome in engine.step():
                    assert tag not in results
                    results[tag] = outcome
                step += 1
                clock["step"] = step
                assert step < 500, "the schedule did not drain"
        for i, (q, ps, o) in enumerate(requests):
            if isinstance(results[i], Abandoned):
                assert gives_up[i] is not None
                continue
            _assert_same(results[i], gen.generate(q, ps, o))
    finally:
        gen.set_draft_tokens(0)
