"""Settings every service shares, and the base of each service's own settings class.

Each service reads only its own class (``openbook_<service>/settings.py``): its fields come from
``OPENBOOK_<SERVICE>_<FIELD>``, except the deployment-wide ones below, which every service of
one deployment must agree on and so have one name each (``OPENBOOK_REDIS_URL``, ...).
``docker-compose.yml`` is the single place that sets them for a deployment; ``openbook up``
reads the same file.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from openbook.config import redis_endpoint
from openbook.errors import InvalidArgument
from openbook.security.sealing import load_sealer
from openbook.security.secrets import read_secret


def _none_if_blank(value: object) -> object:
    return None if value is None or str(value).strip() == "" else value


# An optional path setting: unset, or set to "" (compose's way to turn a default off), is None.
OptionalPath = Annotated[Path | None, BeforeValidator(_none_if_blank)]
OptionalPort = Annotated[
    Annotated[int, Field(ge=1, le=65535)] | None, BeforeValidator(_none_if_blank)
]

log = logging.getLogger(__name__)


def shared(default: Any, env: str, **constraints: Any) -> Any:
    """A deployment-wide field: read from ``env`` whatever the class's prefix."""
    return Field(default, validation_alias=env, **constraints)


# Spellings of a model's precision and the torch dtype name each stands for ("auto": the
# hardware policy, openbook.rag.loading.auto_dtype). Torch-free, so that reading settings does
# not import torch; openbook.rag.loading maps the names to dtypes.
PRECISIONS = {
    "auto": "auto",
    **dict.fromkeys(("float32", "fp32"), "float32"),
    **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
    **dict.fromkeys(("float16", "fp16", "half"), "float16"),
}


def precision(value: str) -> str:
    """``value`` (any spelling of :data:`PRECISIONS`, any case; empty: auto) as the torch dtype
    name it stands for; InvalidArgument (a ValueError) naming the choices where it is none."""
    name = value.strip().lower() or "auto"
    if name not in PRECISIONS:
        raise InvalidArgument(
            f"{value!r} is not a precision: use auto, float32, bfloat16 or float16"
        )
    return PRECISIONS[name]


