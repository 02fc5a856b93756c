"""Background compaction of the live indexes this retriever writes.

After every write the servicer asks :meth:`BackgroundCompactor.after_write`; once the index's
write segment or its hidden base rows reach the threshold, one thread per index folds them
into a new base (``LiveIndex.compact``). Writes and searches go on meanwhile: the live index
blocks them only for the switch to the new base (under the index's writer lock, which other
replicas' writes wait for); a replica that finds another one compacting the index skips its
own. The thread holds the index through the registry's writer lease, so it stays open until
the compaction is done.

Invariant: at most one compaction per index name runs at a time in this process.
"""

from __future__ import annotations

import logging
import threading

from openbook.index.engine import DocumentIndex
from openbook.index.live import LiveIndex
from openbook_retriever.registry import Registry

log = logging.getLogger(__name__)


class BackgroundCompactor:
    def __init__(self, registry: Registry, threshold_passages: int) -> None:
        self.registry = registry
        self.threshold_passages = threshold_passages
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}

    def due(self, live: LiveIndex) -> bool:
        return max(live.segment_size, live.hidden_size) >= self.threshold_passages

    def after_write(self, name: str, live: DocumentIndex) -> None:
        """Start compacting ``name`` in the background if it is due and not compacting. Only
        a files live index compacts here: another engine (Milvus) compacts its own storage."""
        if not isinstance(live, LiveIndex) or not self.due(live):
            return
        with self._lock:
            if name in self._running:
                return
            thread = threading.Thread(
                target=self._compact, args=(name,), name=f"compact-{name}", daemon=True
            )
            self._running[name] = thread
        thread.start()

    def _compact(self, name: str) -> None:
        try:
            with self.registry.writer(name) as live:
                assert isinstance(live, LiveIndex)  # after_write starts only these
                result = live.compact()
            if result is not None:
                log.info(
                    "index %s compacted through version %d: %d passages in %.1fs",
                    name,
                    result.version,
                    result.passages,
                    result.seconds,
                )
        except Exception:  # a failed compaction leaves the index as it was: log, go on
            log.exception("index %s: background compaction failed", name)
        finally:
            with self._lock:
                self._running.pop(name, None)

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the compactions running now end (tests, shutdown)."""
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(timeout_s)
