"""The retriever's settings: ``OPENBOOK_RETRIEVER_*``, plus the deployment-wide ones."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from openbook.settings import GrpcServiceSettings, shared


class RetrieverSettings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_RETRIEVER_")

    # Below the kernel's ephemeral range (32768-60999): a client socket can never hold it
    # when the service restarts.
    port: int = Field(8051, ge=0)
    metrics_port: int = Field(9101, ge=0)
    # Where indexes live: the trainer's demo preparation writes there too.
    index_root: Path = shared(Path("var/indexes"), "OPENBOOK_INDEX_ROOT")
    default_index: str = ""
    query_encoder: str = ""
    max_loaded_indexes: int = Field(4, ge=1)
    # Concurrent Retrieve calls share one encoder forward pass and one search.
    max_batch_size: int = Field(32, ge=1)
    max_batch_wait_ms: float = Field(2.0, ge=0)
    max_queue: int = Field(64, ge=1)
