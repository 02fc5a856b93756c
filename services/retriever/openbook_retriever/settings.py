"""The retriever's settings: ``OPENBOOK_RETRIEVER_*``, plus the deployment-wide ones."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from openbook.config.settings import GrpcServiceSettings, OptionalPath, shared
from openbook.index.encoders import DEFAULT_ENCODER
from openbook.index.engine import EngineKind, check_milvus_uri
from openbook.index.spec import INDEX_TYPES
from openbook.security.secrets import read_secret


class RetrieverSettings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_RETRIEVER_")

    # Below the kernel's ephemeral range (32768-60999): a client socket can never hold it
    # when the service restarts.
    port: int = Field(default=8051, ge=0)
    metrics_port: int = Field(default=9101, ge=0)
    # Where indexes live: the trainer's demo preparation writes there too.
    index_root: Path = shared(Path("var/indexes"), "OPENBOOK_INDEX_ROOT")
    default_index: str = ""
    # A query encoder that replaces the indexes' own where it pairs with them
    # (openbook/index/pairing.py): a name or directory; "": each index's own.
    query_encoder: str = ""
    # A LoRA adapter of the query encoder (openbook/rag/adapters.py), merged at start into
    # query_encoder, or, when that is "", into the base encoder the adapter names.
    # docker-compose.yml names the default's (data/adapters/minilm-squad-query, trained jointly
    # with the generator's, installed by `openbook demo prepare`); None or "": no adapter. One
    # that is missing, or that was trained on another encoder, is skipped with a warning.
    query_encoder_adapter: OptionalPath = None
    max_loaded_indexes: int = Field(default=4, ge=1)
    # Concurrent Retrieve calls share one encoder forward pass and one search.
    max_batch_size: int = Field(default=32, ge=1)
    max_batch_wait_ms: float = Field(default=2.0, ge=0)
    max_queue: int = Field(default=64, ge=1)
    # Compact a live index in the background once its write segment or its hidden base rows
    # (deleted and replaced documents) reach this many passages.
    compact_passages: int = Field(default=10_000, ge=1)
    # What CreateIndex makes when the request names no index to be ``like``: a document
    # encoder (a name or directory; the query encoder is the same) and an index type.
    new_index_encoder: str = DEFAULT_ENCODER
    new_index_type: str = "flat"
    # Where indexes live (issue 41, openbook/index/engine.py): "files", directories under
    # index_root; "milvus", collections in the Milvus at milvus_uri (milvus_engine.py, served
    # by milvus_registry.py; index_root is then unused).
    index_engine: EngineKind = shared(EngineKind.FILES, "OPENBOOK_INDEX_ENGINE")
    # A Milvus server (http(s)://host:port: a cluster, or `milvus-lite server`) or a local
    # path ending in .db, opened as Milvus Lite in this process.
    milvus_uri: str = shared("var/milvus/openbook.db", "OPENBOOK_MILVUS_URI")
    # The file holding the token of a Milvus that needs one ("user:password", or an API key),
    # like the other secrets; unset or "": no token.
    milvus_token_file: OptionalPath = shared(None, "OPENBOOK_MILVUS_TOKEN_FILE")

    def milvus_token(self) -> str:
        """The Milvus token ("" without a token file); ValueError naming the file when it
        cannot be read: the retriever refuses to start rather than connect without it."""
        if self.milvus_token_file is None:
            return ""
        return read_secret(self.milvus_token_file, "Milvus token (OPENBOOK_MILVUS_TOKEN_FILE)")

    def check_secrets(self, program: str) -> None:
        super().check_secrets(program)
        if self.index_engine is EngineKind.MILVUS:
            try:
                self.milvus_token()
            except ValueError as exc:
                print(f"{program}: {exc}", file=sys.stderr)
                raise SystemExit(2) from None

    @field_validator("milvus_uri")
    @classmethod
    def _milvus_uri(cls, value: str) -> str:
        return check_milvus_uri(value)

    @field_validator("new_index_type")
    @classmethod
    def _known_index_type(cls, value: str) -> str:
        if value not in INDEX_TYPES:
            raise ValueError(f"must be one of {', '.join(INDEX_TYPES)}, got {value!r}")
        return value
