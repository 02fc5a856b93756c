"""Whole checkpoints: write the generator, the query encoder and the trainer's state as one, and
load a checkpoint's models together.

The trainer is the one place that composes both halves of a checkpoint: the generator
(:mod:`openbook.rag.checkpoint`) and the query encoder (:mod:`openbook.index.checkpoint`), over
the format of :mod:`openbook.storage.checkpoint` (layout, manifest, atomic publish, verification).
Services load one half each and never import this module. Invariant: a checkpoint is verified
once before any of its models is loaded, and published only when every part is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openbook.index import Encoder
from openbook.index.checkpoint import load_query_encoder, save_query_encoder
from openbook.rag import RagGenerator
from openbook.rag.checkpoint import TrainedAdapter, load_generator, save_generator
from openbook.storage.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointManifest,
    CheckpointRecord,
    open_checkpoint,
    publish_checkpoint,
    trainer_state_path,
    version_name,
)


def write_checkpoint(
    root: Path,
    step: int,
    *,
    query_encoder: Encoder | None,
    generator: Any,
    base_generator: str,
    generator_adapter: TrainedAdapter | None = None,
    query_encoder_adapter: TrainedAdapter | None = None,
    base_query_encoder: str | None,
    index: Mapping[str, str],
    data_sha256: str,
    metrics: Mapping[str, float] | None = None,
    trained: list[str] | None = None,
    config: Mapping[str, Any] | None = None,
    trainer_state: Mapping[str, Any] | None = None,
    generator_source: Path | None = None,
    keep_last: int | None = None,
    _before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/step-XXXXXX`` atomically, point ``root/latest`` at it, return its path.

    ``generator`` is anything with ``save(dir)``, an object with ``.model`` and ``.tokenizer``
    (a RagGenerator backend), or a ``(model, tokenizer)`` pair, saved with the backend settings
    the loader needs (:func:`openbook.rag.checkpoint.save_generator_dir`); other
    ``openbook_*.json`` files are copied from ``generator_source``, the directory the generator
    was loaded from, where it still exists. All of them are checksummed in the manifest.
    ``query_encoder`` is an :class:`openbook.index.Encoder` or None when it was not trained
    (the serving retriever then keeps the index's own query encoder).
    ``generator_adapter``, when given, is saved instead of the whole generator
    (``generator_adapter/``): the LoRA adapter and the identity of the base it applies to.
    ``query_encoder_adapter`` likewise replaces ``query_encoder`` (``query_encoder_adapter/``,
    its base named by ``base_query_encoder``).
    ``keep_last`` deletes all but the newest N checkpoints after ``latest`` moved.
    ``_before_rename`` is a test hook called with the complete temporary directory.
    """

    def fill(tmp: Path) -> None:
        save_generator(
            tmp,
            generator,
            version=version_name(step),
            base_generator=base_generator,
            adapter=generator_adapter,
            source=generator_source,
        )
        save_query_encoder(
            tmp,
            query_encoder,
            adapter=query_encoder_adapter,
            base_query_encoder=base_query_encoder,
        )
        if trainer_state is not None:
            torch.save(dict(trainer_state), tmp / TRAINER_STATE)

    record = CheckpointRecord(
        base_generator, base_query_encoder, index, data_sha256, metrics, trained, config
    )
    return publish_checkpoint(
        root, step, fill, record, keep_last=keep_last, _before_rename=_before_rename
    )


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint's models, ready to serve or evaluate."""

    path: Path
    manifest: CheckpointManifest
    generator: RagGenerator
    query_encoder: Encoder | None  # None when the encoder was not trained

    @property
    def version(self) -> str:
        return self.manifest.version


def load_checkpoint(
    path: Path, *, device: str | None = None, dtype: str | None = None
) -> LoadedCheckpoint:
    """Verify a checkpoint (or the latest one under a root) once and load its models
    (:func:`load_generator`, :func:`load_query_encoder`); raises :class:`CheckpointError`."""
    ckpt, manifest = open_checkpoint(path)
    generator = load_generator(ckpt, device=device, dtype=dtype, verify=False)
    query_encoder = load_query_encoder(ckpt, device=device, verify=False)
    return LoadedCheckpoint(ckpt, manifest, generator, query_encoder)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The optimizer / scheduler / RNG state a checkpoint was saved with, on the CPU (the
    checkpoint is not verified again: :func:`openbook.storage.checkpoint.open_checkpoint` first)."""
    state_file = trainer_state_path(Path(path))
    if state_file is None:
        raise CheckpointError(f"{path} has no trainer state to resume from")
    state: dict[str, Any] = torch.load(state_file, map_location="cpu", weights_only=True)
    return state
