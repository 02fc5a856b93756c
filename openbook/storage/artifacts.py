"""Directories published atomically, with a manifest of every file's sha256.

Checkpoints (:mod:`openbook.storage.checkpoint`), indexes (:mod:`openbook.index.build`,
``importer``, ``shard``) and the demo's prepared models (``openbook_trainer.demo.models``) are all
written the same way, by the rules of this module (stdlib only, no torch):

1. **Build aside.** Every file is written into a hidden temporary sibling of the final
   directory (same parent, so the rename below never crosses a file system):
   :func:`staging_dir` makes a fresh one, ``.<name>.tmp-<machine>-<pid>-<8 hex>``, and holds an
   exclusive ``flock`` on it while the writer works; a build that resumes after an interruption
   (an index's hours of encoding) keeps a fixed :func:`partial_dir`, ``.<name>.partial``,
   guarded by a lock of its own.
2. **Checksum.** :func:`checksum_files` gives every file's sha256 and size; each kind of
   artifact records them in its own manifest format.
3. **Publish** (:func:`publish`), in this order: fsync every file; write the manifest(s)
   inside the temporary directory and fsync them; fsync every directory of the temporary
   tree; rename it to the final name (an existing version is first moved aside to a temporary
   name, and removed after); fsync the parent directory.

So a directory under its final name is always complete and carries its manifest, once the
rename is on disk it stays there, and a crash at any point before the rename leaves the
previous version (if any) untouched. What a crash leaves behind is a hidden sibling, which
:func:`clean_stale_partials` removes once no live writer can own it: one written on this
machine whose ``flock`` nobody holds (the kernel drops it when its writer dies, however it
dies), or, where the lock cannot tell (another machine on a shared volume, no ``flock``, an
old-style name), one untouched for ``max_age_s``; never one younger than ``grace_s``.

:func:`verify_files` checks files against the sizes and checksums a manifest recorded. Single
files (a ``latest`` pointer, a manifest rewritten in place) are replaced with
:func:`replace_file`: a temporary sibling, fsynced, ``os.replace``, parent fsynced.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
PARTIAL_SUFFIX = ".partial"
# ``.<name>.tmp-<machine>-<pid>-<8 hex>``; older versions wrote names without the machine.
# \Z, not $: "$" also matches before a trailing newline.
_TMP_OWNER = re.compile(r"\.tmp-(?P<machine>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]{8}\Z")
# A writer takes its lock right after creating its directory; younger entries are never
# judged by their lock, so that instant cannot make a live writer's directory look abandoned.
PARTIAL_GRACE_S = 30.0
# Where the lock says nothing (another machine on a shared volume, a file system without
# flock, a name without an owner), an entry untouched this long is abandoned.
PARTIAL_MAX_AGE_S = 24 * 3600.0


# ----------------------------------------------------------------------------- checksums


class FileDigest(NamedTuple):
    sha256: str
    size: int


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checksum_files(root: Path, *, exclude: Collection[str] = ()) -> dict[str, FileDigest]:
    """sha256 and size of every file under ``root`` by its ``/``-separated path relative to
    ``root`` (sorted), leaving out the relative paths in ``exclude``."""
    root = Path(root)
    out: dict[str, FileDigest] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            if rel not in exclude:
                out[rel] = FileDigest(sha256_file(p), p.stat().st_size)
    return out


@dataclass(frozen=True)
class FileProblem:
    """The first file :func:`verify_files` found wrong: ``kind`` is ``missing``, ``size`` or
    ``checksum``."""

    rel: str
    kind: str
    size: int | None = None  # found, for kind "size"
    expected_size: int | None = None

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"{self.rel} missing"
        if self.kind == "size":
            return f"{self.rel} size {self.size} != {self.expected_size} recorded in manifest"
        return f"{self.rel} checksum mismatch"


def verify_files(
    root: Path,
    *,
    sizes: Mapping[str, object] | None = None,
    sha256: Mapping[str, object] | None = None,
) -> FileProblem | None:
    """The first of the files under ``root`` that is missing or has another size than
    ``sizes`` or another sha256 than ``sha256`` records (``{relative path: value}``), or None
    when all agree. Sizes are checked first, all of them: it is cheap, hashing is not."""
    root = Path(root)
    for rel, size in sorted((sizes or {}).items()):
        f = root / rel
        if not f.is_file():
            return FileProblem(rel, "missing")
        found = f.stat().st_size
        if found != size:
            return FileProblem(rel, "size", found, size if isinstance(size, int) else None)
    for rel, digest in sorted((sha256 or {}).items()):
        f = root / rel
        if not f.is_file():
            return FileProblem(rel, "missing")
        if sha256_file(f) != digest:
            return FileProblem(rel, "checksum")
    return None


# ----------------------------------------------------------------------------- writing


# Hex digits of the digest that tells apart two directories of one name (public_name).
PUBLIC_DIGEST_HEX = 8


def public_name(name: str) -> str:
    """``name`` (a model or encoder version, an encoder's name) as a reply may show it: a
    filesystem path becomes its directory's name and the first hex digits of the path's
    SHA-256 (``all-MiniLM-L6-v2-squad-query-lora-1a2b3c4d``), stable for as long as the path
    is, distinct for two directories of one name, and telling no client where the models
    live (issue 42); any other name is returned as it is."""
    if "/" not in name and os.sep not in name and not name.startswith("~"):
        return name
    base = Path(name.rstrip("/" + os.sep)).name or "model"
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{base}-{digest[:PUBLIC_DIGEST_HEX]}"


@functools.lru_cache(maxsize=1)
def machine_tag() -> str:
    """This kernel: the Linux boot id (shared by every container on the machine, new after a
    reboot), else the host name. Only on the same kernel does a free flock prove a writer dead;
    pids alone cannot, since every container numbers its processes from 1."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        raw = socket.gethostname()
    return re.sub(r"[^A-Za-z0-9]", "", raw)[:32] or "unknown"


def temp_sibling(final: Path) -> Path:
    """A fresh hidden name beside ``final``: ``.<name>.tmp-<machine>-<pid>-<8 hex>``."""
    final = Path(final)
    tag = f"{machine_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return final.parent / f".{final.name}{TMP_MARK}{tag}"


def partial_dir(final: Path) -> Path:
    """The fixed temporary sibling of a resumable build: ``.<name>.partial``. Its writer must
    hold a lock of its own (two builds would share it), and it is never removed as stale."""
    final = Path(final)
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A new, empty :func:`temp_sibling` directory of ``final`` to build in, held under its
    writer's ``flock`` until the block ends (which tells :func:`clean_stale_partials` that it
    is in use); removed unless :func:`publish` moved it into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final)
    tmp.mkdir()
    lock = _hold_writer_lock(tmp)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def publish(
    staging: Path,
    final: Path,
    *,
    manifests: Mapping[str, str] | None = None,
    replace: bool = False,
    before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Move the finished ``staging`` directory to ``final`` by the rules in the module doc.

    ``manifests`` maps paths relative to ``staging`` to the text to write there after every
    other file is on disk (the manifest that checksums them; an index set has one per index).
    An existing ``final`` is replaced if ``replace``, else :class:`FileExistsError` is raised
    and ``staging`` is left as it is. ``before_rename`` (a test hook) is called with the
    complete staging directory. Returns ``final``.
    """
    staging, final = Path(staging), Path(final)
    _fsync_files(staging)
    for rel, text in (manifests or {}).items():
        write_durably(staging / rel, text)
    _fsync_dirs(staging)
    if before_rename is not None:
        before_rename(staging)
    aside = None
    if final.exists() or final.is_symlink():
        if not replace:
            raise FileExistsError(f"{final} already exists")
        # rename cannot replace a non-empty directory: move the old version out of the way
        aside = temp_sibling(final)
        final.rename(aside)
    try:
        staging.rename(final)
    except BaseException:
        if aside is not None:
            aside.rename(final)
        raise
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def replace_file(path: Path, text: str) -> None:
    """Replace the file ``path`` with ``text`` atomically and durably: readers see the old or
    the new content, never a mix, and after a crash it is one of the two."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        write_durably(tmp, text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries), where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def _fsync_files(root: Path) -> None:
    for p in Path(root).rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dirs(root: Path) -> None:
    root = Path(root)
    for p in sorted(root.rglob("*"), reverse=True):  # children before their parents
        if p.is_dir() and not p.is_symlink():
            fsync_dir(p)
    fsync_dir(root)


# ----------------------------------------------------------------------------- partial writes


def _hold_writer_lock(path: Path) -> int | None:
    """An exclusive flock on ``path``, held until the returned descriptor is closed (the kernel
    drops it when the writer dies, however it dies). None where the file system has no flock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def lock_is_free(path: Path) -> bool | None:
    """Whether no process holds ``path``'s flock; None when this cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # also releases the lock if it was taken
    return True


def _newest_mtime(path: Path) -> float:
    """The latest modification time of ``path`` and anything under it (links not followed)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for parent, dirs, files in os.walk(path):
            for entry in (*dirs, *files):
                try:
                    newest = max(newest, os.lstat(os.path.join(parent, entry)).st_mtime)
                except OSError:
                    continue  # removed while we looked
    return newest


def _is_abandoned(path: Path, now: float, grace_s: float, max_age_s: float) -> bool:
    idle = now - _newest_mtime(path)
    if idle < grace_s:
        return False
    owner = _TMP_OWNER.search(path.name)
    free = lock_is_free(path)
    if free is False:
        return False  # a live writer holds it
    if free and owner is not None and owner["machine"] == machine_tag():
        return True  # written on this kernel, whose writer would hold the lock if it lived
    # Another machine (a lock there may be invisible here), no flock, or an old-style name.
    return idle > max_age_s


def clean_stale_partials(
    root: Path,
    *,
    name: str | None = None,
    grace_s: float = PARTIAL_GRACE_S,
    max_age_s: float = PARTIAL_MAX_AGE_S,
) -> list[Path]:
    """Remove what killed writers left in ``root`` (``.<name>.tmp-*`` directories and files,
    of every name or only of ``name``); return what was removed.

    Safe beside live writers, also other processes writing into the same ``root``: an entry is
    removed when it was written on this machine and no process holds its writer lock, or,
    where the lock cannot tell (another machine, no flock, an old-style name), when nothing in
    it changed for ``max_age_s``. Entries younger than ``grace_s`` are always kept.
    """
    root = Path(root)
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    start = f".{name}{TMP_MARK}" if name is not None else "."
    removed = []
    now = time.time()
    for path in entries:
        if not (path.name.startswith(start) and TMP_MARK in path.name):
            continue
        try:
            if not _is_abandoned(path, now, grace_s, max_age_s):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue  # another cleaner (a second writer starting) was faster
        except OSError as exc:
            log.warning("cannot remove partial %s: %s", path, exc)
            continue
        log.info("removed partial %s left by an interrupted writer", path.name)
        removed.append(path)
    return removed
