"""The generator's part of a checkpoint: save it (whole or as a LoRA adapter) and load it back.

Where the part lives and how the checkpoint is published and verified is the format's business
(:mod:`openbook.storage.checkpoint`); this module writes what :meth:`RagGenerator.load` needs to
rebuild the same backend, and loads it. Invariants:

- a saved ``generator/`` holds, besides the Hugging Face model and tokenizer, the backend
  settings of the running backend (never copied from a source directory that need not exist
  where the trainer runs) and ``openbook_manifest.json`` naming the checkpoint's version, which
  the loaded generator reports as its ``model_version``;
- a ``generator_adapter/`` is only ever merged onto the base it was trained on;
- anything missing or corrupt is raised as :class:`openbook.storage.checkpoint.CheckpointError`, so
  a server can keep its current model and report the message.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openbook.rag.adapters import save_adapter
from openbook.rag.generator import RagGenerator
from openbook.rag.loading import RAG_QUESTION_TOKENIZER_DIR
from openbook.rag.prompting import PROMPT_FILE, SEQ2SEQ_FILE, PromptSpec
from openbook.storage.checkpoint import (
    GENERATOR_ADAPTER_DIR,
    GENERATOR_DIR,
    GENERATOR_VERSION_FILE,
    CheckpointError,
    generator_adapter_dir,
    generator_dir,
    open_checkpoint,
)


@dataclass(frozen=True)
class TrainedAdapter:
    """A trained LoRA adapter to checkpoint: its ``peft`` model and its base's identity."""

    peft_model: Any
    base_id: str


def save_generator(
    ckpt: Path,
    generator: Any,
    *,
    version: str,
    base_generator: str,
    adapter: TrainedAdapter | None = None,
    source: Path | None = None,
) -> None:
    """Write a checkpoint's generator part into the checkpoint directory ``ckpt``.

    ``adapter``, when given, is saved instead of the whole generator (``generator_adapter/``):
    the LoRA adapter and the identity of the base it applies to. Otherwise ``generator`` is saved
    by :func:`save_generator_dir` into ``generator/``, with ``version`` recorded as the
    version the loaded generator reports.
    """
    if adapter is not None:
        save_adapter(
            adapter.peft_model, ckpt / GENERATOR_ADAPTER_DIR, adapter.base_id, base_generator
        )
        return
    save_generator_dir(generator, ckpt / GENERATOR_DIR, source)
    # RagGenerator.load reports this as its model_version, so /answer names the checkpoint.
    (ckpt / GENERATOR_DIR / GENERATOR_VERSION_FILE).write_text(
        json.dumps({"version": version}) + "\n", encoding="utf-8"
    )


def save_generator_dir(generator: Any, out: Path, source: Path | None) -> None:
    """A generator as a model directory that :meth:`openbook.rag.RagGenerator.load` loads.

    ``generator`` is anything with ``save(dir)``, an object with ``.model`` and ``.tokenizer``
    (a RagGenerator backend), or a ``(model, tokenizer)`` pair. Written: the weights and
    tokenizer, the backend settings it runs with, and ``openbook_*.json`` files of ``source``
    (the directory it was loaded from, where it still exists) that are not rewritten.
    """
    if hasattr(generator, "save") and callable(generator.save):
        generator.save(out)
    else:
        if isinstance(generator, tuple):
            model, tokenizer = generator
        else:
            model, tokenizer = generator.model, generator.tokenizer
        backend = getattr(generator, "backend", generator)
        prefix = getattr(backend, "prefix", None)
        if prefix and not getattr(model.config, "prefix", None):
            # A generator loaded from a RAG checkpoint keeps its input prefix in the RAG config,
            # which a plain BART save would drop.
            model.config.prefix = prefix
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        _save_backend_settings(generator, backend, out)
    if source is not None:
        # not the version, nor the demo's list of the source's file hashes: not these files
        skip = {GENERATOR_VERSION_FILE, "openbook_model.json"}
        for extra in Path(source).glob("openbook_*.json"):
            if extra.name not in skip and not (out / extra.name).exists():
                shutil.copy2(extra, out / extra.name)


def _save_backend_settings(generator: Any, backend: Any, out: Path) -> None:
    """Write what the loader needs besides model + tokenizer to rebuild ``backend`` as it runs.

    Taken from the running backend, never from its source directory (which need not exist where
    the trainer runs): a seq2seq backend's input format (``openbook_seq2seq.json``: a RAG
    checkpoint's prefix, title_sep, doc_sep, max_combined_length, n_docs) and its
    question-encoder tokenizer (a RAG checkpoint's, saved with ``save_pretrained``); a causal
    LM's prompt (``openbook_prompt.json``).
    """
    spec = getattr(backend, "spec", None)
    if isinstance(spec, PromptSpec):
        (out / PROMPT_FILE).write_text(spec.to_json(), encoding="utf-8")
        return
    if not all(hasattr(backend, a) for a in ("title_sep", "doc_sep", "max_combined_length")):
        return
    settings: dict[str, Any] = {
        "prefix": getattr(backend, "prefix", None),
        "title_sep": backend.title_sep,
        "doc_sep": backend.doc_sep,
        "max_combined_length": int(backend.max_combined_length),
        "question_tokenizer": None,
    }
    n_docs = getattr(generator, "default_k", None) or getattr(backend, "n_docs", None)
    if isinstance(n_docs, int) and not isinstance(n_docs, bool) and n_docs > 0:
        settings["n_docs"] = n_docs
    question_tokenizer = getattr(backend, "question_tokenizer", None)
    if question_tokenizer is not None:
        question_tokenizer.save_pretrained(out / RAG_QUESTION_TOKENIZER_DIR)
        settings["question_tokenizer"] = RAG_QUESTION_TOKENIZER_DIR
    (out / SEQ2SEQ_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def load_generator(
    path: Path,
    *,
    device: str | None = None,
    dtype: str | None = None,
    verify: bool = True,
    base: Path | None = None,
) -> RagGenerator:
    """The generator of a checkpoint (or of the latest one under a root): a
    :class:`RagGenerator` whose ``model_version`` is the checkpoint's version.

    A checkpoint that holds only an adapter (``generator_adapter/``) is loaded onto ``base``
    (default: the base model the trainer recorded) and merged into it; a base other than the
    one it was trained on is refused. The checkpoint is verified first unless ``verify=False``
    (the caller just did). Raises :class:`CheckpointError` for anything missing or corrupt,
    including files the model loader rejects.
    """
    ckpt, manifest = open_checkpoint(path, verify=verify)
    adapter = generator_adapter_dir(ckpt)
    where = GENERATOR_ADAPTER_DIR if adapter is not None else GENERATOR_DIR
    try:
        if adapter is None:
            generator = RagGenerator.load(generator_dir(ckpt), device=device, dtype=dtype)
        else:
            base_dir = Path(base if base is not None else manifest.base_generator)
            generator = RagGenerator.load(base_dir, device=device, dtype=dtype)
            generator.apply_adapter(adapter, base_dir)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {manifest.version}: {where}/: {e}") from None
    generator.model_version = manifest.version
    return generator
