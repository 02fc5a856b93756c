"""Test support shared by the suite and by benchmarks: free ports and a private Redis."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from openbook_cli.launcher import SUPERVISING_LINE

REPO_ROOT = Path(__file__).resolve().parents[2]
# The admin token of in-process backends: their admin RPCs (SwapIndex, ReloadModel, ...)
# refuse calls without it, and a gateway in front of them forwards its own.
BACKENDS_ADMIN_TOKEN = "backends-admin-token"


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process. The port is found
    by binding to port 0 and released at once, so two picks in a row (the six ports of one
    stack) could otherwise be the same port: the second service to bind it finds it taken,
    and a test may then talk to the wrong server (a metrics server answers every path,
    readiness probes included)."""
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


class RedisServer:
    """A redis-server of our own on a free port, so tests never touch a shared instance.

    Started as compose starts Redis: with the ACL file ``openbook-secrets init`` makes (the
    default user off, ``openbook`` with its password), so every test client authenticates
    exactly as the services do. ``url`` carries the credentials; ``secrets`` are the files.
    """

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        from openbook.security.secrets import SecretFiles

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server not found: install Debian's redis-server (.ci/run does)"
            )
        self.exe = exe
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.secrets = SecretFiles(workdir / "secrets")

    @property
    def password(self) -> str:
        return self.secrets.password.read_text().strip()

    @property
    def url(self) -> str:
        """The URL of user ``openbook`` (its password in it: redis-py authenticates with it)."""
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        """The URL of database ``db`` (tests that keep setups apart use several)."""
        from openbook.security.secrets import REDIS_USER

        return f"redis://{REDIS_USER}:{self.password}@127.0.0.1:{self.port}/{db}"

    @property
    def anonymous_url(self) -> str:
        """The same server without credentials: what a process without the password gets."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from openbook.security.secrets import init

        init(self.secrets.dir)
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--aclfile",
                str(self.secrets.acl),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client()
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        """A client of user ``openbook``: what a service (or an insider with the password) has."""
        return redis.Redis.from_url(self.url, decode_responses=True)

    def flush(self, db: int = 0) -> None:
        """Delete every key of ``db``. FLUSHALL/FLUSHDB are @dangerous, which ``openbook`` may
        not run: its keys (all of them are ``openbook:*``) go one by one."""
        client = redis.Redis.from_url(self.url_for(db), decode_responses=True)
        keys = list(client.scan_iter(match="*", count=1000))
        if keys:
            client.unlink(*keys)


@contextmanager
def foreign_redis(port: int) -> Iterator[redis.Redis]:
    """Someone else's Redis on ``port``: password-less, no openbook ACL user (the machine's
    own Redis, as on many hosts). Yields a client of it, to check openbook left it alone."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: install Debian's redis-server (.ci/run does)")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, decode_responses=True)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"foreign redis-server on {port} did not start")
        yield client
    finally:
        proc.terminate()
        proc.wait(10)


def compose_with_redis_default(directory: Path, port: int) -> Path:
    """docker-compose.yml, copied into ``directory`` with its default Redis port
    (``${OPENBOOK_REDIS_PORT:-6379}``) made ``port``: what `openbook up` meets on a machine
    where its default port is taken, without touching the machine's real 6379. ``./data``
    is the repository's."""
    text = (REPO_ROOT / "docker-compose.yml").read_text()
    default = "${OPENBOOK_REDIS_PORT:-6379}"
    assert default in text, "docker-compose.yml no longer defaults Redis's port this way"
    compose = directory / "docker-compose.yml"
    compose.write_text(text.replace(default, f"${{OPENBOOK_REDIS_PORT:-{port}}}"))
    if not (directory / "data").exists():
        (directory / "data").symlink_to(REPO_ROOT / "data")
    return compose


FACT_INDEXES = ("facts-a", "facts-b")


def build_fact_indexes(root: Path) -> tuple[str, str]:
    """Two small real indexes (MiniLM, flat) under ``root``: ``facts-a`` and ``facts-b``.

    They hold the same topics with different facts, so answers and passages differ between
    them — what an index swap must show. Each is a copy of the one this process built first
    (:func:`_fact_indexes_built_once`); one already under ``root`` is left as it is.
    """
    built = _fact_indexes_built_once()
    for name in FACT_INDEXES:
        if not (root / name / "manifest.json").exists():
            shutil.copytree(built / name, root / name, dirs_exist_ok=True)
    return FACT_INDEXES


_built_fact_indexes: Path | None = None


