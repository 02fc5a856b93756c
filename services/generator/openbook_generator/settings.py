"""The generator's settings: ``OPENBOOK_GENERATOR_*``, plus the deployment-wide ones."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from openbook.config.settings import GrpcServiceSettings, OptionalPath, precision


class GeneratorSettings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_GENERATOR_")

    port: int = Field(8052, ge=0)  # below the ephemeral range, as the retriever's
    metrics_port: int = Field(9102, ge=0)
    model: Path = Path("var/models/gemma-3-270m")
    # A LoRA adapter (openbook/rag/adapters.py) merged into the model at start, unless a trained
    # checkpoint is served instead. docker-compose.yml names the default generator's
    # (data/adapters/gemma-3-270m-squad, installed by `openbook demo prepare`); None or "": the
    # model alone (the few-shot prompt). One that is missing, or that was trained on another
    # model (compose's default when OPENBOOK_GENERATOR_MODEL names another), is skipped with a
    # warning.
    adapter: OptionalPath = None
    device: str = ""  # "": CUDA when present, else CPU
    # The weights' precision: "auto" (CUDA: bf16, fp16 on a GPU without it; CPU: bf16 where the
    # processor has native bf16 arithmetic, AVX512-BF16 / AMX-BF16, else float32), or "float32",
    # "bfloat16", "float16" to force one. openbook/rag/loading.py, resolve_device_dtype. "auto" is
    # the default because bf16 keeps the demo generator's answers within noise: on 100
    # gold-passage SQuAD questions (check_prompt --dtype) EM 27.0 vs 29.0 (4 flips, paired SE
    # 2.0), F1 40.1 vs 43.2, native bf16 with the matrix-product attention (docs/benchmarks.md).
    dtype: str = "auto"
    max_batch_size: int = Field(8, ge=1)
    max_batch_wait_ms: float = Field(5.0, ge=0)
    max_queue: int = Field(32, ge=1)
    # A request with more decoder rows (passages x beams) than this decodes in a batch of its
    # own, so that its rows do not slow every step of the small requests (scheduler.py).
    solo_rows: int = Field(16, ge=1)
    # Prompt tokens prefilled at once: a larger prompt (k=100) is prefilled in chunks, with the
    # other requests' work running between them (scheduler.py).
    prefill_chunk_tokens: int = Field(1024, ge=1)
    # Estimated working memory (beyond the weights) one batch may hold, openbook/rag/memory.py:
    # a request that needs more alone is refused (OUT_OF_RANGE, the gateway's 413) before
    # anything is allocated, and batches are packed under it.
    memory_mb: int = Field(4096, ge=16)
    # Keys/values of passage prompts kept across requests (causal LMs,
    # openbook/rag/passage_cache.py): a passage retrieved again costs only its question's
    # tokens. Held beyond memory_mb; 0 disables.
    passage_cache_mb: int = Field(256, ge=0)
    # Tokens a greedy search (RAG-Token, or each passage of RAG-Sequence) drafts per step by
    # n-gram lookup in its passages and verifies in one forward pass (openbook/rag/drafting.py):
    # answers unchanged; 0: off. Sampling and beam search never draft. Off by default
    # (docs/benchmarks.md).
    draft_tokens: int = Field(0, ge=0, le=64)
    # The LM head's weights: "model" (the model's precision) or "int8" (one scale per output
    # row; causal models on CPU, width a multiple of 16): half the bytes a decoding step reads
    # for Gemma 3's 262,144-token head in bf16, a quarter in float32. In bf16 (torch's
    # weight-only int8 product) each row's near-best tokens are scored again in full
    # precision, so greedy answers are the model head's; in float32 (fbgemm's int8 x int8
    # product, not rescored) 90.7% of the development answers stayed the same, below the 97%
    # a default needs. Off by default: faster only with few rows per step, if at all
    # (openbook/rag/backends/int8_head.py, docs/benchmarks.md, docs/results.md).
    lm_head: Literal["model", "int8"] = "model"
    # The linear weights reordered once, at load, for oneDNN's kernels (causal models on CPU;
    # openbook/rag/packed_weights.py): "auto" bf16 (the answers bitwise the same without AMX,
    # 198 of 200 the same token ids with AMX: decoding ~1.3x faster) and float32 (oneDNN's
    # rounding in place of MKL's: 1.4x per answer on a CPU with AVX2 only, the same token ids
    # as unpacked on every request measured), "bf16" bf16 only, "off". A tied LM head then
    # holds its matrix twice (Gemma 3 270M: 335 MB more resident in bf16, 671 MB in float32).
    packed_weights: Literal["auto", "bf16", "off"] = "auto"
    # The longest a request is worked on or waits, whatever deadline its caller set (or none).
    max_request_s: float = Field(300.0, gt=0)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        try:
            return precision(value)
        except ValueError as e:
            raise ValueError(f"OPENBOOK_GENERATOR_DTYPE={e}") from None
