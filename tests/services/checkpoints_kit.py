"""A real trainer checkpoint of a tiny BART (and MiniLM query encoder), for service tests."""

from __future__ import annotations

from pathlib import Path

from openbook.index import load_encoder
from openbook.rag import RagGenerator
from openbook_trainer.checkpoints import write_checkpoint


def tiny_checkpoint(root: Path, step: int, bart: Path) -> Path:
    """Write checkpoint ``step`` under ``root`` (``latest`` follows it) and return its path."""
    return write_checkpoint(
        root,
        step,
        query_encoder=load_encoder("all-MiniLM-L6-v2", cached=False),
        generator=RagGenerator.load(bart).backend,
        base_generator=str(bart),
        base_query_encoder="all-MiniLM-L6-v2",
        index={"name": "facts-a"},
        data_sha256="0" * 64,
        generator_source=bart,
    )


def tiny_adapter_checkpoint(root: Path, step: int, base: Path, trained_on: Path | None = None):
    """An adapter-only checkpoint (LoRA on the generator, random non-zero updates so that it
    changes answers) of base model ``base``, claiming to be trained on ``trained_on`` (default:
    ``base``; another model makes an adapter for the wrong base)."""
    from openbook.rag.adapters import LoraSpec, attach_lora, base_identity
    from openbook.rag.checkpoint import TrainedAdapter
    from openbook_testkit.rag import randomize_lora

    generator = RagGenerator.load(base, dtype="float32")
    peft_model = attach_lora(generator.model, LoraSpec(rank=2, alpha=4.0))
    randomize_lora(generator.model, step)
    return write_checkpoint(
        root,
        step,
        query_encoder=load_encoder("all-MiniLM-L6-v2", cached=False),
        generator=None,
        generator_adapter=TrainedAdapter(peft_model, base_identity(trained_on or base)),
        base_generator=str(trained_on or base),
        base_query_encoder="all-MiniLM-L6-v2",
        index={"name": "facts-a"},
        data_sha256="0" * 64,
    )
