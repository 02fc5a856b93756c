"""Settings every service shares, and the base of each service's own settings class.

Each service reads only its own class (``openbook_<service>/settings.py``): its fields come from
``OPENBOOK_<SERVICE>_<FIELD>``, except the deployment-wide ones below, which every service of
one deployment must agree on and so have one name each (``OPENBOOK_REDIS_URL``, ...).
``docker-compose.yml`` is the single place that sets them for a deployment; ``openbook up``
reads the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _none_if_blank(value: object) -> object:
    return None if value is None or str(value).strip() == "" else value


# An optional path setting: unset, or set to "" (compose's way to turn a default off), is None.
OptionalPath = Annotated[Path | None, BeforeValidator(_none_if_blank)]


def shared(default, env: str, **constraints):
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


class CommonSettings(BaseSettings):
    # populate_by_name: code and tests construct settings by field name, the environment by
    # variable name.
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    # Bearer token of the gateway's /admin/* and of the services' admin RPCs (SwapIndex,
    # ReloadModel, ...), which the gateway forwards. Unset: admin off everywhere.
    admin_token: SecretStr | None = shared(None, "OPENBOOK_ADMIN_TOKEN")
    redis_url: str = shared("redis://127.0.0.1:6379/0", "OPENBOOK_REDIS_URL")
    redis_timeout_s: float = shared(0.5, "OPENBOOK_REDIS_TIMEOUT_S", gt=0)
    access_log: bool = shared(True, "OPENBOOK_ACCESS_LOG")  # one log line per request / RPC
    log_level: str = shared("INFO", "OPENBOOK_LOG_LEVEL")


class GrpcServiceSettings(CommonSettings):
    """What a gRPC service (retriever, generator) needs to serve, under its own prefix."""

    # Every service binds loopback unless the deployment says otherwise (compose and k8s set
    # 0.0.0.0 inside containers): nothing is reachable from the network by default.
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0)  # each service sets its default
    metrics_port: int = Field(0, ge=0)  # 0: no metrics endpoint
    # Threads for RPCs that do not wait for a batch (health, info, admin); each service adds one
    # per place in its batch queue and batch (see max_queue).
    grpc_workers: int = Field(16, ge=1)
    # RPCs a service accepts at once (running + waiting for a worker); beyond: RESOURCE_EXHAUSTED
    # (the gateway's 429), so a backlog can never grow without bound. 0: no limit.
    grpc_max_concurrent_rpcs: int = Field(256, ge=0)
    # Concurrent requests share one batch (a forward pass, a search); each service sets its own
    # defaults. One request more than max_queue waiting gets RESOURCE_EXHAUSTED (the gateway's
    # 429). The server has a thread for each place in the queue and the batch on top of
    # grpc_workers, so the queue can fill (with fewer threads than waiting places, a full queue
    # could never be observed).
    max_batch_size: int = Field(1, ge=1)
    max_batch_wait_ms: float = Field(0.0, ge=0)
    max_queue: int = Field(1, ge=1)
    # Trained checkpoints (written by the trainer, loaded by retriever and generator).
    checkpoint_dir: Path = shared(Path("var/checkpoints"), "OPENBOOK_CHECKPOINT_DIR")
    load_latest_checkpoint: bool = True
    # torch/OpenMP threads of the service's model work (openbook/compute_threads.py). 0: sized
    # to the CPU the process gets (affinity, cgroup quota, what neighbours take) and resized as
    # that changes; an explicit OMP_NUM_THREADS in the environment also fixes it.
    compute_threads: int = shared(0, "OPENBOOK_COMPUTE_THREADS", ge=0)
