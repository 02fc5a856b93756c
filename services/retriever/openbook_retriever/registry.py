"""The indexes a retriever can serve, which one is active, and safe swapping between them.

Every index directory under the index root (a directory holding a ``manifest.json``, hidden
ones aside) is available by name: its directory name, which is the index's identity everywhere
(replies, labels, cache keys, metrics), whatever the ``name`` in its manifest says. Requests
hold a lease on the index they started with, so a swap or unload never pulls an index from
under a running search: the index is closed only when its last lease ends.

Whether an available index can be loaded (:meth:`IndexRegistry.status`) is known without
loading it: a loaded index can; another must pass the cheap check of its directory
(``openbook.index.check_index``: manifest, files present at their sizes, file-list checksum)
and must not have failed its last load (which re-hashes every file) since its files last
changed. Listing never loads an index.

Two layouts are served, both writable (issue 32):
  * a *built* index (``manifest.json`` at its top, as ``openbook index build`` writes) is
    served as a :class:`LoadedIndex`, exactly as before, until its first write, which adopts
    it into the live layout in place (:meth:`IndexRegistry.writer`): the live index is made
    beside it (``.<name>.adopting``, a copy, published whole), then, under the registry's
    lock, the built directory is renamed away (``.<name>.retired-*``), the live one renamed
    to ``<name>`` and opened, and its entry replaces the built one's. Requests holding the
    built index keep it (its files are open, and its directory is removed only when its last
    lease ends); requests arriving meanwhile wait for the lock, none fails. A crash between
    the two renames is finished on the next start (:meth:`IndexRegistry.recover`).
  * a *live* index (``openbook.index.live``: ``base-<v>`` or ``template.json``, no top-level
    manifest) is served as a :class:`LiveIndex`; its identity, checks and listing are those of
    its base (or template).
Every replica (retriever process) sharing the index volume serves and writes every live
index: a write takes the index's writer lock (``openbook.index.writer_lock``) for its batch
only, catching up with the other replicas' writes under it first (``LiveIndex._commit``), so a
write through any replica succeeds and versions never collide. Before every request on a live
index, the lease brings it up to the disk (``LiveIndex.catch_up``: a few ``stat`` calls when
nothing changed, else the log's new records), so a request that starts after a write was
acknowledged by any replica sees it.

:class:`Registry` declares what the servicer asks of a registry, whichever engine holds the
indexes: :class:`IndexRegistry` here (files), ``milvus_registry.MilvusRegistry`` (Milvus).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from openbook.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from openbook.index import (
    IndexLoadError,
    LoadedIndex,
    Manifest,
    check_index_files,
    open_index,
    read_index_manifest,
)
from openbook.index.empty_base import TEMPLATE_FILE
from openbook.index.engine import DocumentIndex, EngineKind, SearchableIndex
from openbook.index.live import LiveIndex, LiveOptions, disk_stamp, is_live_index, newest_base
from openbook.validation.limits import check_index_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


# What a load attempt saw of an index directory: (relative path, size, mtime, inode) of its
# manifest and of every file the manifest lists. A file replaced or rewritten changes it.
Fingerprint = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True)
class IndexStatus:
    """What the registry knows of an available index without loading it."""

    name: str
    manifest: Manifest | None  # None: unreadable (``problem`` says why); else its fields
    problem: str  # why it cannot be loaded; "" when it can
    # Every file's checksum was verified: it loaded, and its files have not changed since.
    verified: bool

    @property
    def loadable(self) -> bool:
        return not self.problem


# What the registry serves: a built index as it was built, or a live one (module docstring).
ServedIndex = LoadedIndex | LiveIndex


class Registry(Protocol):
    """The indexes a retriever serves, whichever engine holds them (module docstring): what
    the servicer, the server and the compactor use, and all they use."""

    active: str | None
    # Called with an index before it becomes active; raising refuses the swap.
    before_activate: Callable[[SearchableIndex], None] | None
    # Which engine holds its indexes (ListIndexes says it for each).
    engine_kind: EngineKind

    def available(self) -> list[str]:
        """The indexes that can be named, sorted."""
        ...

    def vanished(self) -> list[str]:
        """The indexes removed out of band since the last call (the first call only looks)."""
        ...

    def status(self, name: str) -> IndexStatus: ...

    def manifest(self, name: str) -> Manifest: ...

    def live_state(self, name: str) -> tuple[int, int] | None:
        """(version, passages) of ``name`` where known without loading a files index."""
        ...

    def is_loaded(self, name: str) -> bool: ...

    def swap(self, name: str) -> tuple[str | None, SearchableIndex]: ...

    def lease(self, name: str | None = None) -> AbstractContextManager[SearchableIndex]:
        """Hold ``name`` (default: the active index) for one request, caught up with every
        write acknowledged anywhere."""
        ...

    def writer(self, name: str) -> AbstractContextManager[DocumentIndex]:
        """Hold ``name`` for one write."""
        ...

    def create(self, name: str, template: Manifest) -> None: ...

    def delete(self, name: str) -> None: ...

    def close(self) -> None: ...


_ADOPTING = ".{}.adopting"  # a built index's live copy, being made (adoption)
_RETIRED = ".{}.retired-"  # a directory renamed away (adopted or deleted), removed when unused


@dataclass
class _Entry:
    index: ServedIndex
    leases: int = 0
    retired: bool = False  # unloaded while leased: close when the last lease ends
    # A built index's directory as it was opened (_stamp), to tell another process adopted
    # it; None for a live index, which catches up by itself (LiveIndex.catch_up).
    stamp: tuple[object, ...] | None = None
    # The directory opened (_identity): one put in its place later is another index.
    identity: tuple[int, int] | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        self.index.close()
        for done in self.on_close:
            done()


class IndexRegistry:
    engine_kind = EngineKind.FILES

    def __init__(self, root: Path, max_loaded: int = 4) -> None:
        self.root = Path(root)
        self.max_loaded = max_loaded
        self._lock = threading.RLock()
        self._loaded: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._loading: dict[str, threading.Lock] = {}
        # The latest load of each index: the fingerprint it saw and its error ("" if it loaded).
        self._attempts: dict[str, tuple[Fingerprint, str]] = {}
        self._adopting: dict[str, threading.Lock] = {}
        # Each index directory's identity as :meth:`vanished` last saw it (None: not looked),
        # and which of them were built indexes then (their adoption is no replacement).
        self._known: dict[str, tuple[int, int]] | None = None
        self._known_built: set[str] = set()
        self.active: str | None = None
        self.recover()
        # Called with a loaded index before it becomes active; raising refuses the swap (the
        # retriever checks that some query encoder pairs with the index).
        self.before_activate: Callable[[SearchableIndex], None] | None = None

    def recover(self) -> None:
        """Finish what a crash interrupted: an adoption renamed halfway (its built directory
        renamed away, the live copy not yet in place) is completed; an unfinished copy and
        directories renamed away are removed."""
        if not self.root.is_dir():
            return
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") and p.name.endswith(".adopting") and p.is_dir():
                name = p.name[1 : -len(".adopting")]
                target = self.root / name
                if not target.exists() and is_live_index(p):
                    os.rename(p, target)
                    log.warning("index %s: finished an interrupted adoption", name)
                elif not _locked(self.root / f".{name}.adopt.lock"):
                    shutil.rmtree(p, ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith(".") and ".retired-" in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    # ---- discovery
    def available(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if not p.name.startswith(".") and ((p / MANIFEST).is_file() or is_live_index(p))
        )

    def vanished(self) -> list[str]:
        """The indexes whose directory was removed, or replaced by another one, out of band
        (``rm -rf``, a restore) since the last call or since this process loaded them; their
        loaded entries are retired, so no request is served from memory of an index that is
        gone. The first call only looks. An adoption (a built directory replaced by its live
        copy, here or by another replica, or one between its two renames) is not taken for a
        replacement."""
        seen: dict[str, tuple[int, int]] = {}
        live: set[str] = set()
        for name in self.available():
            with suppress(OSError):
                seen[name] = _identity(self.root / name)
                if not (self.root / name / MANIFEST).is_file():
                    live.add(name)
        gone: list[str] = []
        with self._lock:  # what was loaded counts as seen, however briefly it lived
            looked = {n: e.identity for n, e in self._loaded.items() if e.identity is not None}
        for name, identity in {**looked, **(self._known or {})}.items():
            now = seen.get(name)
            if now == identity:
                continue
            if now is not None and name in live and name in self._known_built:
                continue  # adopted: the same documents, now live
            if _locked(self.root / f".{name}.adopt.lock"):  # between its two renames
                seen.setdefault(name, identity)
                continue
            gone.append(name)
        with self._lock:
            for name in gone:
                entry = self._loaded.get(name)
                if entry is not None and entry.identity != seen.get(name):
                    self._retire(name, self._loaded.pop(name))
                    self._attempts.pop(name, None)
            self._known = seen
            self._known_built = set(seen) - live
        return gone

    def status(self, name: str) -> IndexStatus:
        """Whether ``name`` can be loaded, and why not (module docstring); loads nothing."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is not None:
                return IndexStatus(name, entry.index.manifest, "", verified=True)
            attempt = self._attempts.get(name)
        path = self.root / name
        manifest = None
        try:  # whatever fails here, it cannot be loaded
            check_index_name("index", name)
            path = _checked_dir(path)
            if path.name == TEMPLATE_FILE:  # a live index created empty: nothing to check
                return IndexStatus(name, Manifest.from_file(path), "", verified=True)
            manifest = read_index_manifest(path, name=name)
            check_index_files(path, manifest, name=name)
        except Exception as exc:  # noqa: BLE001 - the manifest's fields, if readable, still say what it is
            return IndexStatus(name, manifest, _described(exc), verified=False)
        if attempt is None or attempt[0] != _fingerprint(path, manifest):
            return IndexStatus(name, manifest, "", verified=False)  # not tried as it is now
        error = attempt[1]
        return IndexStatus(name, manifest, error, verified=not error)

    def manifest(self, name: str) -> Manifest:
        with self._lock:
            entry = self._loaded.get(name)
            if entry is not None:
                return entry.index.manifest
        checked = _checked_dir(self._path(name))
        return Manifest.from_file(checked if checked.name == TEMPLATE_FILE else checked / MANIFEST)

    def live_state(self, name: str) -> tuple[int, int] | None:
        """(version, passages) of ``name`` if it is loaded and live, as this process serves it
        now; None otherwise. Loads, leases and reopens nothing (a listing reads it)."""
        with self._lock:
            entry = self._loaded.get(name)
        if entry is None or not isinstance(entry.index, LiveIndex):
            return None
        return entry.index.version, len(entry.index)

    def is_live(self, name: str) -> bool:
        """Whether ``name`` has the live layout (else it is a built index)."""
        return is_live_index(self._path(name))

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def _path(self, name: str) -> Path:
        # Every name, an RPC's or the active index recorded in Redis, is checked here too.
        check_index_name("index", name)
        path = self.root / name
        if not (path / MANIFEST).is_file() and not is_live_index(path):
            known = ", ".join(self.available()) or "none"
            raise NotFound(f"index: unknown index {name!r} (available: {known})")
        return path

    # ---- loading
    def load(self, name: str) -> ServedIndex:
        """Load ``name`` (verifying it) unless already loaded. Concurrent loads share one."""
        with self._lock:
            entry = self._loaded.get(name)
            if entry is not None:
                self._loaded.move_to_end(name)
                return entry.index
            path = self._path(name)
            gate = self._loading.setdefault(name, threading.Lock())
        with gate:  # slow part outside the registry lock: other indexes keep serving
            with self._lock:
                if name in self._loaded:
                    return self._loaded[name].index
            log.info("loading index %s from %s", name, path)
            seen = _fingerprint_of(path)
            try:
                entry = _open(name, path, verify=True)
            except Exception as exc:
                with self._lock:
                    self._attempts[name] = (seen, _described(exc))
                raise
            with self._lock:
                self._attempts[name] = (seen, "")
                self._loaded[name] = entry
                self._loading.pop(name, None)
                self._evict_idle(keep=name)
            return entry.index

    def _behind(self, name: str, entry: _Entry) -> bool:
        """Whether ``entry``, a built index, is behind its directory: another process adopted
        it into the live layout (a live index catches up in place: :meth:`_acquire`)."""
        if entry.stamp is None:
            return False
        try:
            return _stamp(self.root / name) != entry.stamp
        except OSError:  # renamed or removed meanwhile: the next lookup says what it is now
            return False

    def _catch_up(self, name: str, behind: _Entry) -> None:
        """Serve ``name`` reopened as it is on disk now, in place of ``behind``. If it cannot
        be opened now, ``behind`` keeps serving (and is not retried until the disk changes
        again)."""
        with self._gate(name):
            with self._lock:
                if self._loaded.get(name) is not behind:
                    return  # caught up (or replaced) meanwhile
            try:
                entry = _open(name, self._path(name), verify=False)
            except Exception as exc:  # noqa: BLE001 - a race with the writer: serve what we have
                log.warning("index %s: cannot catch up with its directory now: %s", name, exc)
                with suppress(OSError):
                    behind.stamp = _stamp(self.root / name)
                return
            log.info("index %s caught up: %r", name, entry.index)
            self._replace(name, entry)

    def _retire(self, name: str, entry: _Entry) -> None:
        if entry.leases == 0:
            entry.close()
            log.info("index %s released", name)
        else:
            entry.retired = True

    def _evict_idle(self, keep: str | None = None) -> None:
        """Release least recently used indexes beyond ``max_loaded`` (never the active one,
        nor ``keep``, which a caller is about to use)."""
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if name not in (self.active, keep):
                self._retire(name, self._loaded.pop(name))

    # ---- serving
    def swap(self, name: str) -> tuple[str | None, ServedIndex]:
        """Make ``name`` active (loading it first); returns the previously active name.

        A corrupt or mismatched index fails to load, and one ``before_activate`` refuses
        is not activated: the current one keeps serving.
        """
        while True:
            index = self.load(name)
            if self.before_activate is not None:
                self.before_activate(index)  # refused: the current index keeps serving
            with self._lock:
                if name not in self._loaded:
                    continue  # evicted between loading and activating: load it again
                previous, self.active = self.active, name
                self._loaded.move_to_end(name)
                self._evict_idle()
                break
        if previous != name:
            log.info("active index %s -> %s", previous, name)
        return previous, index

    def _acquire(self, name: str | None) -> tuple[str, _Entry]:
        """A lease on ``name`` (default: the active index), loading it if need be, and
        reopening it first if another process changed it (:meth:`_behind`)."""
        while True:
            with self._lock:
                target = name or self.active
                if target is None:
                    raise FailedPrecondition("no active index: build one and swap to it")
                entry = self._loaded.get(target)
                if entry is not None:
                    entry.leases += 1
                    self._loaded.move_to_end(target)
            if entry is None:
                self.load(target)  # loaded on demand, then lease it on the next pass
            elif isinstance(entry.index, LiveIndex):
                try:  # what other replicas wrote, before this request reads
                    entry.index.catch_up()
                except FileNotFoundError:
                    self._release(target, entry)
                    if (self.root / target).exists():
                        raise
                    # Deleted (by another replica, or out of band): not served from memory.
                    with self._lock:
                        if self._loaded.get(target) is entry:
                            self._retire(target, self._loaded.pop(target))
                    raise NotFound(f"index: index {target!r} was removed") from None
                except BaseException:
                    self._release(target, entry)
                    raise
                return target, entry
            elif self._behind(target, entry):
                self._release(target, entry)
                self._catch_up(target, entry)
            else:
                return target, entry

    def _release(self, name: str, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            if entry.retired and entry.leases == 0:
                entry.close()
                log.info("index %s released", name)

    @contextmanager
    def lease(self, name: str | None = None) -> Iterator[ServedIndex]:
        """Hold ``name`` (default: the active index) for the duration of one request."""
        target, entry = self._acquire(name)
        try:
            yield entry.index
        finally:
            self._release(target, entry)

    # ---- writing
    @contextmanager
    def writer(self, name: str) -> Iterator[LiveIndex]:
        """Hold ``name`` for one write: a live index (each write takes its writer lock, module
        docstring). A built index is adopted first."""
        while True:
            target, entry = self._acquire(name)
            if isinstance(entry.index, LiveIndex):
                break
            self._release(target, entry)
            self._adopt(target)
        try:
            yield entry.index
        finally:
            self._release(target, entry)

    def _gate(self, name: str) -> threading.Lock:
        with self._lock:
            return self._adopting.setdefault(name, threading.Lock())

    def _adopt(self, name: str) -> None:
        """Make the built index ``name`` a live one in place (module docstring)."""
        with self._gate(name):
            path = self._path(name)
            if is_live_index(path):
                return  # adopted meanwhile
            # Across processes too: one adopts, the others find it live once it is done.
            with _exclusive(self.root / f".{name}.adopt.lock"):
                if is_live_index(path):
                    return
                staging = self.root / _ADOPTING.format(name)
                shutil.rmtree(staging, ignore_errors=True)  # a crashed try's copy
                log.info("index %s: adopting the built index into the live layout", name)
                LiveIndex.create(staging, from_index=path).close()  # verifies the copy
                retired = self.root / f"{_RETIRED.format(name)}{uuid.uuid4().hex[:8]}"
                with self._lock:  # requests wait here for the switch; none fails
                    os.rename(path, retired)
                    os.rename(staging, path)
                    try:
                        live = LiveIndex(path, LiveOptions(verify=False))
                    except BaseException:  # put the built index back as it was
                        os.rename(path, staging)
                        os.rename(retired, path)
                        raise
                    identity = _identity(path)
                    old = self._replace(
                        name,
                        _Entry(live, identity=identity),
                        lambda: _discard(retired),
                    )
                if old is None:
                    _discard(retired)
            log.info("index %s adopted: %r", name, live)

    def _replace(
        self, name: str, entry: _Entry, after_old: Callable[[], None] | None = None
    ) -> _Entry | None:
        """Serve ``entry`` as ``name``; the entry it replaces is retired (returned), and
        ``after_old`` runs once that one is closed (at once if it is not leased)."""
        with self._lock:
            old = self._loaded.pop(name, None)
            self._loaded[name] = entry
            self._attempts.pop(name, None)
            if old is not None:
                if after_old is not None:
                    old.on_close.append(after_old)
                self._retire(name, old)
            self._evict_idle(keep=name)
            return old

    def create(self, name: str, template: Manifest) -> None:
        """A new live index ``name`` with no documents (``LiveIndex.create_empty``);
        ALREADY_EXISTS when the name is taken."""
        check_index_name("name", name)
        path = self.root / name
        with self._gate(name):
            if path.exists():
                raise AlreadyExists(f"name: index {name!r} exists already")
            try:
                LiveIndex.create_empty(path, template).close()
            except FileExistsError:
                raise AlreadyExists(f"name: index {name!r} exists already") from None
            with self._lock, suppress(OSError):
                # made here, not out of band: vanished() does not take it for a replacement
                if self._known is not None:
                    self._known[name] = _identity(path)
        log.info("index %s created empty (%s)", name, template.index_type)

    def delete(self, name: str) -> None:
        """Remove the index ``name`` (never the active one: FAILED_PRECONDITION). Requests
        holding it finish first: its directory is renamed away at once and removed when its
        last lease ends."""
        with self._gate(name):
            path = self._path(name)
            retired = self.root / f"{_RETIRED.format(name)}{uuid.uuid4().hex[:8]}"
            with self._lock:
                if name == self.active:
                    raise FailedPrecondition(
                        f"name: index {name!r} is active; swap to another index first"
                    )
                os.rename(path, retired)
                if self._known is not None:
                    self._known.pop(name, None)  # deleted here: vanished() does not report it
                entry = self._loaded.pop(name, None)
                self._attempts.pop(name, None)
                if entry is not None:
                    entry.on_close.append(lambda: _discard(retired))
                    self._retire(name, entry)
            if entry is None:
                _discard(retired)
        log.info("index %s deleted", name)

    def close(self) -> None:
        with self._lock:
            for name, entry in list(self._loaded.items()):
                self._retire(name, entry)
            self._loaded.clear()


def _fingerprint(path: Path, manifest: Manifest) -> Fingerprint:
    """The fingerprint of ``path`` (module docstring), its manifest already read."""
    stamps = []
    for rel in (MANIFEST, *sorted(manifest.files)):
        try:
            st = (path / rel).stat()
        except OSError:
            stamps.append((rel, -1, -1, -1))
        else:
            stamps.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stamps)