def _fact_indexes_built_once() -> Path:
    """The folder holding ``facts-a`` and ``facts-b`` as this process (a pytest worker, a
    benchmark) built them, once.

    Why a copy instead of a build per caller: some fifty test modules and tests start services
    on these indexes, and each build (MiniLM over 60 passages, BM25, FAISS, checksums) cost
    ~2.5 s of CPU. A build is deterministic but for its manifest's ``created_at`` and
    ``build_seconds``, and each caller gets its own copy to write to, so a copy serves exactly
    what a build of its own did.
    """
    global _built_fact_indexes
    if _built_fact_indexes is None:
        import atexit
        import tempfile

        from openbook.index import build_index
        from openbook.index.spec import BuildOptions, IndexSpec
        from openbook_testkit.index import fact_rows, write_jsonl

        root = Path(tempfile.mkdtemp(prefix="openbook-fact-indexes-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        rows_a = fact_rows()
        rows_b = [
            {**row, "id": f"b-{row['id']}", "text": row["text"] + " (revised edition)"}
            for row in rows_a
        ]
        for name, rows in zip(FACT_INDEXES, (rows_a, rows_b), strict=True):
            source = write_jsonl(root / f"{name}.jsonl", rows)
            build_index([source], root / name, IndexSpec(name=name), BuildOptions(progress=False))
        _built_fact_indexes = root
    return _built_fact_indexes


@dataclass
class Backends:
    """Retriever and generator gRPC servers running in this process."""

    retriever_port: int
    generator_port: int
    generator_servicer: Any  # openbook_generator.servicer.GeneratorServicer
    admin_token: str | None = BACKENDS_ADMIN_TOKEN
    retriever_metrics: Any = None  # openbook.serving.metrics.ServiceMetrics
    retriever_servicer: Any = None  # openbook_retriever.servicer.RetrieverServicer

    def gateway_settings(self, redis_url: str, **overrides: Any):
        """Gateway settings that point at these backends (with their admin token)."""
        from openbook_gateway.settings import GatewaySettings

        return GatewaySettings(
            **{
                "retriever_addr": f"127.0.0.1:{self.retriever_port}",
                "generator_addr": f"127.0.0.1:{self.generator_port}",
                "redis_url": redis_url,
                "admin_token": self.admin_token,
                **overrides,
            }
        )

    def gateway_environment(self, redis_url: str) -> dict[str, str]:
        """The environment of a gateway process (:func:`gateway_process`) that points at
        these backends (with their admin token)."""
        return {
            "OPENBOOK_GATEWAY_RETRIEVER_ADDR": f"127.0.0.1:{self.retriever_port}",
            "OPENBOOK_GATEWAY_GENERATOR_ADDR": f"127.0.0.1:{self.generator_port}",
            "OPENBOOK_REDIS_URL": redis_url,
            "OPENBOOK_ADMIN_TOKEN": self.admin_token or "",
        }


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc`` and wait ``grace_s`` for it to exit, then SIGKILL it."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def gateway_process(workdir: Path, env: dict[str, str], timeout_s: float = 60) -> Iterator[str]:
    """The gateway as compose and ``openbook up`` run it: the ``openbook-gateway`` command, in
    a process of its own on a free loopback port, configured by ``env`` (``OPENBOOK_*``
    variables; :meth:`Backends.gateway_environment` points it at in-process backends). Yields
    its base URL once ``/healthz`` answers; its output goes to ``workdir/gateway.log``."""
    import os
    import sys

    import httpx

    port = free_port()
    command = Path(sys.executable).parent / "openbook-gateway"
    log_path = workdir / "gateway.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(command)],
            env={
                **os.environ,
                **env,
                "OPENBOOK_GATEWAY_HOST": "127.0.0.1",
                "OPENBOOK_GATEWAY_PORT": str(port),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"openbook-gateway did not start:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        stop_process(proc)


class RetrieverProcess:
    """A retriever as compose runs one replica: the ``openbook-retriever`` command in a process
    of its own (:func:`retriever_process`)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = Path(workdir)
        self.env = env
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> None:
        """Start it and wait until it answers ListIndexes (UNAVAILABLE while it loads)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process, not waiting for it (start replicas together, then wait)."""
        import os
        import sys

        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / "retriever.log"
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "openbook-retriever")],
                env={
                    **os.environ,
                    **self.env,
                    "OPENBOOK_RETRIEVER_HOST": "127.0.0.1",
                    "OPENBOOK_RETRIEVER_PORT": str(self.port),
                    "OPENBOOK_RETRIEVER_METRICS_PORT": str(free_port()),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until it answers ListIndexes; RuntimeError with its log if it exits or times out."""
        import grpc

        from openbook.v1 import retriever_pb2, retriever_pb2_grpc

        assert self.proc is not None
        log_path = self.workdir / "retriever.log"
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.addr) as channel:
            stub = retriever_pb2_grpc.RetrieverStub(channel)
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"openbook-retriever did not start:\n{log_path.read_text()}")
                try:
                    stub.ListIndexes(retriever_pb2.ListIndexesRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    time.sleep(0.1)

    def log_tail(self, chars: int = 4000) -> str:
        path = self.workdir / "retriever.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def kill(self) -> None:
        """``kill -9``: no shutdown of any kind."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)


@contextmanager
def retriever_processes(
    workdirs: list[Path], env: dict[str, str]
) -> Iterator[list[RetrieverProcess]]:
    """Retriever replicas as compose runs them (``openbook-retriever``), all configured by
    ``env`` (``OPENBOOK_*``; one index root: they share it), each on a free loopback port,
    started together; stopped on exit. Replica i's output goes to ``workdirs[i]/retriever.log``."""
    retrievers = [RetrieverProcess(workdir, env) for workdir in workdirs]
    try:
        for retriever in retrievers:
            retriever.launch()
        for retriever in retrievers:
            retriever.wait_ready()
        yield retrievers
    finally:
        for retriever in retrievers:
            retriever.stop()


@contextmanager
def running_backends(
    workdir: Path,
    redis_url: str,
    admin_token: str | None = BACKENDS_ADMIN_TOKEN,
    generator_model: Path | None = None,
) -> Iterator[Backends]:
    """The real retriever (``facts-a`` active, ``facts-b`` loadable) and generator (a tiny
    random BART, or ``generator_model``) built as their servers build them, on free loopback
    ports. Their admin RPCs need ``admin_token`` (None: admin off)."""
    from openbook_generator.settings import GeneratorSettings
    from openbook_retriever.settings import RetrieverSettings
    from openbook_testkit.rag import make_tiny_bart

    build_fact_indexes(workdir / "indexes")
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_url,
        "checkpoint_dir": workdir / "checkpoints",  # empty: never a trained checkpoint of the repo
        "admin_token": admin_token,
    }
    retriever = RetrieverSettings(index_root=workdir / "indexes", default_index="facts-a", **common)
    generator = GeneratorSettings(
        model=generator_model or make_tiny_bart(workdir / "models" / "tiny-bart"), **common
    )
    with backends_serving(retriever, generator) as backends:
        yield backends


@contextmanager
def backends_serving(retriever_settings: Any, generator_settings: Any) -> Iterator[Backends]:
    """The real retriever and generator built from their settings as their servers build them
    and started (port 0: a free one); on exit stopped, and a reload they were told about
    forgotten in Redis (see :func:`_forget_desired_model`). The two share Redis and the admin
    token, as one deployment's services do."""
    from openbook_generator.server import build as build_generator
    from openbook_retriever.server import build as build_retriever

    settings = retriever_settings
    retriever, retriever_servicer, stop_following = build_retriever(retriever_settings)
    generator, generator_servicer = build_generator(generator_settings)
    for service in (retriever, generator):
        service.set_serving(True)
        service.start()
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    try:
        yield Backends(
            retriever.port,
            generator.port,
            generator_servicer,
            token,
            retriever.metrics,
            retriever_servicer,
        )
    finally:
        stop_following.set()
        retriever.stop(0)
        generator.stop(0)
        generator_servicer.close()
        _forget_desired_model(settings.redis_url)


@contextmanager
def generator_service(model: Path, workdir: Path, redis_url: str, **settings: Any) -> Iterator[Any]:
    """The generator service as ``openbook serve generator`` builds it, serving ``model`` on a
    free loopback port; yields ``(settings, servicer, stub)``."""
    import grpc

    from openbook.v1 import generator_pb2_grpc
    from openbook_generator.server import build as build_generator
    from openbook_generator.settings import GeneratorSettings

    config = GeneratorSettings(
        **{
            "host": "127.0.0.1",
            "port": 0,
            "model": model,
            "redis_url": redis_url,
            "checkpoint_dir": workdir / "checkpoints",
            **settings,
        }
    )
    server, servicer = build_generator(config)
    server.set_serving(True)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield config, servicer, generator_pb2_grpc.GeneratorStub(channel)
    finally:
        channel.close()
        server.stop(0)
        servicer.close()


@contextmanager
def retriever_service(settings: Any) -> Iterator[tuple[Any, Any, Any]]:
    """The retriever service as its server builds it from ``settings`` (port 0: a free one),
    serving in this process; yields ``(stub, service, servicer)``, stopped on exit."""
    import grpc

    from openbook.v1 import retriever_pb2_grpc
    from openbook_retriever.server import build as build_retriever

    service, servicer, stop_following = build_retriever(settings)
    service.set_serving(True)
    service.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield retriever_pb2_grpc.RetrieverStub(channel), service, servicer
    finally:
        channel.close()
        stop_following.set()
        service.stop(0)


def _forget_desired_model(redis_url: str) -> None:
    """Drop a reload these backends were told about: replicas started later against the same
    Redis (another test module) would otherwise converge to it at start."""
    from openbook.state.redis_protocol import DESIRED_MODEL_KEY
    from openbook.state.shared_state import redis_client

    with suppress(redis.RedisError):
        redis_client(redis_url).delete(DESIRED_MODEL_KEY)


@contextmanager
def serving_gateway(settings, timeout_s: float = 60) -> Iterator[str]:
    """The gateway app under uvicorn in a thread on a free port, served as ``openbook-gateway``
    serves it (``openbook_gateway.server``); yields its base URL."""
    import uvicorn

    from openbook_gateway.server import uvicorn_config

    port = free_port()
    server = uvicorn.Server(
        uvicorn_config(settings.model_copy(update={"host": "127.0.0.1", "port": port}))
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# The default generator (docker-compose.yml), whose adapter the stack serves with it.
DEFAULT_GENERATOR = "gemma-3-270m"


class LocalStack:
    """The whole system started by ``openbook up`` (docker-compose.yml) on free ports.

    Used by the end-to-end and fault tests and by ``bench/load``. ``var`` must already hold
    ``indexes/`` and a generator under ``models/``; the init step runs but prepares nothing.
    """

    def __init__(
        self,
        var: Path,
        generator: str = "tiny-bart",
        default_index: str = "facts-a",
        admin_token: str = "local-admin-token",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        import os
        import sys

        self.var = Path(var).resolve()
        self.admin_token = admin_token
        self.ports = {
            name: free_port()
            for name in ("gateway", "redis", "retriever", "generator", "rmetrics", "gmetrics")
        }
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OPENBOOK_VAR_DIR": str(self.var),
            "OPENBOOK_GATEWAY_PORT": str(self.ports["gateway"]),
            "OPENBOOK_REDIS_PORT": str(self.ports["redis"]),
            "OPENBOOK_RETRIEVER_PORT": str(self.ports["retriever"]),
            "OPENBOOK_GENERATOR_PORT": str(self.ports["generator"]),
            "OPENBOOK_RETRIEVER_METRICS_PORT": str(self.ports["rmetrics"]),
            "OPENBOOK_GENERATOR_METRICS_PORT": str(self.ports["gmetrics"]),
            "OPENBOOK_GENERATOR_MODEL": f"/var/openbook/models/{generator}",
            "OPENBOOK_RETRIEVER_DEFAULT_INDEX": default_index,
            "OPENBOOK_ADMIN_TOKEN": admin_token,
            "OPENBOOK_TRAINER_PREPARE": "none",
            # the default's adapters (compose's defaults) belong to the default stack only
            **(
                {}
                if generator == DEFAULT_GENERATOR
                else {
                    "OPENBOOK_GENERATOR_ADAPTER": "",
                    "OPENBOOK_RETRIEVER_QUERY_ENCODER_ADAPTER": "",
                }
            ),
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = self.var / "stack.log"
        # Another compose file (e.g. compose_with_redis_default); None: the repository's.
        self.compose_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    @property
    def secrets(self):
        """The secrets ``openbook up`` made on first start
        (openbook.security.secrets.SecretFiles)."""
        from openbook.security.secrets import SecretFiles

        return SecretFiles(self.var / "secrets")

    def redis(self, password: bool = True) -> redis.Redis:
        """A client of the stack's Redis: user ``openbook`` with the password from ``var``
        (an insider), or (``password=False``) any local process without it."""
        if not password:
            return redis.Redis(port=self.ports["redis"], decode_responses=True)
        return redis.Redis(
            port=self.ports["redis"],
            username="openbook",
            password=self.secrets.password.read_text().strip(),
            decode_responses=True,
        )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self, timeout_s: float = 300) -> None:
        import sys

        import httpx

        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        compose = ["--file", str(self.compose_file)] if self.compose_file else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openbook_cli", "up", *compose],
            cwd=REPO_ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Ready means the gateway answers /readyz *and* the launcher has printed that it now
        # supervises the services: before that line, a service that dies takes the whole
        # stack down instead of being restarted.
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"openbook up exited:\n{self.log_tail()}")
            try:
                if (
                    SUPERVISING_LINE in self.log_tail(1_000_000)
                    and httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stack not ready in {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def service_pid(self, service: str) -> int:
        """PID of the live ``service`` process started by ``openbook up`` (its direct child).

        A killed process the launcher has not reaped yet is a zombie and is skipped."""
        import psutil

        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                # The service's own command (openbook-<service>, what compose runs), or
                # `openbook serve <service>`, which runs the same.
                argv = child.cmdline()
                if (
                    any(Path(arg).name == f"openbook-{service}" for arg in argv)
                    or f"serve {service}" in " ".join(argv)
                    or (service == "redis" and child.name().startswith("redis"))
                ):
                    return child.pid
            except psutil.Error:
                continue  # exited while we looked
        raise LookupError(f"no running {service} process")

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
