"""Uploading a file into a live index: ``POST /indexes/{index}/documents`` (issue 33;
docs/api.md, "Uploading files").

The file's text is extracted here (``openbook_gateway.extraction``: plain text, Markdown, HTML,
PDF), then written as one document through the documents API's path (the retriever's
``PutDocuments``, the shard ``crc32(id) mod n`` picks), so an upload answers as a ``PUT`` does.

Invariants:
  * Behind the ``write`` scope (``openbook_gateway.access``: a key with it, or the admin
    token), checked before the body is read (the form is parsed by the handler, not by
    FastAPI's parameters, which would read it before any dependency runs); a key held to
    indexes gets a 404 for any other.
  * The body is bounded while it streams: ``BodySizeLimit`` cuts any body under ``/indexes/``
    past ``OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES`` with a 413, before the form is whole.
  * Extraction is bounded (``ExtractionLimits``: a deadline, PDF work budgets) and stops once
    the client goes away (a watcher sets its cancel event); a client gone by the end of the
    extraction gets nothing written (answered 499, which nobody reads but the log).
  * Every refusal comes before the write, so a refused file leaves the index unchanged: a bad
    form field is a 422 naming it (``id``, ``title``, ``metadata``, ``file``); a file that
    gives no document a 415 (not a type openbook reads, by content), 413 (past the limits) or
    422 (unreadable, encrypted, no text layer, no text), its message naming the reason.
  * Without an ``id`` the document's is ``sha256-`` and the first 32 hex digits of the file's
    SHA-256: uploading the same bytes again replaces the same document (idempotent), and
    ``openbook docs upload`` knows the id of a file before sending it. The document's metadata
    holds the client's keys and the upload's facts, which win over them: ``sha256`` (the
    whole digest), ``source`` (the file's name), ``type`` and, for a PDF, ``pages`` and
    ``page_words`` (how its passages are cut page by page, and so their pages). Only the
    upload says where pages are: a client's ``page_words`` is refused (422 naming it; kept, it
    made a plain-text file cite pages it does not have, issue 42).
  * The extracted text must hold a visible character
    (``openbook.validation.limits.check_document_text``, the documents API's rule): a file of only
    bidi controls and zero-width spaces is a 422.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from openbook.errors import InvalidArgument
from openbook.validation.limits import (
    PAGE_WORDS_KEY,
    check_document_id,
    check_document_text,
    check_document_title,
    check_metadata,
)
from openbook_gateway import audit
from openbook_gateway.extraction import (
    CANCELLED_STATUS,
    Extracted,
    ExtractionError,
    ExtractionLimits,
    clean_title,
    extract,
)
from openbook_gateway.mapping import put_document_response
from openbook_gateway.operations import documents as operations
from openbook_gateway.operations.caller import caller_of
from openbook_gateway.operations.documents import NewDocument
from openbook_gateway.routes.documents import IndexName
from openbook_gateway.schemas import UploadForm, UploadResponse, multipart_body
from openbook_gateway.services import ServicesDep

log = logging.getLogger(__name__)

# How often the client's connection is looked at while its file is read.
DISCONNECT_POLL_S = 0.25
# The form's fields (schemas.UploadForm, which the OpenAPI document shows); anything else is
# refused, naming it.
FORM_FIELDS = tuple(UploadForm.model_fields)
CONTENT_ID_PREFIX = "sha256-"
CONTENT_ID_HEX = 32

router = APIRouter()


def content_id(digest: str) -> str:
    """The id a file gets when the form names none, from its SHA-256 (hex)."""
    return CONTENT_ID_PREFIX + digest[:CONTENT_ID_HEX]


def _refused(name: str, message: str, value: Any = None) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", name), "msg": message, "input": value}]
    )


def _text_field(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refused(name, f"{name} must be a text field, not a file")
    return value


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` once the client has gone, so a long extraction stops at its next check."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancel.set()


def _metadata(raw: str | None) -> dict[str, Any]:
    """The form's ``metadata``: a JSON object of scalars, or a 422 naming it."""
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise _refused("metadata", f"metadata is not JSON: {exc}", raw[:200]) from None
    try:
        check_metadata("metadata", value)
    except InvalidArgument as exc:
        raise _refused("metadata", str(exc), raw[:200]) from None
    if PAGE_WORDS_KEY in value:
        raise _refused(
            "metadata",
            f"metadata.{PAGE_WORDS_KEY} is the upload's own (a PDF's words per page, which cut "
            "its passages page by page): leave it out",
            raw[:200],
        )
    return value