def _checked_dir(path: Path) -> Path:
    """What identifies the index at ``path``: the directory itself for a built index, its
    newest base for a live one, or the template file of a live one created empty."""
    if (path / MANIFEST).is_file() or not is_live_index(path):
        return path
    base, _ = newest_base(path)
    return base if base is not None else path / TEMPLATE_FILE


def _discard(path: Path) -> None:
    """Remove a directory renamed away, in the background: it may be large, and this runs
    where an index is closed, under the registry's lock."""
    threading.Thread(
        target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, daemon=True
    ).start()


def _open(name: str, path: Path, *, verify: bool) -> _Entry:
    """Open the index directory ``path`` served as ``name``."""
    identity = _identity(path)
    if not is_live_index(path):
        stamp = _stamp(path)
        # Served, labelled and cached under the directory name clients asked for, never the
        # manifest's (a copied index keeps the name it was built as).
        index = open_index(path, verify=verify, name=name)
        return _Entry(index, stamp=stamp, identity=identity)
    # As a writer: it takes the writer lock only for the open (and then for each write).
    return _Entry(LiveIndex(path, LiveOptions(verify=verify)), identity=identity)


def _identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def _stamp(path: Path) -> tuple[object, ...]:
    """What a reader compares to tell its open built index is behind the directory: it is
    current while its manifest is there (it is replaced only by adoption)."""
    if (path / MANIFEST).is_file():
        return ("built",)
    return ("live", *disk_stamp(path))


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """A blocking exclusive flock on ``lock_file`` for the block."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _locked(lock_file: Path) -> bool:
    """Whether another process holds ``lock_file`` (an adoption in progress)."""
    if not lock_file.exists():
        return False
    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _fingerprint_of(path: Path) -> Fingerprint:
    """The fingerprint of ``path`` before a load; empty when its manifest is unreadable."""
    try:
        path = _checked_dir(path)
        if path.name == TEMPLATE_FILE:
            return ()
        return _fingerprint(path, Manifest.from_file(path / MANIFEST))
    except Exception:  # noqa: BLE001 - unreadable: the load fails and says why
        return ()


def _described(exc: BaseException) -> str:
    """An error as a listing reports it: its own message, or its type and message for an
    error that is not the index's (an OSError, a malformed manifest's TypeError, ...)."""
    if isinstance(exc, IndexLoadError | InvalidArgument):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# Conformance, checked by mypy.
FILES_REGISTRY: type[Registry] = IndexRegistry
