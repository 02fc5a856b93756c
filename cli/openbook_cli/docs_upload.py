"""``openbook docs upload INDEX PATH...``: files, directories (recursively) and zip / tar
archives into a live index, one ``POST /indexes/{index}/documents`` per file (docs/api.md,
"Uploading files"), with a progress bar.

Invariants:
  * Resumable: a file's id is its content's (``sha256-`` and 32 hex digits of its SHA-256, as
    the gateway gives a file without an id), and a file whose document is already in the
    index with the same ``sha256`` in its metadata is skipped without being sent. A run that
    stops is resumed by running it again.
  * Archives are unpacked here, never by the gateway, within :class:`ArchiveLimits`: at most
    ``max_members`` files, none past ``max_file_bytes`` and all together at most
    ``max_total_bytes`` once decompressed, counted on the bytes actually read (a zip's
    declared sizes are not trusted), so a zip bomb is refused, naming the archive, after
    reading at most the limits. Archives inside archives are not unpacked (they are sent, and
    the gateway refuses them by content).
  * A file the gateway refuses (4xx) is reported and the others go on; the run fails (exit 1)
    at the end if any was refused. An unreachable gateway or a 5xx stops the run at once.
  * Hidden files and directories (a name starting with ".") are skipped.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm import tqdm

from openbook_cli.docs import DocsError, GatewayTarget

CONTENT_ID_PREFIX = "sha256-"  # as the gateway's (openbook_gateway.routes.uploads)
CONTENT_ID_HEX = 32
ZIP_SUFFIXES = (".zip",)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
READ_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what one archive may unpack to (a zip bomb stops at them)."""

    max_members: int = 10_000
    # The gateway's default OPENBOOK_GATEWAY_MAX_DOCUMENT_BODY_BYTES: a larger file would be
    # refused anyway.
    max_file_bytes: int = 32 * 1024 * 1024
    max_total_bytes: int = 1024 * 1024 * 1024


@dataclass(frozen=True)
class Source:
    """One file to upload: its name (a path, or ``archive.zip!member``) and how to read it."""

    name: str
    read: Callable[[], bytes]


@dataclass
class UploadReport:
    uploaded: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    refused: list[dict[str, str]] = field(default_factory=list)

    def summary(self, index: str) -> dict[str, Any]:
        return {
            "index": index,
            "uploaded": len(self.uploaded),
            "skipped": len(self.skipped),
            "refused": self.refused,
            "passages": sum(reply.get("passages", 0) for reply in self.uploaded),
            "version": max((reply["version"] for reply in self.uploaded), default=None),
        }


def content_id(data: bytes) -> tuple[str, str]:
    """``(id, sha256 hex)`` of a file's bytes."""
    digest = hashlib.sha256(data).hexdigest()
    return CONTENT_ID_PREFIX + digest[:CONTENT_ID_HEX], digest


