"""The query encoder's part of a checkpoint: save it (whole or as a LoRA adapter), load it back.

Where the part lives and how the checkpoint is published and verified is the format's business
(:mod:`openbook.storage.checkpoint`). Invariants: a checkpoint holds at most one of
``query_encoder/`` and ``query_encoder_adapter/`` (none: the query encoder was not trained, and the
retriever keeps the index's own); an adapter is only ever merged onto the base encoder it was
trained on; the encoder loaded is private and uncached, so it never replaces the one an index
shares; anything missing or corrupt is raised as
:class:`openbook.storage.checkpoint.CheckpointError`.
"""

from __future__ import annotations

from pathlib import Path

from openbook.errors import InvalidArgument
from openbook.index.encoders import Encoder, load_encoder
from openbook.rag.adapters import save_adapter
from openbook.rag.checkpoint import TrainedAdapter
from openbook.storage.checkpoint import (
    QUERY_ENCODER_ADAPTER_DIR,
    QUERY_ENCODER_DIR,
    CheckpointError,
    open_checkpoint,
    query_encoder_dir,
)


def save_query_encoder(
    ckpt: Path,
    encoder: Encoder | None,
    *,
    adapter: TrainedAdapter | None = None,
    base_query_encoder: str | None = None,
) -> None:
    """Write a checkpoint's query encoder part into the checkpoint directory ``ckpt``.

    ``adapter``, when given, is saved instead of ``encoder`` (``query_encoder_adapter/``, its
    base named by ``base_query_encoder``); ``encoder`` None and no adapter writes nothing.
    """
    if adapter is not None:
        if base_query_encoder is None:
            raise InvalidArgument("a query encoder adapter needs base_query_encoder")
        save_adapter(
            adapter.peft_model,
            ckpt / QUERY_ENCODER_ADAPTER_DIR,
            adapter.base_id,
            str(base_query_encoder),
        )
    elif encoder is not None:
        encoder.save(ckpt / QUERY_ENCODER_DIR)


def load_query_encoder(
    path: Path, *, device: str | None = None, verify: bool = True
) -> Encoder | None:
    """The query encoder of a checkpoint (or of the latest one under a root), a private,
    uncached :class:`Encoder` on ``device`` (default: where it loads), or None when the
    checkpoint has none. An adapter (``query_encoder_adapter/``) is merged into the base
    encoder it names, which must be the one it was trained on. Verified first unless
    ``verify=False``; raises :class:`CheckpointError`."""
    ckpt, _ = open_checkpoint(path, verify=verify)
    d = query_encoder_dir(ckpt)
    if d is None:
        return None
    try:
        encoder = load_encoder(str(d), role="query", cached=False)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt.name}: {d.name}/: {e}") from None
    if device is not None:
        encoder.to(device)
    return encoder
