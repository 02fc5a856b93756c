"""A real trainer checkpoint of a tiny BART (and MiniLM query encoder), for service tests."""

from __future__ import annotations

from pathlib import Path

from openbook.checkpoint import write_checkpoint
from openbook.index import load_encoder
from openbook.rag import RagGenerator


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
