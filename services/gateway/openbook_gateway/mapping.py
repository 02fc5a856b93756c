"""Between the gateway's HTTP bodies and the services' protos, in both directions.

Requests are built from bodies already validated (``openbook_gateway.schemas``): nothing here
checks anything again. Replies become response bodies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from openbook.storage.artifacts import public_name
from openbook.types import document_id_of
from openbook.v1 import common_pb2, generator_pb2, retriever_pb2
from openbook_gateway.schemas import (
    AnswerRequest,
    AnswerResponse,
    DocumentResponse,
    HypothesisOut,
    IndexOut,
    PassageOut,
    PutDocumentResponse,
    TokenPosteriorOut,
)


def generate_request(
    body: AnswerRequest, passages: Sequence[common_pb2.Passage], fair_share: str = ""
) -> generator_pb2.GenerateRequest:
    """``fair_share``: who asks, the generator's fair-share class (GenerateRequest.caller: a
    key's name, "" anonymous)."""
    return generator_pb2.GenerateRequest(
        question=body.question,
        passages=passages,
        caller=fair_share,
        options=generator_pb2.DecodingOptions(
            mode=body.decoding,
            num_beams=body.num_beams,
            max_new_tokens=body.max_new_tokens,
            min_new_tokens=body.min_new_tokens,
            length_penalty=body.length_penalty,
            num_return_sequences=body.num_return_sequences,
            # unset at temperature 0: the generator's greedy / beam search, as before sampling
            temperature=body.temperature if body.sampling else None,
            top_p=body.top_p if body.sampling else None,
            top_k=body.top_k if body.sampling else None,
            seed=body.seed if body.sampling else None,
        ),
    )


def answer_response(
    body: AnswerRequest,
    retrieved: retriever_pb2.RetrieveResponse,
    generated: generator_pb2.GenerateResponse,
    request_id: str,
    timings: dict[str, float],
) -> dict:
    """The body of a computed answer (``cached`` false), as the model gave it: not abstained
    (:func:`with_threshold` applies a request's threshold, after the cache)."""
    best = generated.hypotheses[0] if generated.hypotheses else None
    return AnswerResponse(
        answer=best.text if best is not None else "",
        confidence=_unit(best.confidence) if best is not None else 0.0,
        abstained=False,
        index=retrieved.index,
        index_version=retrieved.index_version,
        # a retriever from before RetrieveResponse.retrieval existed says nothing: null
        retrieval=retrieved.retrieval or None,
        # by name, never a filesystem path (issue 42), whatever a service reports
        model_version=public_name(generated.model_version),
        retriever_version=public_name(retrieved.model_version),
        decoding=body.decoding,
        passages=passages_out(retrieved.results[0].passages, generated),
        hypotheses=hypotheses_out(generated),
        cached=False,
        request_id=request_id,
        timings_ms=timings,
        prompt_tokens=generated.prompt_tokens,
        cached_prompt_tokens=generated.cached_prompt_tokens,
        question_used=body.question,
        min_confidence=None,  # a request's threshold, applied later (with_threshold)
    ).model_dump()


# What a stored answer leaves out: they belong to the request that computed it (the
# threshold too: a stored answer is the model's, never abstained; see with_threshold; and what
# the generator's passage cache held then: served from the store, the generator reads nothing).
PER_REQUEST_FIELDS = (
    "request_id",
    "timings_ms",
    "min_confidence",
    "abstained",
    "cached_prompt_tokens",
)


def stored_answer(answer: dict) -> dict:
    """An answer as the cache keeps it."""
    return {key: value for key, value in answer.items() if key not in PER_REQUEST_FIELDS}


def cached_answer(stored: dict, request_id: str, timings: dict[str, float]) -> dict:
    """A stored answer served to this request (validated when it was stored), not abstained
    until :func:`with_threshold` says so."""
    return {
        **stored,
        "abstained": False,
        "min_confidence": None,
        "cached": True,
        "cached_prompt_tokens": None,
        "request_id": request_id,
        "timings_ms": timings,
    }


