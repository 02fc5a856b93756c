"""openbook's Model Context Protocol tools: retrieval, answers and the documents API for agents.

One implementation of each tool, served by the gateway at ``/mcp`` (streamable HTTP,
:mod:`openbook_gateway.routes.mcp`) and relayed over stdio by ``openbook mcp`` (which forwards
every call to a gateway's ``/mcp``, so the tools exist once, here). docs/api.md, "MCP".

Tools: ``search`` (passages with their scores), ``answer`` (the answer, its confidence and its
citations with their prior and posterior), ``list_indexes`` (read-only, ``readOnlyHint``);
``create_index``, ``put_document``, ``delete_document`` (``destructiveHint``), behind the admin
token.

Invariants:

* A tool works on the gateway's own :class:`~openbook_gateway.services.Services`, through the
  service layer the HTTP routes call too (``openbook_gateway.operations``,
  ``answering.answer_events``), never through an HTTP route's handler nor HTTP to itself: the
  same cache, limits, metrics and errors as ``/answer``.
* Arguments are validated as the HTTP API validates a body: strictly (``"5"`` is not an
  integer, ``"true"`` not a boolean) and with unknown arguments refused (:func:`strict_arguments`:
  each tool's argument model, the SDK's lax one otherwise, made ``STRICT_REQUEST``; its schema
  then says ``additionalProperties: false``), then by the request models of the HTTP API
  (``schemas``: the rules of ``openbook.validation.limits``). A bad argument, or anything the
  services refuse (an unknown index, an index without the asked retrieval view), is a tool error
  (``isError``) whose text names the argument; the session goes on. An unexpected failure
  is a tool error naming the request id, never a crashed session.
* A write tool runs only when the HTTP request that carries the call presents a key with the
  scope its HTTP route needs (``put_document``, ``delete_document``: ``write``, into an index
  the key may name; ``create_index``: ``indexes:create``; the admin token has both), as the
  door found it (``openbook_gateway.access``); without it, or with the admin API off (no
  ``OPENBOOK_ADMIN_TOKEN``), it is refused before anything is written. Each write tool's call
  is audited (``openbook_gateway.audit``), whatever its outcome. A key held to indexes
  names only those in every tool. Reaching ``/mcp`` at all is the door's to decide
  (:mod:`openbook_gateway.routes.mcp`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import ConfigDict, Field, ValidationError

from openbook.errors import InvalidArgument
from openbook.observability.logs import request_id_var
from openbook.types import document_id_of
from openbook.validation.limits import (
    MAX_K,
    DecodingMode,
    RetrievalMode,
    check_document_id,
    check_index_name,
    check_question,
)
from openbook_gateway import audit
from openbook_gateway.access import Refused, require_scope
from openbook_gateway.answering import AnswerOut, answer_events
from openbook_gateway.mapping import put_document_response
from openbook_gateway.operations import documents as document_operations
from openbook_gateway.operations import indexes as index_operations
from openbook_gateway.operations import search as search_operations
from openbook_gateway.operations.caller import Caller, caller_of
from openbook_gateway.operations.documents import NewDocument
from openbook_gateway.principal import INDEXES_CREATE, WRITE
from openbook_gateway.schemas import (
    STRICT_REQUEST,
    AnswerRequest,
    CreateIndexRequest,
    DocumentBody,
)
from openbook_gateway.services import Services, get_services

log = logging.getLogger(__name__)

SERVER_NAME = "openbook"
INSTRUCTIONS = (
    "openbook answers questions from the passages it retrieves from its indexes (Retrieval-"
    "Augmented Generation). Use `search` to find passages, `answer` for an answer with its "
    "citations and confidence, `list_indexes` to see which indexes exist. The write tools "
    "(`create_index`, `put_document`, `delete_document`) need a key with the scope to write "
    "(or the admin token)."
)

READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False, openWorldHint=False)
# put_document replaces a document of the same id and delete_document removes one: both
# destroy what was there. create_index destroys nothing (an existing name is refused) but
# changes the deployment, so it is not read-only either.
DESTRUCTIVE = ToolAnnotations(
    readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=False
)
ADDITIVE = ToolAnnotations(
    readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=False
)

# The arguments' types and bounds, for the tools' input schemas; the rules themselves are the
# request models' (schemas), which every call is validated by.
Query = Annotated[str, Field(description="the question or keywords to search for")]
K = Annotated[int, Field(ge=1, le=MAX_K, description="how many passages")]
OptionalK = Annotated[
    int | None,
    Field(ge=1, le=MAX_K, description="passages to answer from; default: the model's n_docs"),
]
IndexArg = Annotated[
    str | None, Field(description="the index to use (list_indexes); default: the active one")
]
Retrieval = Annotated[
    RetrievalMode | None,
    Field(description="'dense', 'bm25' or 'hybrid'; default: the index's default_retrieval"),
]
FilterArg = Annotated[
    dict[str, Any] | None,
    Field(
        description='only passages whose document\'s metadata matches: {"lang": "en"}, '
        '{"year": {"$in": [2016, 2018]}}, {"$and": [...]}, {"$or": [...]}; built-in keys '
        "_id (document id) and _title. Nothing matching: no passages"
    ),
]


class _Call:
    """What a tool call works with: the HTTP request that carried it, the gateway's services,
    its caller (the principal the door found for that request) and the request id (logged,
    sent to the services, and named by an unexpected failure)."""

    def __init__(self, ctx: Context) -> None:
        request = ctx.request_context.request
        if not isinstance(request, Request):
            # Only the gateway's /mcp serves these tools (stdio relays to it).
            raise ToolError("openbook's tools run in the gateway: connect to its /mcp")
        self.request = request
        self.caller: Caller = caller_of(request)
        self.request_id = self.caller.request_id  # set by middleware.RequestContext
        # The tool runs in the MCP session's task, outside the HTTP request's log context.
        request_id_var.set(self.request_id)

    async def services(self) -> Services:
        return await get_services(self.request)

    async def write(
        self,
        tool: str,
        scope: str,
        index: str | None,
        work: Callable[[Services], Coroutine[Any, Any, dict]],
        **fields: Any,
    ) -> dict:
        """Run a write tool's ``work`` on the services if the carrying request's key may
        (:meth:`require`), its audit line logged whatever the outcome
        (``openbook_gateway.audit``)."""
        services = await self.services()
        principal = self.caller.principal
        if index is not None:
            fields["index"] = index
        try:
            self.require(scope, services, index)
        except ToolError as exc:
            audit.tool(principal, tool, "refused", str(exc), **fields)
            raise
        try:
            result = await work(services)
        except (HTTPException, RequestValidationError) as exc:
            status = exc.status_code if isinstance(exc, HTTPException) else 422
            error = _service_error(exc, self)
            audit.tool(principal, tool, audit.outcome(status), str(error), **fields)
            raise error from None
        audit.tool(principal, tool, "ok", **fields)
        return result

    def require(self, scope: str, services: Services, index: str | None = None) -> None:
        """The carrying request's key has ``scope`` (``write``, ``admin``: as the HTTP route
        the tool stands for needs) and may name ``index``, or a refusal before anything is
        done (``openbook_gateway.access``)."""
        try:
            principal = require_scope(self.request, scope, services)
        except Refused as refused:
            raise ToolError(refused.message) from None
        if index is not None and not principal.sees(index):
            raise ToolError(principal.unknown_index(index))


def _argument_errors(exc: ValidationError, renamed: dict[str, str] | None = None) -> ToolError:
    """A request model's refusal as a tool error naming each bad argument (``renamed`` maps a
    model's field to the tool's argument where they differ)."""
    renamed = renamed or {}
    parts = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        if loc:
            loc[0] = renamed.get(loc[0], loc[0])
        where = ".".join(loc) or "arguments"
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return ToolError("invalid argument: " + "; ".join(parts))


@contextmanager
def _checked_arguments(renamed: dict[str, str] | None = None) -> Iterator[None]:
    """Run a tool's checks of its arguments: what they refuse (a limits rule, or a request
    model) becomes a tool error naming the bad argument (``renamed``: :func:`_argument_errors`).
    """
    try:
        yield
    except InvalidArgument as exc:
        raise ToolError(f"invalid argument: {exc}") from None
    except ValidationError as exc:
        raise _argument_errors(exc, renamed) from None


def _service_error(exc: HTTPException | RequestValidationError, call: _Call) -> ToolError:
    """What the services refused, as a tool error: their text names the argument (the
    retriever's ``index: unknown index ...``); a failure names the request id."""
    if isinstance(exc, RequestValidationError):
        parts = [
            f"{error['loc'][-1]}: {error.get('msg', 'invalid')}" for error in exc.errors() if error
        ]
        return ToolError("invalid argument: " + "; ".join(parts))
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code >= 500:
        return ToolError(f"{detail} (request {call.request_id})")
    return ToolError(detail)


async def search(
    ctx: Context,
    query: Query,
    k: K = 5,
    index: IndexArg = None,
    retrieval: Retrieval = None,
    filter: FilterArg = None,
) -> dict[str, Any]:
    """The k passages of an index most relevant to a query, best first, with their scores
    (the retrieval mode's: inner product for dense, BM25, or the fitted hybrid score); with
    ``filter``, the k best among those whose document's metadata matches."""
    call = _Call(ctx)
    with _checked_arguments({"question": "query"}):
        check_question("query", query)  # /answer's rule for a question, named as here
        # The same rules as /answer's k, index, retrieval and filter.
        body = AnswerRequest(question=query, k=k, index=index, retrieval=retrieval, filter=filter)
    services = await call.services()
    try:
        # the index a key may name, its tenant filter AND the argument's (issue 43)
        retrieved = await search_operations.search(services, call.caller, body)
    except HTTPException as exc:
        raise _service_error(exc, call) from None
    return {
        "index": retrieved.index,
        "index_version": retrieved.index_version,
        "retrieval": retrieved.retrieval or None,
        "passages": [
            {
                "rank": rank,
                "id": p.id,
                "document": document_id_of(p.id),
                "title": p.title,
                "page": p.page or None,  # an uploaded PDF's passage: its page
                "text": p.text,
                "score": p.score,
            }
            for rank, p in enumerate(retrieved.results[0].passages, start=1)
        ],
        "request_id": call.request_id,
    }


async def answer(
    ctx: Context,
    question: Annotated[str, Field(description="the question to answer")],
    k: OptionalK = None,
    index: IndexArg = None,
    retrieval: Retrieval = None,
    filter: FilterArg = None,
    decoding: Annotated[
        DecodingMode, Field(description="'rag-token', 'rag-sequence-thorough' or -fast")
    ] = "rag-token",
    min_confidence: Annotated[
        float | None,
        Field(
            ge=0,
            le=1,
            description="abstain (empty answer) below this confidence; default: the server's",
        ),
    ] = None,
) -> dict[str, Any]:
    """An answer from the passages retrieved for the question, with its confidence (in [0,
    1]; whether it abstained) and its citations: the passages it was computed from, each
    with its retrieval score, prior p(z|x) and posterior p(z|x,y)."""
    call = _Call(ctx)
    with _checked_arguments():
        body = AnswerRequest(
            question=question,
            k=k,
            index=index,
            retrieval=retrieval,
            filter=filter,
            decoding=decoding,
            min_confidence=min_confidence,
        )
    services = await call.services()
    try:
        async for event in answer_events(body, services, call.caller, stream=False):
            if isinstance(event, AnswerOut):
                return _answer_out(event.body)
    except HTTPException as exc:
        raise _service_error(exc, call) from None
    raise ToolError(f"no answer (request {call.request_id})")  # answer_events ends with one


def _answer_out(body: dict) -> dict[str, Any]:
    """The tool's view of an ``AnswerResponse``: what an agent reads and cites."""
    return {
        "answer": body["answer"],
        "confidence": body.get("confidence"),
        "abstained": body.get("abstained", False),
        "citations": [
            {
                "n": n,
                "id": p["id"],
                "document": p.get("document"),
                "title": p["title"],
                "page": p.get("page"),
                "text": p["text"],
                "score": p["score"],
                "prior": p.get("prior"),
                "posterior": p.get("posterior"),
            }
            for n, p in enumerate(body["passages"], start=1)
        ],
        "index": body["index"],
        "index_version": body.get("index_version", 0),
        "decoding": body["decoding"],
        "cached": body["cached"],
        "request_id": body["request_id"],
    }


async def list_indexes(ctx: Context) -> dict[str, Any]:
    """The indexes the retriever has: which is active, their sizes, encoders, retrieval views
    and versions, and whether each loads (``problem``)."""
    call = _Call(ctx)
    services = await call.services()
    try:
        # IndexOut models in a dict: plain JSON, as the HTTP route's response is
        return jsonable_encoder(await index_operations.list_indexes(services, call.caller))
    except HTTPException as exc:
        raise _service_error(exc, call) from None


async def create_index(
    ctx: Context,
    name: Annotated[str, Field(description="the new index's name")],
    type: Annotated[
        str | None,
        Field(description="'flat', 'hnsw', 'hnsw-sq8', 'ivfpq' or 'bm25'; default: like's"),
    ] = None,
    like: Annotated[
        str | None, Field(description="an index whose encoders and type the new one takes")
    ] = None,
) -> dict[str, Any]:
    """Create an empty live index that documents can be written to (a key with
    ``indexes:create``, or the admin token)."""
    call = _Call(ctx)
    with _checked_arguments():
        body = CreateIndexRequest(name=name, type=type, like=like)
    return await call.write(
        "create_index",
        INDEXES_CREATE,
        None,
        lambda services: index_operations.create_index(services, call.caller, body),
        name=name,
    )


async def put_document(
    ctx: Context,
    index: Annotated[str, Field(description="the index to write to")],
    doc_id: Annotated[str, Field(description="the document's id (replaces one of that id)")],
    text: Annotated[str, Field(description="the document's text, split into passages")],
    title: Annotated[str, Field(description="the document's title")] = "",
    metadata: Annotated[
        dict[str, Any] | None,
        Field(description="a flat map of scalars stored with the document"),
    ] = None,
) -> dict[str, Any]:
    """Insert or replace one document (admin token): split into passages and embedded,
    searchable and answered from once this returns."""
    call = _Call(ctx)
    with _checked_arguments():
        check_index_name("index", index)
        check_document_id("doc_id", doc_id)
        body = DocumentBody(title=title, text=text, metadata=metadata)
    return await call.write(
        "put_document",
        WRITE,
        index,
        lambda services: _put_document(services, call.caller, index, doc_id, body),
        ids=[doc_id],
    )


async def delete_document(
    ctx: Context,
    index: Annotated[str, Field(description="the index to delete from")],
    doc_id: Annotated[str, Field(description="the document's id")],
) -> dict[str, Any]:
    """Delete one document (admin token): its passages are never served once this returns."""
    call = _Call(ctx)
    with _checked_arguments():
        check_index_name("index", index)
        check_document_id("doc_id", doc_id)
    return await call.write(
        "delete_document",
        WRITE,
        index,
        lambda services: _delete_document(services, call.caller, index, doc_id),
        ids=[doc_id],
    )


async def _put_document(
    services: Services, caller: Caller, index: str, doc_id: str, body: DocumentBody
) -> dict:
    document = NewDocument(doc_id, body.title, body.text, body.metadata)
    reply = await document_operations.write(services, caller, index, [document])
    return put_document_response(index, doc_id, reply)


async def _delete_document(services: Services, caller: Caller, index: str, doc_id: str) -> dict:
    reply = await document_operations.delete(services, caller, index, doc_id)
    return {"version": reply.version}


def build_server() -> MCPServer:
    """The MCP server with openbook's tools (a new one per app: it holds session state)."""
    server: MCPServer = MCPServer(SERVER_NAME, instructions=INSTRUCTIONS, version="0.1.0")
    server.add_tool(search, title="Search passages", annotations=READ_ONLY)
    server.add_tool(answer, title="Answer a question", annotations=READ_ONLY)
    server.add_tool(list_indexes, title="List indexes", annotations=READ_ONLY)
    server.add_tool(create_index, title="Create an index", annotations=ADDITIVE)
    server.add_tool(put_document, title="Write a document", annotations=DESTRUCTIVE)
    server.add_tool(delete_document, title="Delete a document", annotations=DESTRUCTIVE)
    strict_arguments(server)
    return server


def strict_arguments(server: MCPServer) -> None:
    """Make every tool's arguments as strict as an HTTP body (``schemas.STRICT_REQUEST``):
    the SDK builds each tool's argument model lax (``k: "5"`` read as 5) and ignoring unknown
    arguments (a misspelt ``filtr`` silently dropped); this swaps in a subclass that refuses
    both, which the SDK reports as a tool error naming the argument. A JSON string where a list
    or object belongs is still read as that JSON, before validation (the SDK does it for
    clients that send objects as strings)."""
    for tool in server._tool_manager.list_tools():
        metadata = tool.fn_metadata
        lax = metadata.arg_model
        config = ConfigDict(**{**lax.model_config, **STRICT_REQUEST})
        metadata.arg_model = type(lax.__name__, (lax,), {"model_config": config})
        tool.parameters = metadata.arg_model.model_json_schema(by_alias=True)
