"""``openbook docs``: the documents API of a running gateway (docs/api.md, "Documents").

Every command is one or more HTTP calls to the gateway (``--url``); writes send the admin
token (``OPENBOOK_ADMIN_TOKEN``) as the bearer token. The gateway checks every field: this
module only shapes requests and reads replies, and a refusal comes back as a
:class:`DocsError` carrying the gateway's status and detail.

Loading a JSONL file (``openbook docs put INDEX FILE.jsonl``): one document per line
(``{"id", "title", "text", "metadata"?}``), sent in batches (one version each, all or nothing)
of at most ``batch_size`` documents and ``max_batch_bytes`` bytes, with a progress bar.
Resumable by line: a run that stops (a refused batch, a lost connection) says how many lines
were acknowledged, and ``--start N`` skips that many; since a put replaces a document of the
same id, sending a batch twice leaves the same documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from tqdm import tqdm

# Leaves room under the gateway's OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES default (32 MiB).
DEFAULT_BATCH_BYTES = 8 * 1024 * 1024
DEFAULT_BATCH_SIZE = 100


class DocsError(RuntimeError):
    """The gateway refused a call (or could not be reached); ``acknowledged``: JSONL lines
    written before it (``--start`` resumes after them)."""

    def __init__(self, message: str, acknowledged: int | None = None) -> None:
        super().__init__(message)
        self.acknowledged = acknowledged


@dataclass(frozen=True)
class GatewayTarget:
    """Where the gateway is and how to talk to it."""

    url: str
    admin_token: str | None = None
    timeout_s: float = 300.0

    def endpoint(self, *parts: str) -> str:
        # Every part is one path segment: an id holding '?' or '%' stays in its segment.
        return self.url.rstrip("/") + "/" + "/".join(quote(part, safe=":") for part in parts)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}


@dataclass(frozen=True)
class BatchOptions:
    """How a JSONL file is sent: documents and bytes per batch, and lines to skip."""

    batch_size: int = DEFAULT_BATCH_SIZE
    max_batch_bytes: int = DEFAULT_BATCH_BYTES
    start: int = 0  # lines already acknowledged by an earlier run

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {self.batch_size}")
        if self.start < 0:
            raise ValueError(f"start must be at least 0, got {self.start}")


def call(
    target: GatewayTarget,
    method: str,
    path: tuple[str, ...],
    body: Any = None,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One call; the reply's JSON body, or :class:`DocsError` naming the status and detail."""
    try:
        reply = httpx.request(
            method,
            target.endpoint(*path),
            json=body,
            params=params,
            headers=target.headers(),
            timeout=target.timeout_s,
        )
    except httpx.HTTPError as exc:
        raise DocsError(f"gateway unreachable at {target.url}: {exc}") from None
    if reply.status_code >= 400:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        raise DocsError(f"HTTP {reply.status_code}: {_readable(detail)}")
    result: dict[str, Any] = reply.json()
    return result


def _readable(detail: Any) -> str:
    """A 422's list of errors as 'field: message' lines; anything else as it is."""
    if isinstance(detail, list):
        lines = []
        for error in detail:
            if isinstance(error, dict):
                where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
                lines.append(f"{where}: {error.get('msg', '')}")
        return "; ".join(lines) or str(detail)
    return str(detail)


def create_index(target: GatewayTarget, name: str, index_type: str | None, like: str | None):
    body: dict[str, Any] = {"name": name}
    if index_type:
        body["type"] = index_type
    if like:
        body["like"] = like
    return call(target, "POST", ("indexes",), body)


def put_document(
    target: GatewayTarget,
    index: str,
    doc_id: str,
    title: str,
    text: str,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"title": title, "text": text}
    if metadata is not None:
        body["metadata"] = metadata
    return call(target, "PUT", ("indexes", index, "documents", doc_id), body)


def remove_document(target: GatewayTarget, index: str, doc_id: str) -> dict[str, Any]:
    return call(target, "DELETE", ("indexes", index, "documents", doc_id))


def get_document(target: GatewayTarget, index: str, doc_id: str) -> dict[str, Any]:
    return call(target, "GET", ("indexes", index, "documents", doc_id))


def list_documents(
    target: GatewayTarget, index: str, cursor: str | None, limit: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if cursor:
        params["cursor"] = cursor
    if limit is not None:
        params["limit"] = limit
    return call(target, "GET", ("indexes", index, "documents"), params=params)


def read_jsonl(path: Path, start: int = 0) -> Iterator[tuple[int, dict[str, Any], int]]:
    """``(line number, document, its size in bytes)`` of each line after the first ``start``;
    blank lines count as lines but hold nothing. A line that is not a JSON object is a
    :class:`DocsError` naming it."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if number <= start or not raw.strip():
                continue
            try:
                document = json.loads(raw)
            except ValueError as exc:
                raise DocsError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(document, dict):
                raise DocsError(f"{path}:{number}: not a JSON object")
            yield number, document, len(raw)


def batches(
    documents: Iterator[tuple[int, dict[str, Any], int]], options: BatchOptions
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(last line number, documents)`` batches of at most ``batch_size`` documents and
    ``max_batch_bytes`` bytes (a single larger document goes alone: the gateway judges it)."""
    batch: list[dict[str, Any]] = []
    size, last = 0, 0
    for number, document, nbytes in documents:
        if batch and (len(batch) >= options.batch_size or size + nbytes > options.max_batch_bytes):
            yield last, batch
            batch, size = [], 0
        batch.append(document)
        size += nbytes
        last = number
    if batch:
        yield last, batch


def put_file(
    target: GatewayTarget, index: str, path: Path, options: BatchOptions, progress: bool = True
) -> dict[str, Any]:
    """Load ``path`` (JSONL) into ``index`` in batches (module docstring). Returns
    ``{"index", "documents", "passages", "version", "lines"}``; a refused batch raises
    :class:`DocsError` whose ``acknowledged`` is the line to resume after."""
    total_lines = sum(1 for _ in path.open("rb"))
    written = passages = 0
    version = None
    acknowledged = options.start
    with tqdm(
        total=total_lines,
        initial=min(options.start, total_lines),
        unit="line",
        disable=not progress,
    ) as bar:
        try:
            for last, batch in batches(read_jsonl(path, options.start), options):
                body = {"documents": batch}
                reply = call(target, "POST", ("indexes", index, "documents:batch"), body)
                written += len(batch)
                passages += sum(reply["passages"])
                version = reply["version"]
                bar.update(last - acknowledged)
                acknowledged = last
        except DocsError as exc:
            raise DocsError(
                f"{exc} ({acknowledged} lines acknowledged: resume with --start {acknowledged})",
                acknowledged,
            ) from None
        bar.update(total_lines - acknowledged)
    return {
        "index": index,
        "documents": written,
        "passages": passages,
        "version": version,
        "lines": total_lines,
    }
