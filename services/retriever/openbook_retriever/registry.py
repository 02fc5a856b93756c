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
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from openbook.errors import FailedPrecondition, InvalidArgument, NotFound
from openbook.index import (
    IndexLoadError,
    LoadedIndex,
    Manifest,
    check_index_files,
    open_index,
    read_index_manifest,
)
from openbook.limits import check_index_name

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


@dataclass
class _Entry:
    index: LoadedIndex
    leases: int = 0
    retired: bool = False  # unloaded while leased: close when the last lease ends


class IndexRegistry:
    def __init__(self, root: Path, max_loaded: int = 4) -> None:
        self.root = Path(root)
        self.max_loaded = max_loaded
        self._lock = threading.RLock()
        self._loaded: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._loading: dict[str, threading.Lock] = {}
        # The latest load of each index: the fingerprint it saw and its error ("" if it loaded).
        self._attempts: dict[str, tuple[Fingerprint, str]] = {}
        self.active: str | None = None
        # Called with a loaded index before it becomes active; raising refuses the swap (the
        # retriever checks that some query encoder pairs with the index).
        self.before_activate: Callable[[LoadedIndex], None] | None = None

    # ---- discovery
    def available(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if not p.name.startswith(".") and (p / MANIFEST).is_file()
        )

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
        return Manifest.from_file(self._path(name) / MANIFEST)

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def _path(self, name: str) -> Path:
        # Every name, an RPC's or the active index recorded in Redis, is checked here too.
        check_index_name("index", name)
        path = self.root / name
        if not (path / MANIFEST).is_file():
            known = ", ".join(self.available()) or "none"
            raise NotFound(f"index: unknown index {name!r} (available: {known})")
        return path

    # ---- loading
    def load(self, name: str) -> LoadedIndex:
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
                # Served, labelled and cached under the directory name clients asked for,
                # never the manifest's name (a copied index keeps the name it was built as).
                index = open_index(path, verify=True, name=name)
            except Exception as exc:
                with self._lock:
                    self._attempts[name] = (seen, _described(exc))
                raise
            with self._lock:
                self._attempts[name] = (seen, "")
                self._loaded[name] = _Entry(index)
                self._loading.pop(name, None)
                self._evict_idle(keep=name)
            return index

    def _retire(self, name: str, entry: _Entry) -> None:
        if entry.leases == 0:
            entry.index.close()
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
    def swap(self, name: str) -> tuple[str | None, LoadedIndex]:
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

    @contextmanager
    def lease(self, name: str | None = None) -> Iterator[LoadedIndex]:
        """Hold ``name`` (default: the active index) for the duration of one request."""
        while True:
            with self._lock:
                target = name or self.active
                if target is None:
                    raise FailedPrecondition("no active index: build one and swap to it")
                entry = self._loaded.get(target)
                if entry is not None:
                    entry.leases += 1
                    self._loaded.move_to_end(target)
                    break
            self.load(target)  # loaded on demand, then lease it on the next pass
        try:
            yield entry.index
        finally:
            with self._lock:
                entry.leases -= 1
                if entry.retired and entry.leases == 0:
                    entry.index.close()
                    log.info("index %s released", target)

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


def _fingerprint_of(path: Path) -> Fingerprint:
    """The fingerprint of ``path`` before a load; empty when its manifest is unreadable."""
    try:
        return _fingerprint(path, Manifest.from_file(path / MANIFEST))
    except Exception:  # noqa: BLE001 - unreadable: the load fails and says why
        return ()


def _described(exc: BaseException) -> str:
    """An error as a listing reports it: its own message, or its type and message for an
    error that is not the index's (an OSError, a malformed manifest's TypeError, ...)."""
    if isinstance(exc, IndexLoadError | InvalidArgument):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
