"""The gateway's settings: ``OPENBOOK_GATEWAY_*``, plus the deployment-wide ones."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from openbook.config.settings import CommonSettings


class GatewaySettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_GATEWAY_")

    host: str = "127.0.0.1"  # loopback unless the deployment says otherwise
    port: int = Field(default=8000, ge=0)
    # host:port of the retriever; "a:1,b:2" (comma-separated) fans out over index shards.
    retriever_addr: str = "127.0.0.1:8051"
    generator_addr: str = "127.0.0.1:8052"
    retrieve_timeout_s: float = Field(default=10.0, gt=0)
    generate_timeout_s: float = Field(default=120.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    max_body_bytes: int = Field(default=64 * 1024, gt=0)  # larger request bodies get 413
    # Bodies of document writes (PUT/POST under /indexes/): an article of up to
    # MAX_DOCUMENT_TEXT_CHARS characters, or a batch of them (openbook.validation.limits).
    max_document_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # Pages of an uploaded PDF (POST /indexes/{index}/documents, openbook_gateway.extraction):
    # more is refused (413) before any page is read. The file's size is bounded by
    # max_document_body_bytes, while it streams in.
    upload_max_pages: int = Field(default=1000, gt=0)
    # Wall time of reading one uploaded file (every format): past it the upload is refused
    # (413) and nothing is written. The budgets of openbook_gateway.extraction keep any
    # accepted file well inside it; this is what stops the work whatever a file does.
    upload_max_seconds: float = Field(default=30.0, gt=0)
    # Request heads (the request line and the header fields; openbook_gateway.http_protocol):
    # a head not complete within header_timeout_s of its first byte closes the connection (408
    # if part of it came), one over max_header_bytes or with more than max_header_count fields
    # gets 431. Browsers send well under 8 KiB and 30 fields.
    header_timeout_s: float = Field(default=10.0, gt=0)
    max_header_bytes: int = Field(default=16 * 1024, ge=1024)
    max_header_count: int = Field(default=100, ge=16)
    cache_ttl_s: int = Field(default=24 * 3600, gt=0)
    # How long POST /v1/responses keeps a response's conversation state for a later
    # previous_response_id (openbook_gateway.stored_responses).
    response_ttl_s: int = Field(default=24 * 3600, gt=0)
    # How long POST /admin/reload-model waits for every replica to report the desired model
    # (converged or refused) before answering 202 with the replicas still loading.
    reload_wait_s: float = Field(default=600.0, gt=0)
    # Keys with the "ask" scope (openbook_gateway.access), comma-separated: while set, /v1 and
    # /mcp need a key (one of these, one made with POST /admin/keys, or the admin token).
    # Unset: /v1 is open, as /answer is.
    api_keys: SecretStr | None = None
    # Every route but /healthz, /readyz, /metrics and the page needs a key (issue 43;
    # openbook_gateway.access): 401 without one, 403 for a key without the route's scope.
    # False: /answer, reads and (without api_keys) /v1 and /mcp are open, as in the demo.
    require_keys: bool = False
    # Answers whose confidence (openbook/rag/confidence.py) is below this abstain: an empty
    # answer with "abstained": true. A request's min_confidence overrides it. Unset: never.
    min_confidence: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
