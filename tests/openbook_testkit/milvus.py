"""Milvus for tests (issue 41): Milvus Lite's own gRPC server, as `openbook up` runs the
``milvus`` role, and built files indexes copied into it as a user copies them.

Real Milvus Lite, no mocks: ``milvus-lite server`` speaks Milvus's protocol, so retriever
replicas pointed at it share one engine as they would share a cluster.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from openbook_testkit.stack import free_port


class LiteServer:
    """``milvus-lite server`` on a loopback port over one data directory (a process)."""

    def __init__(self, data: Path) -> None:
        self.data, self.port = Path(data), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> None:
        """Start it and wait until a client can list its collections."""
        from pymilvus import MilvusClient

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(self.data)]
            + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # Closed at once: an idle client left open keeps pinging the server, which
                # answers GOAWAY (too_many_pings), and a later client of the same URI in this
                # process shares its broken connection.
                client = MilvusClient(uri=self.uri, timeout=2)
                try:
                    client.list_collections()
                finally:
                    client.close()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@contextmanager
def lite_server(data: Path) -> Iterator[LiteServer]:
    """A started :class:`LiteServer`, stopped on exit."""
    server = LiteServer(data)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def copy_to_milvus(built: Path, uri: str, *names: str) -> None:
    """``openbook index to-milvus`` for each of ``names`` (directories under ``built``), as a
    user moves an index: in a process of its own, so a Milvus Lite ``.db`` is then opened
    afresh by the retriever."""
    openbook = Path(sys.executable).parent / "openbook"
    for name in names:
        command = [str(openbook), "index", "to-milvus", str(built / name), "--uri", uri]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"into Milvus at {uri} as {name!r} (" in result.stdout, result.stdout
