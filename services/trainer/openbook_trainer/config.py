"""TrainConfig: every training option, from a YAML file and/or command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from openbook.rag.adapters import MAX_ALPHA, MAX_RANK, LoraSpec
from openbook_trainer.choices import Adapter, Mode, Precision, Retrieval, Task


class ConfigError(ValueError):
    """Invalid training configuration; the message names the offending option."""


class TrainConfig(BaseModel):
    """Options of ``openbook train``; the field names are the YAML keys and the CLI flags."""

    model_config = ConfigDict(extra="forbid")

    # --- data, models, output
    train: Path
    dev: Path | None = None
    index: Path
    generator: Path
    query_encoder: str | None = Field(
        default=None, description="name or dir; default: the index's own query encoder"
    )
    out: Path
    task: Task = "qa"

    # --- the RAG objective (paper §2)
    mode: Mode = "rag-token"
    k: int = Field(default=5, ge=1, le=100)
    retrieval: Retrieval | None = Field(
        default=None,
        description="dense, or hybrid (dense + BM25, the fused prior); default: the index's "
        "(hybrid where it has a bm25 view)",
    )
    train_query_encoder: bool = True
    train_generator: bool = True
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    exclude_bos_score: bool = False
    answers: Literal["first", "all"] = Field(
        default="first",
        description="train on the first gold answer only, or one example per answer",
    )

    # --- parameter-efficient generator training (openbook/rag/adapters.py): only a LoRA adapter
    # of the generator learns (and is checkpointed, a few MB); the base weights stay frozen
    generator_adapter: Adapter = Field(
        default="none", description="none: train every generator weight; lora: a LoRA adapter only"
    )
    lora_rank: int = Field(default=16, ge=1, le=MAX_RANK)
    lora_alpha: float = Field(default=32.0, gt=0, le=MAX_ALPHA)
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    lora_targets: list[str] | None = Field(
        default=None,
        description="module names to adapt; default: every linear layer but the LM head",
    )
    # The same for the query encoder: a LoRA adapter of every linear layer (rank, alpha and
    # dropout as the generator's) learns instead of the whole encoder, and checkpoints hold the
    # adapter (hundreds of KB) instead of the encoder (87 MiB for MiniLM, 418 MiB for DPR).
    query_encoder_adapter: Adapter = Field(
        default="none",
        description="none: train every query encoder weight; lora: a LoRA adapter only",
    )

    # --- optimisation
    steps: int | None = Field(
        default=None, ge=1, description="optimizer steps (exclusive with epochs)"
    )
    epochs: float | None = Field(default=None, gt=0)
    batch_size: int = Field(default=8, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    lr_generator: float = Field(default=3e-5, gt=0)
    lr_query_encoder: float = Field(default=3e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0, description="0 disables clipping")
    precision: Precision = "auto"
    device: str | None = None
    seed: int = 0

    # --- several processes (torchrun; openbook_trainer/distributed.py)
    shard_optimizer: bool = Field(
        default=False,
        description="under torchrun: ZeRO-1, each rank holds 1/world of the Adam state",
    )
    dist_timeout: float = Field(
        default=1800.0, gt=0, description="seconds a rank waits in a collective before failing"
    )

    # --- evaluation, checkpoints
    eval_every: int = Field(default=0, ge=0, description="steps between dev evaluations; 0: at end")
    eval_max_examples: int | None = Field(default=500, ge=1)
    eval_num_beams: int = Field(default=1, ge=1, le=16)
    eval_max_new_tokens: int = Field(default=32, ge=1, le=512)
    save_every: int = Field(
        default=0, ge=0, description="steps between checkpoints; 0: at end only"
    )
    keep_last: int = Field(default=3, ge=1)
    resume: bool = True
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            self.epochs = 1.0
        if not (self.train_query_encoder or self.train_generator):
            raise ValueError("nothing to train: enable train_query_encoder and/or train_generator")
        if self.generator_adapter != "none" and not self.train_generator:
            raise ValueError(
                f"generator-adapter {self.generator_adapter} trains the generator: drop "
                "--freeze-generator, or set generator-adapter none"
            )
        if self.query_encoder_adapter != "none" and not self.train_query_encoder:
            raise ValueError(
                f"query-encoder-adapter {self.query_encoder_adapter} trains the query encoder: "
                "drop --freeze-query-encoder, or set query-encoder-adapter none"
            )
        if self.lora_targets is not None and not self.lora_targets:
            raise ValueError("lora-targets: name at least one module, or leave it unset")
        return self

    @property
    def lora(self) -> LoraSpec | None:
        """The adapter to train, or None when every generator weight trains."""
        if self.generator_adapter == "none":
            return None
        targets = tuple(self.lora_targets) if self.lora_targets else None
        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_dropout, targets)

    @property
    def query_encoder_lora(self) -> LoraSpec | None:
        """The query encoder's adapter to train (every linear layer), or None."""
        if self.query_encoder_adapter == "none":
            return None
        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_dropout, None)

    @property
    def eval_decoding(self) -> str:
        """The decoder matching the training objective (fast RAG-Sequence for dev scores)."""
        return "rag-token" if self.mode == "rag-token" else "rag-sequence-fast"

    @classmethod
    def load(cls, yaml_path: Path | None = None, **overrides: Any) -> TrainConfig:
        """YAML values, then every non-None override on top; raises :class:`ConfigError`."""
        data: dict[str, Any] = {}
        if yaml_path is not None:
            data = _read_yaml(Path(yaml_path))
        data.update({k: v for k, v in overrides.items() if v is not None})
        # steps/epochs given on the command line replace the other one from YAML
        if overrides.get("steps") is not None:
            data.pop("epochs", None)
        elif overrides.get("epochs") is not None:
            data.pop("steps", None)
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigError(_describe(e)) from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option: value")
    # YAML users naturally write the CLI spelling (lr-generator); accept both.
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "required (give it on the command line or in --config)"
        elif err["type"] == "extra_forbidden":
            msg = "unknown option"
        parts.append(f"{where.replace('_', '-')}: {msg}" if where != "config" else msg)
    return "invalid configuration: " + "; ".join(parts)
