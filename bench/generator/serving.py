"""The generator service as users run it, for a benchmark: ``python -m openbook_generator`` on
free ports with a private redis-server, started and stopped around a ``with`` block
(bench/memory/service.py, bench/generator/slowdown.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GeneratorProcess:
    """A running service: its gRPC stub, process id, metrics port and working folder (the log
    is ``work / "generator.log"``)."""

    stub: Any
    pid: int
    metrics_port: int
    work: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def generator_process(
    model: Path,
    adapter: Path | None,
    settings: dict[str, str],
    env_pairs: list[str],
    prefix: str,
) -> Iterator[GeneratorProcess]:
    """Start the service serving ``model`` (with ``adapter``; ``settings``: more
    ``OPENBOOK_GENERATOR_*`` variables; ``env_pairs``: the caller's NAME=VALUE overrides, last)
    and wait until it serves; stop it (and its redis) on leaving."""
    import grpc

    from openbook.v1 import generator_pb2_grpc

    work = Path(tempfile.mkdtemp(prefix=prefix))
    redis_port, port, metrics_port = free_port(), free_port(), free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(redis_port)]
        + ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        "OPENBOOK_GENERATOR_MODEL": str(model.resolve()),
        "OPENBOOK_GENERATOR_ADAPTER": str(adapter.resolve()) if adapter else "",
        "OPENBOOK_GENERATOR_PORT": str(port),
        "OPENBOOK_GENERATOR_METRICS_PORT": str(metrics_port),
        "OPENBOOK_GENERATOR_CHECKPOINT_DIR": str(work / "checkpoints"),
        "OPENBOOK_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        **settings,
    }
    for pair in env_pairs:
        name, _, value = pair.partition("=")
        env[name] = value
    # ``python -m`` puts its working directory first on the import path: a tree given by
    # PYTHONPATH is only imported (rather than this checkout's ``openbook``) when the service
    # runs in it
    cwd = env["PYTHONPATH"].split(os.pathsep)[0] if env.get("PYTHONPATH") else None
    log = open(work / "generator.log", "w")  # noqa: SIM115 - closed below
    service = subprocess.Popen(
        [sys.executable, "-m", "openbook_generator"], env=env, stdout=log, stderr=log, cwd=cwd
    )
    try:
        stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        _wait_serving(stub, service, work)
        yield GeneratorProcess(stub, service.pid, metrics_port, work)
    finally:
        service.terminate()
        service.wait(30)
        redis.terminate()
        redis.wait(10)
        log.close()


def _wait_serving(stub: Any, service: subprocess.Popen, work: Path, timeout_s: float = 600) -> None:
    from openbook.v1 import generator_pb2

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if service.poll() is not None:
            raise RuntimeError((work / "generator.log").read_text()[-3000:])
        try:
            stub.Info(generator_pb2.InfoRequest(), timeout=2)
            return
        except Exception:  # noqa: BLE001 - not serving yet
            time.sleep(1)
    raise RuntimeError("the generator did not start")
