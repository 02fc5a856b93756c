"""The generator's settings: ``OPENBOOK_GENERATOR_*``, plus the deployment-wide ones."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from openbook.settings import GrpcServiceSettings


class GeneratorSettings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_GENERATOR_")

    port: int = Field(8052, ge=0)  # below the ephemeral range, as the retriever's
    metrics_port: int = Field(9102, ge=0)
    model: Path = Path("var/models/gemma-3-270m")
    device: str = ""  # "": CUDA when present, else CPU
    dtype: str = ""  # "": the model's own
    max_batch_size: int = Field(8, ge=1)
    max_batch_wait_ms: float = Field(5.0, ge=0)
    max_queue: int = Field(32, ge=1)
    # Estimated working memory (beyond the weights) one batch may hold, openbook/rag/memory.py:
    # a request that needs more alone is refused (OUT_OF_RANGE, the gateway's 413) before
    # anything is allocated, and batches are packed under it.
    memory_mb: int = Field(4096, ge=16)
    # The longest a request is worked on or waits, whatever deadline its caller set (or none).
    max_request_s: float = Field(300.0, gt=0)
