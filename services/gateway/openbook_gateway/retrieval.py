"""The retriever as the gateway sees it: one service, or an index split over shards.

With several addresses (``OPENBOOK_GATEWAY_RETRIEVER_ADDR=host-0:8051,host-1:8051``) each serves one
shard of every index: a query fans out to all and the top-k are merged by score, so results
equal those of the unsharded index. Admin calls go to every shard.

Documents: a document lives in one shard, chosen by its id (:func:`document_shard`); a write,
a read or a delete of it goes to that shard only. An index's version is the sum of its shards'
(every write lands in one shard and raises that shard's by one). A batch spread over several
shards is one write per shard: all or nothing on each shard, not across them (a shard that
refuses leaves the others' parts written; the reply's error says which shard refused).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import HTTPException
from pydantic import SecretStr

from openbook.types import Passage
from openbook.v1 import common_pb2, retriever_pb2
from openbook.validation.metadata_filter import MetadataFilter
from openbook_gateway.clients import DOCUMENT_HTTP_STATUS, RetrieverClient

# A document write embeds its passages (and creating an index may load an encoder) before it
# answers: longer than a query, so a write's deadline is at least this long. Reads keep the
# retrieve deadline.
DOCUMENT_WRITE_MIN_TIMEOUT_S = 300.0
DOCUMENT_WRITES = frozenset({"CreateIndex", "DeleteIndex", "PutDocuments", "DeleteDocument"})


def _to_passage(p: common_pb2.Passage) -> Passage:
    return Passage(id=p.id, title=p.title, text=p.text, score=p.score, page=p.page)


def _to_proto(p: Passage) -> common_pb2.Passage:
    return common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score, page=p.page)


def merge_results(per_shard: Sequence[Sequence[list[Passage]]], k: int) -> list[list[Passage]]:
    """Merge ``per_shard[s][q]`` (each shard's hits for query q, best first) into the top-k.

    Sorted by score, descending; ties keep shard order, then rank within the shard (a stable
    sort over the hits concatenated in that order). A passage id seen twice keeps its best hit
    only, so a shard listed twice by mistake cannot duplicate results.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not per_shard:
        return []
    n_queries = len(per_shard[0])
    if any(len(r) != n_queries for r in per_shard):
        counts = [len(r) for r in per_shard]
        raise ValueError(f"shards answered different numbers of queries: {counts}")
    merged = []
    for q in range(n_queries):
        hits = sorted((p for shard in per_shard for p in shard[q]), key=lambda p: -p.score)
        seen: set[str] = set()
        top: list[Passage] = []
        for p in hits:
            if p.id not in seen:
                seen.add(p.id)
                top.append(p)
                if len(top) == k:
                    break
        merged.append(top)
    return merged


def merge_listings(
    replies: Sequence[retriever_pb2.ListIndexesResponse], shard_names: Sequence[str]
) -> retriever_pb2.ListIndexesResponse:
    """One listing from every shard's: an index is servable only where every shard has it
    and can load it, so each shard's problem (or its lack of the index) is the index's, named
    after the shard; counts add up."""
    per_shard = [{i.name: i for i in reply.indexes} for reply in replies]
    indexes = []
    for name in sorted(set().union(*per_shard)):
        infos = [shard.get(name) for shard in per_shard]
        held = [i for i in infos if i is not None]
        info = retriever_pb2.IndexInfo()
        info.CopyFrom(held[0])
        info.count = sum(i.count for i in held)
        info.version = sum(i.version for i in held)
        info.loaded = all(i is not None and i.loaded for i in infos)
        info.verified = all(i is not None and i.verified for i in infos)
        info.problem = "; ".join(
            f"{shard}: {'no such index' if i is None else i.problem}"
            for shard, i in zip(shard_names, infos, strict=True)
            if i is None or i.problem
        )
        indexes.append(info)
    return retriever_pb2.ListIndexesResponse(
        indexes=indexes, active=replies[0].active, model_version=replies[0].model_version
    )


def document_shard(doc_id: str, shards: int) -> int:
    """The shard that holds document ``doc_id`` of ``shards``: stable across processes and
    restarts (crc32 of its UTF-8 id; Python's ``hash`` of a str is salted per process)."""
    return zlib.crc32(doc_id.encode("utf-8", "surrogatepass")) % shards


class Retrieval:
    def __init__(
        self,
        addrs: str,
        timeout_s: float,
        health_timeout_s: float,
        admin_token: SecretStr | str | None = None,
    ) -> None:
        addresses = [a.strip() for a in addrs.split(",") if a.strip()]
        if not addresses:
            raise ValueError("OPENBOOK_GATEWAY_RETRIEVER_ADDR: no address given")
        self.shards = [
            RetrieverClient(a, timeout_s, health_timeout_s, admin_token) for a in addresses
        ]
        if len(self.shards) > 1:
            # Errors name the shard as configured (gRPC's own text has at best a resolved IP,
            # and a deadline none): "retriever shard 1 (host-1:8051) unavailable: ...".
            for i, shard in enumerate(self.shards):
                shard.name = f"retriever shard {i} ({shard.addr})"

    async def _all(self, method: str, request, request_id: str, timeout_s: float | None = None):
        return await asyncio.gather(
            *(
                shard.call(getattr(shard.stub, method), request, request_id, timeout_s)
                for shard in self.shards
            )
        )

    async def retrieve(
        self,
        question: str,
        k: int,
        index: str | None,
        request_id: str,
        retrieval: str | None = None,
        where: MetadataFilter | None = None,
    ) -> retriever_pb2.RetrieveResponse:
        """The top-k for ``question`` on ``index`` (None: the active one), by ``retrieval``
        (None: the index's default), among the passages ``where`` keeps (each shard filters
        its own), merged over the shards.

        Hybrid scores merge like dense ones: every shard fuses with the same fitted weights
        (copied from the parent index's manifest), so its fused scores are on one scale."""
        mode = retrieval or ""
        filter_json = where.canonical() if where is not None else ""
        request = retriever_pb2.RetrieveRequest(
            queries=[question], k=k, index=index or "", retrieval=mode, filter_json=filter_json
        )
        replies = await self._all("Retrieve", request, request_id)
        if len(replies) == 1:
            return replies[0]
        # A swap reaches shards one after another; a request caught in between asks the
        # lagging shards for shard 0's index explicitly, so the answer uses one index.
        label = replies[0].index
        for i, reply in enumerate(replies):
            if reply.index != label:
                shard = self.shards[i]
                retry = retriever_pb2.RetrieveRequest(
                    queries=[question], k=k, index=label, retrieval=mode, filter_json=filter_json
                )
                replies[i] = await shard.call(shard.stub.Retrieve, retry, request_id)
        merged = merge_results(
            [[[_to_passage(p) for p in reply.results[0].passages]] for reply in replies], k
        )[0]
        return retriever_pb2.RetrieveResponse(
            results=[retriever_pb2.QueryResult(passages=[_to_proto(p) for p in merged])],
            index=label,
            model_version=replies[0].model_version,
            retrieval=replies[0].retrieval,
            # Every write lands in one shard and raises its version by one: the sum counts them.
            index_version=sum(reply.index_version for reply in replies),
        )

    async def embed_queries(
        self, queries: list[str], index: str | None, request_id: str
    ) -> retriever_pb2.EmbedQueriesResponse:
        """The query vectors of ``queries`` on ``index`` (None: the active one). Every shard
        of an index holds the same encoders, so one shard (the first) answers."""
        shard = self.shards[0]
        request = retriever_pb2.EmbedQueriesRequest(queries=queries, index=index or "")
        return await shard.call(shard.stub.EmbedQueries, request, request_id)

    async def list_indexes(self, request_id: str) -> retriever_pb2.ListIndexesResponse:
        replies = await self._all("ListIndexes", retriever_pb2.ListIndexesRequest(), request_id)
        if len(replies) == 1:
            return replies[0]
        return merge_listings(replies, [shard.name for shard in self.shards])

    async def _all_or_undone(
        self,
        method: str,
        request,
        undo: Callable[[int, Any], Any],
        request_id: str,
        timeout_s: float,
    ) -> list:
        """``method`` on every shard, all or none: if one refuses, every shard that took it is
        sent ``undo(shard number, its reply)`` (None: nothing to undo) and the first failure is
        raised (a non-HTTP one as 503)."""
        results = await asyncio.gather(
            *(
                shard.call(getattr(shard.stub, method), request, request_id, timeout_s)
                for shard in self.shards
            ),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed:
            return results
        for number, (shard, result) in enumerate(zip(self.shards, results, strict=True)):
            back = None if isinstance(result, BaseException) else undo(number, result)
            if back is not None:
                await shard.call(getattr(shard.stub, method), back, request_id, timeout_s)
        error = failed[0]
        if isinstance(error, HTTPException):
            raise error
        what = {"SwapIndex": "swap", "ReloadModel": "reload"}.get(method, method)
        raise HTTPException(503, f"retriever {what} failed: {error}")

    async def swap(self, name: str, request_id: str, timeout_s: float) -> tuple[str, str]:
        """Swap every shard; if one refuses, put the others back so all agree."""

        def undo(_: int, reply: Any) -> Any:
            return retriever_pb2.SwapIndexRequest(name=reply.previous) if reply.previous else None

        request = retriever_pb2.SwapIndexRequest(name=name)
        first = (await self._all_or_undone("SwapIndex", request, undo, request_id, timeout_s))[0]
        return first.previous, first.active

    async def model_versions(self, request_id: str) -> list[str]:
        """The query-encoder version each shard serves."""
        replies = await self._all("ListIndexes", retriever_pb2.ListIndexesRequest(), request_id)
        return [reply.model_version for reply in replies]

    async def reload_model(
        self, path: str, request_id: str, timeout_s: float
    ) -> tuple[list[str], str]:
        """Reload every shard; if one refuses, put the others back so all agree (as ``swap``
        does). Returns each shard's previous version and the version now served."""
        previous = await self.model_versions(request_id)

        def undo(number: int, reply: Any) -> Any:
            before = previous[number]
            switched = reply.model_version != before
            return common_pb2.ReloadModelRequest(path=before) if switched else None

        request = common_pb2.ReloadModelRequest(path=path)
        replies = await self._all_or_undone("ReloadModel", request, undo, request_id, timeout_s)
        return previous, replies[0].model_version

    async def restore_model(self, versions: list[str], request_id: str, timeout_s: float) -> None:
        """Put every shard back on its version in ``versions`` (from ``reload_model``)."""
        await asyncio.gather(
            *(
                shard.call(
                    shard.stub.ReloadModel,
                    common_pb2.ReloadModelRequest(path=version),
                    request_id,
                    timeout_s,
                )
                for shard, version in zip(self.shards, versions, strict=True)
            )
        )

    # --- documents ---------------------------------------------------------------------------

    async def _document_call(self, shard: int, method: str, request, request_id: str):
        client = self.shards[shard]
        timeout_s = client.timeout_s
        if method in DOCUMENT_WRITES:
            timeout_s = max(timeout_s, DOCUMENT_WRITE_MIN_TIMEOUT_S)
        return await client.call(
            getattr(client.stub, method),
            request,
            request_id,
            timeout_s,
            statuses=DOCUMENT_HTTP_STATUS,
        )

    async def _document_all(self, method: str, request, request_id: str) -> list:
        return await asyncio.gather(
            *(
                self._document_call(shard, method, request, request_id)
                for shard in range(len(self.shards))
            )
        )

    async def create_index(
        self, name: str, index_type: str, like: str, request_id: str
    ) -> retriever_pb2.IndexInfo:
        """Create the empty index on every shard: its info, counts and versions summed."""
        request = retriever_pb2.CreateIndexRequest(name=name, type=index_type, like=like)
        infos = await self._document_all("CreateIndex", request, request_id)
        info = retriever_pb2.IndexInfo()
        info.CopyFrom(infos[0])
        info.count = sum(i.count for i in infos)
        info.version = sum(i.version for i in infos)
        return info

    async def delete_index(self, name: str, request_id: str) -> None:
        request = retriever_pb2.DeleteIndexRequest(name=name)
        await self._document_all("DeleteIndex", request, request_id)

    async def _versions_elsewhere(self, index: str, written: set[int], request_id: str) -> int:
        """The sum of the versions of ``index``'s shards not in ``written`` (a write's reply
        carries only its own shard's)."""
        request = retriever_pb2.ListDocumentsRequest(index=index, limit=1)
        others = [s for s in range(len(self.shards)) if s not in written]
        replies = await asyncio.gather(
            *(self._document_call(s, "ListDocuments", request, request_id) for s in others)
        )
        return sum(reply.version for reply in replies)

    async def put_documents(
        self, index: str, documents: Sequence[retriever_pb2.Document], request_id: str
    ) -> retriever_pb2.WriteResponse:
        """Insert or replace ``documents`` (each in its shard); passages per document in the
        given order, the index's version once written."""
        by_shard: dict[int, list[int]] = {}
        for at, document in enumerate(documents):
            by_shard.setdefault(document_shard(document.id, len(self.shards)), []).append(at)
        shards = sorted(by_shard)
        replies = await asyncio.gather(
            *(
                self._document_call(
                    shard,
                    "PutDocuments",
                    retriever_pb2.PutDocumentsRequest(
                        index=index, documents=[documents[at] for at in by_shard[shard]]
                    ),
                    request_id,
                )
                for shard in shards
            )
        )
        passages = [0] * len(documents)
        for shard, reply in zip(shards, replies, strict=True):
            for at, count in zip(by_shard[shard], reply.passages, strict=False):
                passages[at] = count
        version = sum(reply.version for reply in replies)
        if len(self.shards) > 1:
            version += await self._versions_elsewhere(index, set(shards), request_id)
        return retriever_pb2.WriteResponse(index=index, version=version, passages=passages)

    async def delete_document(
        self, index: str, doc_id: str, request_id: str
    ) -> retriever_pb2.WriteResponse:
        shard = document_shard(doc_id, len(self.shards))
        request = retriever_pb2.DeleteDocumentRequest(index=index, id=doc_id)
        reply = await self._document_call(shard, "DeleteDocument", request, request_id)
        if len(self.shards) > 1:
            version = reply.version + await self._versions_elsewhere(index, {shard}, request_id)
            return retriever_pb2.WriteResponse(index=index, version=version)
        return reply

    async def get_document(
        self, index: str, doc_id: str, request_id: str
    ) -> retriever_pb2.Document:
        shard = document_shard(doc_id, len(self.shards))
        request = retriever_pb2.GetDocumentRequest(index=index, id=doc_id)
        return await self._document_call(shard, "GetDocument", request, request_id)

    async def list_documents(
        self, index: str, cursor: str, limit: int, request_id: str
    ) -> retriever_pb2.ListDocumentsResponse:
        """A page of ids in id order after ``cursor``: each shard's first ``limit`` merged (the
        page's ids are the smallest ``limit`` over all shards)."""
        request = retriever_pb2.ListDocumentsRequest(index=index, cursor=cursor, limit=limit)
        replies = await self._document_all("ListDocuments", request, request_id)
        if len(replies) == 1:
            return replies[0]
        ids = sorted(i for reply in replies for i in reply.ids)
        more = len(ids) > limit or any(reply.next_cursor for reply in replies)
        page = ids[:limit]
        return retriever_pb2.ListDocumentsResponse(
            ids=page,
            next_cursor=page[-1] if more and page else "",
            version=sum(reply.version for reply in replies),
        )

    async def healthy(self) -> bool:
        return all((await self.shard_health()).values())

    async def shard_health(self) -> dict[str, bool]:
        """Each shard's health by its configured address."""
        states = await asyncio.gather(*(shard.healthy() for shard in self.shards))
        return {shard.addr: ok for shard, ok in zip(self.shards, states, strict=True)}

    async def close(self) -> None:
        for shard in self.shards:
            await shard.close()