def _bounded_read(stream: IO[bytes], limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of ``stream``, or :class:`DocsError` once past them."""
    chunks, size = [], 0
    while chunk := stream.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise DocsError(f"{what}: unpacks past {limit} bytes (a zip bomb?): refused")
        chunks.append(chunk)
    return b"".join(chunks)


def _is_archive(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(ZIP_SUFFIXES) and zipfile.is_zipfile(path):
        return "zip"
    if name.endswith(TAR_SUFFIXES) and tarfile.is_tarfile(path):
        return "tar"
    return None


def _zip_sources(path: Path, limits: ArchiveLimits) -> list[Source]:
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.infolist() if not m.is_dir() and not _hidden(m.filename)]
    if len(members) > limits.max_members:
        raise DocsError(f"{path}: {len(members)} files, more than {limits.max_members}: refused")
    budget = [limits.max_total_bytes]

    def reader(member: zipfile.ZipInfo) -> Callable[[], bytes]:
        def read() -> bytes:
            with zipfile.ZipFile(path) as archive, archive.open(member) as stream:
                limit = min(limits.max_file_bytes, budget[0])
                data = _bounded_read(stream, limit, f"{path}!{member.filename}")
            budget[0] -= len(data)
            return data

        return read

    return [Source(f"{path}!{m.filename}", reader(m)) for m in members]


def _tar_sources(path: Path, limits: ArchiveLimits) -> list[Source]:
    # A tar's sizes are its headers' and its data is exactly that long: the declared total is
    # the decompressed total, checked before any file is read.
    with tarfile.open(path, "r:*") as archive:
        members: list[tarfile.TarInfo] = []
        for member in archive:
            if len(members) >= limits.max_members:
                raise DocsError(f"{path}: more than {limits.max_members} files: refused")
            if member.isfile() and not _hidden(member.name):
                members.append(member)
    total = sum(m.size for m in members)
    if total > limits.max_total_bytes or any(m.size > limits.max_file_bytes for m in members):
        raise DocsError(
            f"{path}: unpacks to {total} bytes, past the limits ({limits.max_file_bytes} a "
            f"file, {limits.max_total_bytes} in all): refused"
        )

    def reader(member: tarfile.TarInfo) -> Callable[[], bytes]:
        def read() -> bytes:
            with tarfile.open(path, "r:*") as archive:
                stream = archive.extractfile(member.name)
                if stream is None:
                    return b""
                return _bounded_read(stream, limits.max_file_bytes, f"{path}!{member.name}")

        return read

    return [Source(f"{path}!{m.name}", reader(m)) for m in members]


def _hidden(name: str) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in Path(name).parts)


def sources(paths: list[Path], limits: ArchiveLimits | None = None) -> list[Source]:
    """Every file under ``paths``, in order (a directory's sorted), archives unpacked."""
    limits = limits or ArchiveLimits()
    found: list[Source] = []
    for path in paths:
        if path.is_dir():
            files = sorted(
                p for p in path.rglob("*") if p.is_file() and not _hidden(str(p.relative_to(path)))
            )
        elif path.is_file():
            files = [path]
        else:
            raise DocsError(f"{path}: no such file or directory")
        for file in files:
            kind = _is_archive(file)
            if kind == "zip":
                found.extend(_zip_sources(file, limits))
            elif kind == "tar":
                found.extend(_tar_sources(file, limits))
            else:
                found.append(Source(str(file), file.read_bytes))
    return found


def _already_there(target: GatewayTarget, index: str, doc_id: str, digest: str) -> bool:
    try:
        reply = httpx.get(
            target.endpoint("indexes", index, "documents", doc_id), timeout=target.timeout_s
        )
    except httpx.HTTPError as exc:
        raise DocsError(f"gateway unreachable at {target.url}: {exc}") from None
    if reply.status_code == 404:
        return False
    if reply.status_code >= 400:
        raise DocsError(f"HTTP {reply.status_code}: {reply.text}")
    return bool(reply.json().get("metadata", {}).get("sha256") == digest)


def _send(
    target: GatewayTarget, index: str, name: str, data: bytes, metadata: dict[str, Any] | None
) -> dict[str, Any] | str:
    """The gateway's reply, or its refusal's detail (a 4xx) as a string."""
    form = {"metadata": json.dumps(metadata)} if metadata else {}
    try:
        reply = httpx.post(
            target.endpoint("indexes", index, "documents"),
            files={"file": (name, data)},
            data=form,
            headers=target.headers(),
            timeout=target.timeout_s,
        )
    except httpx.HTTPError as exc:
        raise DocsError(f"gateway unreachable at {target.url}: {exc}") from None
    if reply.status_code >= 500 or reply.status_code in (401, 403, 404):
        # Not this file's fault: the run cannot go on.
        raise DocsError(f"{name}: HTTP {reply.status_code}: {reply.text}")
    if reply.status_code >= 400:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        if isinstance(detail, list):
            detail = "; ".join(str(item.get("msg", item)) for item in detail)
        return f"HTTP {reply.status_code}: {detail}"
    result: dict[str, Any] = reply.json()
    return result


def upload(
    target: GatewayTarget,
    index: str,
    paths: list[Path],
    *,
    metadata: dict[str, Any] | None = None,
    limits: ArchiveLimits | None = None,
    progress: bool = True,
) -> UploadReport:
    """Upload every file under ``paths`` (the module's invariants)."""
    files = sources(paths, limits)
    report = UploadReport()
    with tqdm(total=len(files), unit="file", disable=not progress) as bar:
        for source in files:
            try:
                data = source.read()
            except (DocsError, OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
                report.refused.append({"file": source.name, "error": str(exc)})
                bar.update(1)
                continue
            doc_id, digest = content_id(data)
            if _already_there(target, index, doc_id, digest):
                report.skipped.append(source.name)
            else:
                reply = _send(target, index, source.name, data, metadata)
                if isinstance(reply, str):
                    report.refused.append({"file": source.name, "error": reply})
                else:
                    report.uploaded.append(reply)
            bar.set_postfix_str(Path(source.name).name[-30:], refresh=False)
            bar.update(1)
    return report
