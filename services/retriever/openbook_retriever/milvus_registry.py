"""The indexes a retriever serves from Milvus (``OPENBOOK_INDEX_ENGINE=milvus``, issue 41).

The Milvus counterpart of :class:`~openbook_retriever.registry.IndexRegistry`, behind the same
:class:`~openbook_retriever.registry.Registry` protocol, so the servicer's code paths are the
same for both engines. Every index this Milvus holds (``MilvusEngine.names``) is available by
name; each is a :class:`~openbook.index.milvus_engine.MilvusIndex`, a
:class:`~openbook.index.engine.DocumentIndex`: it takes documents from its creation (there is
no built layout to adopt), and the retriever holds no index state on its disk.

Every replica pointed at the same Milvus (a server URI: a cluster, or ``milvus-lite server``)
serves and writes every index. Before every request the lease brings the index's version up
to Milvus's (``MilvusIndex.catch_up``: one read of its row), and reads are at the Strong
consistency level, so a request that starts after a write was acknowledged by any replica
sees it. An index removed by another replica answers NOT_FOUND from then on.

A Milvus that cannot be reached makes every call that needs it answer UNAVAILABLE (the
engine's ``GuardedClient``); the registry keeps what it holds and serves again once Milvus is
back. Opening an index object costs a few reads and holds no memory of its rows, so loaded
indexes are kept, at most ``max_loaded`` of them besides the active one, only to spare those
reads; nothing needs closing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from openbook.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from openbook.index.engine import EngineKind, SearchableIndex
from openbook.index.manifest import IndexLoadError, Manifest
from openbook.index.milvus_engine import MilvusEngine, MilvusIndex
from openbook.validation.limits import check_index_name
from openbook_retriever.registry import IndexStatus, Registry

log = logging.getLogger(__name__)


class MilvusRegistry:
    """The indexes of one Milvus (module docstring); thread-safe."""

    engine_kind = EngineKind.MILVUS

    def __init__(self, engine: MilvusEngine, max_loaded: int = 4) -> None:
        self.engine = engine
        self.max_loaded = max_loaded
        self._lock = threading.RLock()
        self._loaded: OrderedDict[str, MilvusIndex] = OrderedDict()  # least recently used first
        self._known: set[str] | None = None  # what vanished() last saw (None: not looked)
        self.active: str | None = None
        self.before_activate: Callable[[SearchableIndex], None] | None = None

    # ---- discovery
    def available(self) -> list[str]:
        return self.engine.names()

    def vanished(self) -> list[str]:
        """The indexes loaded or seen here that Milvus no longer holds (removed by another
        replica or out of band) since the last call; the first call only looks. A Milvus
        that cannot be reached now changes nothing."""
        try:
            now = set(self.engine.names())
        except Unavailable as exc:
            log.debug("not looking for vanished indexes: %s", exc)
            return []
        with self._lock:
            seen = set(self._loaded) | (self._known or set())
            gone = sorted(seen - now)
            for name in gone:
                self._loaded.pop(name, None)
            self._known = now
        return gone

    def status(self, name: str) -> IndexStatus:
        """Whether ``name`` can be served: its collections present and matching its manifest
        (``MilvusEngine.open``'s checks); an unreadable one says why."""
        with self._lock:
            index = self._loaded.get(name)
        if index is not None:
            return IndexStatus(name, index.manifest, "", verified=True)
        try:
            opened = self.engine.open(name)
        except (IndexLoadError, NotFound) as exc:
            described = self.engine.describe(name)
            return IndexStatus(name, described[0] if described else None, str(exc), False)
        return IndexStatus(name, opened.manifest, "", verified=True)

    def manifest(self, name: str) -> Manifest:
        with self._lock:
            index = self._loaded.get(name)
        if index is not None:
            return index.manifest
        described = self.engine.describe(check_index_name("index", name))
        if described is None:
            raise self._unknown(name)
        return described[0]

    def live_state(self, name: str) -> tuple[int, int] | None:
        """(version, passages) of ``name`` as Milvus holds them now (every index here is
        live); None if it is not there."""
        with self._lock:
            index = self._loaded.get(name)
        if index is None:
            try:
                index = self.engine.open(name)
            except (IndexLoadError, NotFound):
                return None
        else:
            index.catch_up()
        return index.version, len(index)

    def is_loaded(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def _unknown(self, name: str) -> NotFound:
        known = ", ".join(self.available()) or "none"
        return NotFound(f"index: unknown index {name!r} (available: {known})")

    # ---- serving
    def load(self, name: str) -> MilvusIndex:
        """The index object of ``name`` (opened, and its collections checked, unless held)."""
        check_index_name("index", name)
        with self._lock:
            index = self._loaded.get(name)
            if index is not None:
                self._loaded.move_to_end(name)
                return index
        try:
            opened = self.engine.open(name)
        except NotFound:
            raise self._unknown(name) from None
        with self._lock:
            index = self._loaded.setdefault(name, opened)
            self._loaded.move_to_end(name)
            self._evict(keep=name)
            return index

    def _evict(self, keep: str) -> None:
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if name not in (self.active, keep):
                del self._loaded[name]

    def swap(self, name: str) -> tuple[str | None, SearchableIndex]:
        """Make ``name`` active; a refused index (``before_activate``) leaves the current one
        serving."""
        index = self.load(name)
        if self.before_activate is not None:
            self.before_activate(index)
        with self._lock:
            previous, self.active = self.active, name
            self._loaded[name] = index
            self._loaded.move_to_end(name)
        if previous != name:
            log.info("active index %s -> %s", previous, name)
        return previous, index

    def _current(self, name: str | None) -> tuple[str, MilvusIndex]:
        with self._lock:
            target = name or self.active
        if target is None:
            raise FailedPrecondition("no active index: create or copy one and swap to it")
        index = self.load(target)
        try:  # what other replicas wrote, before this request reads
            index.catch_up()
        except NotFound:
            with self._lock:
                if self._loaded.get(target) is index:
                    del self._loaded[target]
            raise NotFound(f"index: index {target!r} was removed") from None
        return target, index

    @contextmanager
    def lease(self, name: str | None = None) -> Iterator[SearchableIndex]:
        yield self._current(name)[1]

    @contextmanager
    def writer(self, name: str) -> Iterator[MilvusIndex]:
        yield self._current(name)[1]

    # ---- creating and deleting
    def create(self, name: str, template: Manifest) -> None:
        """A new index ``name`` with no documents; ALREADY_EXISTS when the name is taken;
        an index type this engine does not offer is refused naming ``type``."""
        check_index_name("name", name)
        try:
            self.engine.create(name, template)
        except AlreadyExists:
            raise AlreadyExists(f"name: index {name!r} exists already") from None
        except InvalidArgument as exc:  # the engine names the manifest's field, index_type
            raise InvalidArgument(f"type: {exc}") from None
        log.info("index %s created empty in Milvus (%s)", name, template.index_type)

    def delete(self, name: str) -> None:
        """Remove the index ``name`` (never the active one: FAILED_PRECONDITION)."""
        check_index_name("name", name)
        with self._lock:
            if name == self.active:
                raise FailedPrecondition(
                    f"name: index {name!r} is active; swap to another index first"
                )
        try:
            self.engine.drop(name)
        except NotFound:
            raise self._unknown(name) from None
        with self._lock:
            self._loaded.pop(name, None)
        log.info("index %s deleted from Milvus", name)

    def close(self) -> None:
        with self._lock:
            self._loaded.clear()
        self.engine.close()


# Conformance, checked by mypy.
MILVUS_REGISTRY: type[Registry] = MilvusRegistry