def with_threshold(answer: dict, min_confidence: float | None) -> dict:
    """``answer`` (computed or cached, never abstained itself) as a request with threshold
    ``min_confidence`` gets it: abstained, with an empty answer, when its confidence is below
    the threshold; passages and hypotheses stay. None: no threshold."""
    answer = {**answer, "min_confidence": min_confidence}
    if min_confidence is None or answer["confidence"] >= min_confidence:
        return answer
    return {**answer, "answer": "", "abstained": True}


def _unit(value: float) -> float:
    """A confidence from the wire, kept in [0, 1] (a NaN from a broken generator is 0)."""
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def passages_out(
    passages: Sequence[common_pb2.Passage], generated: generator_pb2.GenerateResponse
) -> list[PassageOut]:
    best = generated.hypotheses[0] if generated.hypotheses else None
    posterior: list[float] | None = None
    if best is not None and len(best.doc_posterior):
        posterior = list(best.doc_posterior)
    elif best is not None and len(best.tokens):
        posterior = list(best.tokens[-1].doc_posterior)
    prior = list(generated.doc_prior)
    return [
        PassageOut(
            id=p.id,
            title=p.title,
            text=p.text,
            score=p.score,
            document=document_id_of(p.id),
            page=p.page or None,
            prior=prior[i] if i < len(prior) else None,
            posterior=posterior[i] if posterior and i < len(posterior) else None,
        )
        for i, p in enumerate(passages)
    ]


def hypotheses_out(generated: generator_pb2.GenerateResponse) -> list[HypothesisOut]:
    return [
        HypothesisOut(
            text=h.text,
            log_prob=h.log_prob if math.isfinite(h.log_prob) else -1e30,
            doc_posterior=list(h.doc_posterior) or None,
            tokens=[
                TokenPosteriorOut(token=t.token, posterior=list(t.doc_posterior)) for t in h.tokens
            ]
            or None,
            num_tokens=h.num_tokens,
            finish_reason=h.finish_reason or None,
            confidence=_unit(h.confidence),
            raw_confidence=_unit(h.raw_confidence),
        )
        for h in generated.hypotheses
    ]


def indexes_response(listed: retriever_pb2.ListIndexesResponse) -> dict:
    return {
        "active": listed.active or None,
        "indexes": [
            IndexOut(
                name=i.name,
                encoder=public_name(i.encoder),
                dim=i.dim,
                count=i.count,
                index_type=i.index_type,
                loaded=i.loaded,
                active=i.active,
                # a retriever from before IndexInfo.problem existed reports none: loadable
                loadable=not i.problem,
                problem=i.problem or None,
                verified=i.verified,
                views=list(i.views),
                default_retrieval=i.default_retrieval or None,
                version=i.version,
                engine=i.engine or None,
            )
            for i in listed.indexes
        ],
    }


def index_out(info: retriever_pb2.IndexInfo) -> dict:
    """One index as ``/indexes`` lists it (a created index's reply too)."""
    listed = retriever_pb2.ListIndexesResponse(indexes=[info])
    out: dict = indexes_response(listed)["indexes"][0].model_dump()
    return out


def put_document_response(index: str, doc_id: str, reply: retriever_pb2.WriteResponse) -> dict:
    passages = reply.passages[0] if reply.passages else 0
    return PutDocumentResponse(
        index=index, id=doc_id, passages=passages, version=reply.version
    ).model_dump()


def document_response(index: str, document: retriever_pb2.Document) -> dict:
    metadata = json.loads(document.metadata_json) if document.metadata_json else {}
    return DocumentResponse(
        index=index,
        id=document.id,
        title=document.title,
        text=document.text,
        metadata=metadata if isinstance(metadata, dict) else {},
        passage_ids=list(document.passage_ids),
    ).model_dump()
