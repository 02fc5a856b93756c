"""An in-memory retriever gRPC service: the documents API's contract, served on loopback.

For the gateway's and the CLI's tests of the documents API: it implements the Retriever
service (proto/openbook/v1/retriever.proto) faithfully, with the contract's error codes, over
indexes held in memory: documents checked and split into passages by the library's own
:class:`openbook.index.documents.Document` (the rules and passage ids the real retriever uses),
retrieval by word overlap (a stand-in for an encoder: the tests check which passages come
back, not how well they rank). Admin RPCs need the admin token, as the real service's do.

Contract kept:
  * every acknowledged write raises its index's version by one (a batch: one for the batch),
    and is visible to the next Retrieve; a batch is all or nothing (validated whole first);
  * CreateIndex: ALREADY_EXISTS for a taken name, NOT_FOUND for an unknown ``like``,
    INVALID_ARGUMENT for a bad name or type; DeleteIndex: FAILED_PRECONDITION for the active
    index, NOT_FOUND when absent; DeleteDocument / GetDocument: NOT_FOUND when absent;
    an unknown index is NOT_FOUND everywhere;
  * with ``redis`` given, each write publishes the index's version
    (:func:`openbook.state.shared_state.publish_index_version`), and CreateIndex / DeleteIndex make
    its state afresh (:func:`openbook.state.shared_state.index_renewed`), as the real retriever
    does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from openbook.errors import FailedPrecondition, InvalidArgument, NotFound, OpenbookError
from openbook.index.documents import Document
from openbook.serving.grpc_server import (
    RETRIEVER_SERVICE,
    AdminAuthInterceptor,
    ErrorInterceptor,
    admin_methods,
)
from openbook.state.shared_state import index_renewed, publish_index_version
from openbook.v1 import common_pb2, retriever_pb2, retriever_pb2_grpc
from openbook.validation.limits import check_index_name


class AlreadyExists(OpenbookError):
    code = grpc.StatusCode.ALREADY_EXISTS


INDEX_TYPES = ("flat", "hnsw", "hnsw-sq8", "ivfpq", "bm25")
ENCODER = "fake-word-overlap"
MODEL_VERSION = "fake-retriever-1"


@dataclass
class FakeIndex:
    name: str
    index_type: str = "flat"
    version: int = 0
    documents: dict[str, Document] = field(default_factory=dict)

    def passages(self) -> Iterator[tuple[str, str, str]]:
        for document in self.documents.values():
            for passage in document.passages():
                yield passage.id, passage.title, passage.text

    def count(self) -> int:
        return sum(len(document.passages()) for document in self.documents.values())


def _words(text: str) -> set[str]:
    return {word.strip(".,;:!?\"'()").lower() for word in text.split()} - {""}


class FakeRetriever(retriever_pb2_grpc.RetrieverServicer):
    """The servicer (module docstring). ``indexes`` start as given; ``active`` names one."""

    def __init__(self, active: str = "live", redis: Any = None) -> None:
        self.lock = threading.Lock()
        self.indexes: dict[str, FakeIndex] = {active: FakeIndex(active)}
        self.active = active
        self.redis = redis
        self.calls: list[str] = []  # RPC names in order: what reached the retriever

    # --- helpers ------------------------------------------------------------------------

    def _index(self, name: str, context: grpc.ServicerContext) -> FakeIndex:
        index = self.indexes.get(name or self.active)
        if index is None:
            raise NotFound(f"unknown index {name!r}")
        return index

    def _info(self, index: FakeIndex) -> retriever_pb2.IndexInfo:
        return retriever_pb2.IndexInfo(
            name=index.name,
            encoder=ENCODER,
            dim=8,
            count=index.count(),
            index_type=index.index_type,
            loaded=True,
            active=index.name == self.active,
            verified=True,
            views=["bm25"] if index.index_type == "bm25" else ["dense", "bm25"],
            default_retrieval="bm25" if index.index_type == "bm25" else "hybrid",
            version=index.version,
            score_scale=1.0,
        )

    def _written(self, index: FakeIndex) -> None:
        index.version += 1
        if self.redis is not None:
            publish_index_version(self.redis, index.name, index.version)

    def _renewed(self, name: str) -> None:
        if self.redis is not None:
            index_renewed(self.redis, name)

    # --- reads --------------------------------------------------------------------------

    def Retrieve(self, request, context):
        self.calls.append("Retrieve")
        with self.lock:
            index = self._index(request.index, context)
            k = request.k or 5
            results = []
            passages = list(index.passages())
            for query in request.queries:
                asked = _words(query)
                scored = sorted(
                    passages,
                    key=lambda p: (-len(asked & _words(p[1] + " " + p[2])), p[0]),
                )
                results.append(
                    retriever_pb2.QueryResult(
                        passages=[
                            common_pb2.Passage(
                                id=pid,
                                title=title,
                                text=text,
                                score=float(len(asked & _words(title + " " + text))),
                            )
                            for pid, title, text in scored[:k]
                        ]
                    )
                )
            return retriever_pb2.RetrieveResponse(
                results=results,
                index=index.name,
                model_version=MODEL_VERSION,
                retrieval=request.retrieval or self._info(index).default_retrieval,
                index_version=index.version,
            )

    def ListIndexes(self, request, context):
        self.calls.append("ListIndexes")
        with self.lock:
            return retriever_pb2.ListIndexesResponse(
                indexes=[self._info(index) for _, index in sorted(self.indexes.items())],
                active=self.active,
                model_version=MODEL_VERSION,
            )

    def SwapIndex(self, request, context):
        self.calls.append("SwapIndex")
        with self.lock:
            index = self._index(request.name, context)
            previous, self.active = self.active, index.name
            return retriever_pb2.SwapIndexResponse(
                previous=previous, active=index.name, info=self._info(index)
            )

    def GetDocument(self, request, context):
        self.calls.append("GetDocument")
        with self.lock:
            index = self._index(request.index, context)
            document = index.documents.get(request.id)
            if document is None:
                raise NotFound(f"no document {request.id!r}")
            return retriever_pb2.Document(
                id=document.id,
                title=document.title,
                text=document.text,
                metadata_json=json.dumps(dict(document.metadata)),
                passage_ids=[p.id for p in document.passages()],
            )

    def ListDocuments(self, request, context):
        self.calls.append("ListDocuments")
        with self.lock:
            index = self._index(request.index, context)
            limit = request.limit or 100
            after = sorted(i for i in index.documents if i > request.cursor)
            page = after[:limit]
            more = len(after) > limit
            return retriever_pb2.ListDocumentsResponse(
                ids=page, next_cursor=page[-1] if more else "", version=index.version
            )

    # --- writes -------------------------------------------------------------------------

    def CreateIndex(self, request, context):
        self.calls.append("CreateIndex")
        with self.lock:
            check_index_name("name", request.name)
            if request.type and request.type not in INDEX_TYPES:
                raise InvalidArgument(
                    f"type must be one of {', '.join(INDEX_TYPES)}, got {request.type!r}"
                )
            if request.name in self.indexes:
                raise AlreadyExists(f"index {request.name!r} already exists")
            index_type = request.type or "flat"
            if request.like:
                index_type = request.type or self._index(request.like, context).index_type
            index = self.indexes[request.name] = FakeIndex(request.name, index_type)
            self._renewed(index.name)
            return self._info(index)

    def DeleteIndex(self, request, context):
        self.calls.append("DeleteIndex")
        with self.lock:
            if not request.name:
                raise InvalidArgument("name is required")
            index = self._index(request.name, context)
            if index.name == self.active:
                raise FailedPrecondition(f"index {index.name!r} is active: swap to another first")
            del self.indexes[index.name]
            self._renewed(index.name)
            return retriever_pb2.DeleteIndexResponse(name=index.name)

    def PutDocuments(self, request, context):
        self.calls.append("PutDocuments")
        with self.lock:
            index = self._index(request.index, context)
            documents = [
                Document.create(
                    d.id,
                    d.title,
                    d.text,
                    json.loads(d.metadata_json) if d.metadata_json else None,
                    field=f"documents[{at}]",
                )
                for at, d in enumerate(request.documents)
            ]
            if not documents:
                raise InvalidArgument("documents must not be empty")
            for document in documents:
                index.documents[document.id] = document
            self._written(index)
            return retriever_pb2.WriteResponse(
                index=index.name,
                version=index.version,
                passages=[len(document.passages()) for document in documents],
            )

    def DeleteDocument(self, request, context):
        self.calls.append("DeleteDocument")
        with self.lock:
            index = self._index(request.index, context)
            if index.documents.pop(request.id, None) is None:
                raise NotFound(f"no document {request.id!r}")
            self._written(index)
            return retriever_pb2.WriteResponse(index=index.name, version=index.version)


@dataclass
class RunningFakeRetriever:
    servicer: FakeRetriever
    port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def fake_retriever(
    admin_token: str | None, active: str = "live", redis: Any = None
) -> Iterator[RunningFakeRetriever]:
    """A :class:`FakeRetriever` served on a free loopback port (gRPC health SERVING)."""
    servicer = FakeRetriever(active, redis)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        # As the real service orders them: the auth refusal becomes UNAUTHENTICATED outside.
        interceptors=[
            ErrorInterceptor(),
            AdminAuthInterceptor(admin_methods(RETRIEVER_SERVICE), admin_token),
        ],
    )
    retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield RunningFakeRetriever(servicer, port)
    finally:
        server.stop(0)
