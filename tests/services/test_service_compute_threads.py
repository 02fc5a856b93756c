"""The services size their compute threads to the CPU they get
(openbook/runtime/compute_threads.py), seen on their own /metrics (``openbook_compute_threads``):
pinned to one CPU the generator and the retriever's encoder compute with one thread;
OPENBOOK_COMPUTE_THREADS wins; a neighbour spinning on one of two cores takes the generator's second
thread away while it is answering (issue 29: a team of two waiting on a core it does not get
answered nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from openbook_testkit.hog import CpuHog
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import build_fact_indexes, free_port, stop_process

CPUS = sorted(os.sched_getaffinity(0))
GAUGE = re.compile(r'^openbook_compute_threads\{service="(\w+)"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("threads") / "gemma", arch="gemma3")


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("threads-indexes")
    build_fact_indexes(root)
    return root


@contextmanager
def service_process(
    service: str, workdir: Path, redis_url: str, cpus: set[int] | None = None, **env: str
) -> Iterator[tuple[subprocess.Popen, str, int]]:
    """``python -m openbook_<service>`` as compose runs it (its environment only, plus
    ``env``), optionally pinned to ``cpus``; yields (process, gRPC address, metrics port) once
    its metrics report its compute threads."""
    port, metrics_port = free_port(), free_port()
    prefix = f"OPENBOOK_{service.upper()}_"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OPENBOOK_")}
    environment.pop("OMP_NUM_THREADS", None)
    environment.update(
        {prefix + "PORT": str(port), prefix + "METRICS_PORT": str(metrics_port)},
        OPENBOOK_CHECKPOINT_DIR=str(workdir / "checkpoints"),
        OPENBOOK_REDIS_URL=redis_url,
        OPENBOOK_ACCESS_LOG="false",
        **env,
    )
    log_path = workdir / f"{service}-{port}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"openbook_{service}"],
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    try:
        deadline = time.monotonic() + 180
        while _gauge(metrics_port) is None:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the {service} never reported its threads"
            time.sleep(0.5)
        yield proc, f"127.0.0.1:{port}", metrics_port
    finally:
        stop_process(proc)
        log.close()


def _gauge(metrics_port: int) -> float | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    found = GAUGE.search(text)
    return float(found.group(2)) if found else None


def generator_process(
    model: Path, workdir: Path, redis_url: str, cpus: set[int] | None = None, **env: str
):
    return service_process(
        "generator",
        workdir,
        redis_url,
        cpus,
        OPENBOOK_GENERATOR_MODEL=str(model),
        OPENBOOK_GENERATOR_DTYPE="float32",
        **env,
    )


def _request() -> generator_pb2.GenerateRequest:
    return generator_pb2.GenerateRequest(
        question=QUESTION,
        passages=[
            common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score)
            for p in make_passages(4)
        ],
        options=generator_pb2.DecodingOptions(max_new_tokens=16, min_new_tokens=16),
    )


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to pin to fewer")
def test_pinned_to_one_cpu_the_generator_computes_with_one_thread(model, tmp_path, redis_url):
    with generator_process(model, tmp_path, redis_url, cpus={CPUS[0]}) as (_, _, metrics):
        assert _gauge(metrics) == 1


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to pin to fewer")
def test_pinned_to_one_cpu_the_retriever_encodes_with_one_thread(indexes, tmp_path, redis_url):
    with service_process(
        "retriever",
        tmp_path,
        redis_url,
        {CPUS[0]},
        OPENBOOK_INDEX_ROOT=str(indexes),
        OPENBOOK_RETRIEVER_DEFAULT_INDEX="facts-a",
    ) as (_, _, metrics):
        # reported once the warm-up search ran on the batch thread, before serving
        assert _gauge(metrics) == 1


def test_the_setting_wins(model, tmp_path, redis_url):
    with generator_process(model, tmp_path, redis_url, OPENBOOK_COMPUTE_THREADS="3") as running:
        assert _gauge(running[2]) == 3


@pytest.mark.skipif(len(CPUS) != 2, reason="needs exactly two CPUs")
def test_a_neighbour_on_one_core_takes_a_thread_away_while_answering(model, tmp_path, redis_url):
    with generator_process(model, tmp_path, redis_url) as (proc, addr, metrics):
        stop = threading.Event()
        answered: list[int] = []

        def client() -> None:
            with grpc.insecure_channel(addr) as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                while not stop.is_set():
                    try:
                        stub.Generate(_request(), timeout=60)
                    except grpc.RpcError:  # still starting (UNAVAILABLE), or refused
                        time.sleep(0.2)
                        continue
                    answered.append(1)

        clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for c in clients:
            c.start()
        try:
            with CpuHog(1):
                deadline = time.monotonic() + 20
                while _gauge(metrics) != 1 and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert _gauge(metrics) == 1
                during = len(answered)
                time.sleep(3)
                assert len(answered) > during  # still answering with the core it has
        finally:
            stop.set()
            for c in clients:
                c.join(60)
        assert proc.poll() is None