def _document_metadata(
    given: dict[str, Any], extracted: Extracted, digest: str, filename: str
) -> dict[str, Any]:
    metadata = {**given, "sha256": digest, "source": clean_title(filename), "type": extracted.kind}
    if extracted.page_words:
        metadata["pages"] = extracted.pages
        metadata[PAGE_WORDS_KEY] = ",".join(str(words) for words in extracted.page_words)
    try:
        check_metadata("metadata", metadata)
    except InvalidArgument as exc:
        # Past the limits only with what the upload adds (a PDF's page map, or keys): say so.
        raise HTTPException(413, f"file: its metadata is too large to keep: {exc}") from None
    return metadata


@router.post(
    "/indexes/{index}/documents",
    response_model=UploadResponse,
    # FastAPI would describe File/Form parameters itself, but it reads such a form before any
    # dependency runs, so before the door (access.check_access): a client without a key could
    # make it spool a whole body. The handler parses the form after the door; the body's schema
    # is generated from the form's model.
    openapi_extra=multipart_body(UploadForm),
)
async def upload_document(index: IndexName, request: Request, services: ServicesDep) -> dict:
    """Upload one file (multipart: ``file``, optional ``id``, ``title``, ``metadata`` JSON):
    its text extracted, written as one document, searchable once this answers."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise HTTPException(415, "body: send the file as multipart/form-data, in the field 'file'")
    try:
        form = await request.form(max_files=1, max_fields=len(FORM_FIELDS))
    except HTTPException:
        raise  # BodySizeLimit's 413, raised while the form streamed in
    except Exception as exc:  # noqa: BLE001 - python-multipart's errors on a broken form
        raise HTTPException(400, f"body: not a readable multipart form: {exc}") from None
    try:
        return await _upload(index, form, request, services)
    finally:
        await form.close()


async def _upload(index: str, form: Any, request: Request, services: ServicesDep) -> dict:
    for name in form:
        if name not in FORM_FIELDS:
            raise _refused(name, f"{name} is not a field of an upload ({', '.join(FORM_FIELDS)})")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise _refused("file", "file is required: the file to upload, as a form file field")
    doc_id = _text_field(form, "id")
    title = _text_field(form, "title")
    try:
        if doc_id is not None:
            check_document_id("id", doc_id)
        if title is not None:
            check_document_title("title", title)
    except InvalidArgument as exc:
        name = str(exc).split(" ", 1)[0]
        raise _refused(name, str(exc)) from None
    given = _metadata(_text_field(form, "metadata"))
    data = await upload.read()
    filename = upload.filename or "upload"
    limits = ExtractionLimits(
        max_pages=services.settings.upload_max_pages,
        max_seconds=services.settings.upload_max_seconds,
    )
    cancel = threading.Event()
    watcher = asyncio.create_task(_watch_disconnect(request, cancel))
    try:
        # CPU-bound (a PDF's pages, an HTML parse): off the event loop.
        extracted = await run_in_threadpool(extract, data, filename, limits, cancel)
    except ExtractionError as exc:
        if exc.status == 422:
            raise _refused("file", str(exc), filename) from None
        raise HTTPException(exc.status, str(exc)) from None
    finally:
        watcher.cancel()
    if cancel.is_set() or await request.is_disconnected():
        log.info("upload of %s into %s: the client went away, nothing written", filename, index)
        raise HTTPException(
            CANCELLED_STATUS, "file: the client went away while it was read; nothing was written"
        )
    try:
        check_document_text("file", extracted.text)
    except InvalidArgument as exc:
        raise _refused("file", f"{exc} (the text of {filename[:100]!r})", filename) from None
    digest = hashlib.sha256(data).hexdigest()
    doc_id = doc_id or content_id(digest)
    # The form's title, else the document's own, else the file's name.
    title = title or extracted.title or clean_title(filename)
    metadata = _document_metadata(given, extracted, digest, filename)
    audit.note(request, ids=[doc_id])
    # a tenant's fields stamped in (issue 43), and never over another tenant's document
    document = NewDocument(doc_id, title, extracted.text, metadata, id_field="id")
    reply = await operations.write(services, caller_of(request), index, [document])
    log.info(
        "uploaded %s into %s: %s, %d characters", doc_id, index, extracted.kind, len(document.text)
    )
    return {
        **put_document_response(index, doc_id, reply),
        "title": title,
        "type": extracted.kind,
        "pages": extracted.pages or None,
        "sha256": digest,
    }
