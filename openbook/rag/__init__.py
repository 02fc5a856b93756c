"""RAG generation library: RAG-Token / RAG-Sequence decoding, provenance and losses.

Lewis et al., "Retrieval-Augmented Generation for Knowledge-Intensive NLP Tasks", NeurIPS 2020.
"""

from openbook.rag.errors import ModelLoadError
from openbook.rag.generator import RagGenerator, validate_request
from openbook.rag.options import DecodingOptions, GenerationResult, Hypothesis

__all__ = [
    "DecodingOptions",
    "GenerationResult",
    "Hypothesis",
    "ModelLoadError",
    "RagGenerator",
    "validate_request",
]
