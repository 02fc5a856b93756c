"""One writer per live index at a time, across processes: an exclusive ``flock`` on its
``writer.lock``.

Two processes appending to one write-ahead log at once would give two writes the same
version, so every write batch of a live index (``LiveIndex._commit``), the opening of one as a
writer and the switch of a compaction run under this lock, taken per batch by whichever
process (retriever replica) received the write, waiting for the holder (writes hold it for a
catch-up, an append and an fsync: milliseconds). The holder writes its pid and host into the
file (a hint for someone looking at a stuck lock). The kernel drops the lock when the
holder's descriptor closes, however the holder dies, so a crashed writer never blocks the
next one.

Invariants: a :class:`WriterLock` that exists holds the lock until :meth:`release`; flock locks
belong to one open file description, so two holders in one process exclude each other too.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

WRITER_LOCK_FILE = "writer.lock"
# Held (without waiting) for a whole compaction, so two replicas never build bases at once.
COMPACTION_LOCK_FILE = "compaction.lock"


class WriterLockHeld(Exception):
    """Another process (or another open of the index in this one) holds the writer lock."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path}: held by {holder or 'an unknown process'}")
        self.path = path
        self.holder = holder


class WriterLock:
    """The writer lock of the live index directory ``index_dir`` (module docstring)."""

    def __init__(
        self, index_dir: Path, *, wait: bool = False, lock_file: str = WRITER_LOCK_FILE
    ) -> None:
        """Take the lock now: waiting for its holder when ``wait``, else
        :class:`WriterLockHeld` if it is taken. ``lock_file``: another lock of the index
        (``COMPACTION_LOCK_FILE``)."""
        self.path = Path(index_dir) / lock_file
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WriterLockHeld(self.path, holder_of(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: its holder line is only a hint."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_of(lock_file: Path) -> str:
    """What the lock file says of its holder ("" when unreadable or empty)."""
    try:
        return Path(lock_file).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
