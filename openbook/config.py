"""Settings shared by every service, read from ``OPENBOOK_*`` environment variables.

``docker-compose.yml`` is the single place that sets them for a deployment; ``openbook up``
reads the same file, so the variables below are the whole configuration surface.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_", extra="ignore")

    # --- gateway
    # Every service binds loopback unless the deployment says otherwise (compose and k8s set
    # 0.0.0.0 inside containers): nothing is reachable from the network by default.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    # Bearer token of the gateway's /admin/* and of the services' admin RPCs (SwapIndex,
    # ReloadModel, ...), which the gateway forwards. Unset: admin off everywhere.
    admin_token: SecretStr | None = None
    retriever_addr: str = "127.0.0.1:8051"
    generator_addr: str = "127.0.0.1:8052"
    retrieve_timeout_s: float = Field(10.0, gt=0)
    generate_timeout_s: float = Field(120.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    max_body_bytes: int = Field(64 * 1024, gt=0)  # larger request bodies get 413
    cache_ttl_s: int = Field(24 * 3600, gt=0)

    # --- shared state
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: float = Field(0.5, gt=0)

    # --- retriever
    retriever_host: str = "127.0.0.1"
    # Below the kernel's ephemeral range (32768-60999): a client socket can never hold it
    # when the service restarts.
    retriever_port: int = 8051
    index_root: Path = Path("var/indexes")
    default_index: str = ""
    query_encoder: str = ""
    max_loaded_indexes: int = Field(4, ge=1)
    retriever_metrics_port: int = Field(9101, ge=0)  # 0: no metrics endpoint
    # Concurrent Retrieve calls share one encoder forward pass and one search.
    retriever_max_batch_size: int = Field(32, ge=1)
    retriever_max_batch_wait_ms: float = Field(2.0, ge=0)
    retriever_max_queue: int = Field(64, ge=1)  # as max_queue, for Retrieve

    # --- generator
    generator_host: str = "127.0.0.1"
    generator_port: int = 8052  # below the ephemeral range, as retriever_port
    generator_model: Path = Path("var/models/gemma-3-270m")
    device: str = ""
    dtype: str = ""
    max_batch_size: int = Field(8, ge=1)
    max_batch_wait_ms: float = Field(5.0, ge=0)
    # Requests waiting for a batch; one more gets RESOURCE_EXHAUSTED (the gateway's 429). The
    # generator's thread pool has a thread for each of them on top of grpc_workers, so the queue
    # can fill (with fewer threads than waiting places, a full queue could never be observed).
    max_queue: int = Field(32, ge=1)
    # Estimated working memory (beyond the weights) one batch may hold, openbook/rag/memory.py:
    # a request that needs more alone is refused (OUT_OF_RANGE, the gateway's 413) before
    # anything is allocated, and batches are packed under it.
    generator_memory_mb: int = Field(4096, ge=16)
    # The longest a request is worked on or waits, whatever deadline its caller set (or none).
    generator_max_request_s: float = Field(300.0, gt=0)
    generator_metrics_port: int = Field(9102, ge=0)  # 0: no metrics endpoint

    # --- trained checkpoints (written by the trainer, loaded by retriever and generator)
    checkpoint_dir: Path = Path("var/checkpoints")
    load_latest_checkpoint: bool = True
    # How long POST /admin/reload-model waits for every replica to report the desired model
    # (converged or refused) before answering 202 with the replicas still loading.
    reload_wait_s: float = Field(600.0, gt=0)

    # --- all services
    # Threads for RPCs that do not wait for a batch (health, info, admin); each service adds one
    # per place in its batch queue and batch (see max_queue).
    grpc_workers: int = Field(16, ge=1)
    # RPCs a service accepts at once (running + waiting for a worker); beyond: RESOURCE_EXHAUSTED
    # (the gateway's 429), so a backlog can never grow without bound. 0: no limit.
    grpc_max_concurrent_rpcs: int = Field(256, ge=0)
    access_log: bool = True  # one structured log line per request / RPC, with its request id
    log_level: str = "INFO"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