class CommonSettings(BaseSettings):
    # populate_by_name: code and tests construct settings by field name, the environment by
    # variable name.
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    # Bearer token of the gateway's /admin/* and of the services' admin RPCs (SwapIndex,
    # ReloadModel, ...), which the gateway forwards. Unset: admin off everywhere.
    admin_token: SecretStr | None = shared(None, "OPENBOOK_ADMIN_TOKEN")
    # Unset: the Redis `openbook up` recorded under OPENBOOK_VAR_DIR, else 127.0.0.1 on
    # OPENBOOK_REDIS_PORT (default 6379); openbook.config.redis_endpoint says why, in that order.
    redis_url: str = shared(redis_endpoint.default_url(), "OPENBOOK_REDIS_URL")
    redis_port: OptionalPort = shared(None, "OPENBOOK_REDIS_PORT")
    var_dir: OptionalPath = shared(None, "OPENBOOK_VAR_DIR")  # None: ./var, as compose
    redis_timeout_s: float = shared(0.5, "OPENBOOK_REDIS_TIMEOUT_S", gt=0)
    # Redis's ACL user and the file holding its password (openbook-secrets makes both; compose,
    # `openbook up` and k8s set the file). Unset file: the URL's own credentials, if any.
    redis_username: str = shared("openbook", "OPENBOOK_REDIS_USERNAME", min_length=1)
    redis_password_file: OptionalPath = shared(None, "OPENBOOK_REDIS_PASSWORD_FILE")
    # TLS is one setting away: a rediss:// URL turns it on; this CA file verifies the server.
    redis_tls_ca_file: OptionalPath = shared(None, "OPENBOOK_REDIS_TLS_CA_FILE")
    # Key of the MACs sealing cached answers and the shared active index
    # (openbook.security.sealing).
    server_key_file: OptionalPath = shared(None, "OPENBOOK_SERVER_KEY_FILE")
    access_log: bool = shared(True, "OPENBOOK_ACCESS_LOG")  # one log line per request / RPC
    log_level: str = shared("INFO", "OPENBOOK_LOG_LEVEL")
    # Where redis_url came from, for messages: the variable, the record, or the default.
    _redis_source: str = PrivateAttr(redis_endpoint.URL_VARIABLE)

    @model_validator(mode="after")
    def _find_redis(self) -> CommonSettings:
        """Without an explicit URL, the Redis that `openbook up` recorded (its password and
        server key files too, where not set), else 127.0.0.1 on the port variable."""
        if self.redis_url and "redis_url" in self.model_fields_set:
            return self
        record = redis_endpoint.record_path(self.var_dir)
        try:
            recorded = redis_endpoint.read_record(record)
        except ValueError as exc:  # a record damaged by hand: said, then as if absent
            log.warning("%s", exc)
            recorded = None
        url, recorded, self._redis_source = redis_endpoint.resolve(
            self.redis_port, recorded, record
        )
        self.redis_url = url
        if recorded is not None:
            explicit = self.model_fields_set
            if recorded.username and "redis_username" not in explicit:
                self.redis_username = recorded.username
            for name in ("redis_password_file", "server_key_file", "redis_tls_ca_file"):
                value = getattr(recorded, name.removeprefix("redis_"))
                if value and name not in explicit:
                    setattr(self, name, Path(value))
        return self

    @property
    def redis_source(self) -> str:
        """Where ``redis_url`` came from (the variable, `openbook up`'s record, the default)."""
        return self._redis_source

    def redis_problem(self) -> redis_endpoint.Problem | None:
        """None if Redis answers as the services will talk to it; else why not, in one line
        naming it, where its URL came from and the variable to set."""
        options = self.redis_options()
        return redis_endpoint.problem(
            options.url, self.redis_source, options.client_kwargs(), options.username
        )

    def check_redis(self, program: str) -> None:
        """At start: a warning naming Redis and the variable to set when it cannot be reached
        (the service runs on without it, as when Redis goes away later: answers uncached,
        nothing shared until it answers); exit with a message if the URL is no Redis URL."""
        problem = self.redis_problem()
        if problem is None:
            return
        if problem.bad_url:
            print(f"{program}: {problem.message}", file=sys.stderr)
            raise SystemExit(2)
        log.warning("%s; serving without Redis until it answers", problem.message)

    def redis_options(self) -> RedisOptions:
        """How to reach Redis; ``ValueError`` naming the file if the password cannot be read
        (a service refuses to start rather than run unauthenticated by mistake)."""
        password = None
        if self.redis_password_file is not None:
            password = read_secret(
                self.redis_password_file, "redis password (OPENBOOK_REDIS_PASSWORD_FILE)"
            )
        return RedisOptions(
            url=self.redis_url,
            timeout_s=self.redis_timeout_s,
            username=self.redis_username if password is not None else None,
            password=password,
            tls_ca_file=self.redis_tls_ca_file,
        )

    def check_secrets(self, program: str) -> None:
        """Exit with a message naming the file if the Redis password or the server key is
        configured but cannot be read: a service must not start without them."""
        try:
            self.redis_options()
            if self.server_key_file is not None:
                load_sealer(self.server_key_file)
        except ValueError as exc:
            print(f"{program}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None


@dataclass(frozen=True)
class RedisOptions:
    """Everything a Redis client of openbook needs. ``username``/``password`` None: the URL's
    (``redis://user:password@host``), or none. ``tls_ca_file`` applies to ``rediss://`` URLs."""

    url: str
    timeout_s: float = 0.5
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: Path | None = None

    def client_kwargs(self) -> dict:
        """Keyword arguments of redis-py's ``from_url`` (sync and asyncio alike)."""
        kwargs: dict = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "decode_responses": True,
        }
        if self.password is not None:
            kwargs.update(username=self.username, password=self.password)
        if self.tls_ca_file is not None and self.url.startswith("rediss://"):
            kwargs["ssl_ca_certs"] = str(self.tls_ca_file)
        return kwargs


class GrpcServiceSettings(CommonSettings):
    """What a gRPC service (retriever, generator) needs to serve, under its own prefix."""

    # Every service binds loopback unless the deployment says otherwise (compose and k8s set
    # 0.0.0.0 inside containers): nothing is reachable from the network by default.
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0)  # each service sets its default
    metrics_port: int = Field(default=0, ge=0)  # 0: no metrics endpoint
    # Threads for RPCs that do not wait for a batch (health, info, admin); each service adds one
    # per place in its batch queue and batch (see max_queue).
    grpc_workers: int = Field(default=16, ge=1)
    # RPCs a service accepts at once (running + waiting for a worker); beyond: RESOURCE_EXHAUSTED
    # (the gateway's 429), so a backlog can never grow without bound. 0: no limit.
    grpc_max_concurrent_rpcs: int = Field(default=256, ge=0)
    # Concurrent requests share one batch (a forward pass, a search); each service sets its own
    # defaults. One request more than max_queue waiting gets RESOURCE_EXHAUSTED (the gateway's
    # 429). The server has a thread for each place in the queue and the batch on top of
    # grpc_workers, so the queue can fill (with fewer threads than waiting places, a full queue
    # could never be observed).
    max_batch_size: int = Field(default=1, ge=1)
    max_batch_wait_ms: float = Field(default=0.0, ge=0)
    max_queue: int = Field(default=1, ge=1)
    # Trained checkpoints (written by the trainer, loaded by retriever and generator).
    checkpoint_dir: Path = shared(Path("var/checkpoints"), "OPENBOOK_CHECKPOINT_DIR")
    load_latest_checkpoint: bool = True
    # torch/OpenMP threads of the service's model work (openbook/runtime/compute_threads.py). 0:
    # sized to the CPU the process gets (affinity, cgroup quota, what neighbours take) and resized
    # as that changes; an explicit OMP_NUM_THREADS in the environment also fixes it.
    compute_threads: int = shared(0, "OPENBOOK_COMPUTE_THREADS", ge=0)
