"""How the generator service sets up every model it serves: at start and after each reload."""

from __future__ import annotations

from dataclasses import dataclass

from openbook.rag import RagGenerator
from openbook.rag.packed_weights import Packing


@dataclass(frozen=True)
class ModelSetup:
    """What :meth:`apply` does to a loaded generator before it serves.

    passage_cache_bytes: keys/values of passage prompts kept across requests (causal models,
        :mod:`openbook.rag.passage_cache`); None: the backend's default.
    draft_tokens: tokens greedy searches draft per step (:mod:`openbook.rag.drafting`); 0: off.
    int8_head: the LM head in int8 (:mod:`openbook.rag.backends.int8_head`); a model that
        cannot have it is refused (``ModelLoadError``, a ``ValueError``).
    packed_weights: which precisions get their linear weights reordered once for this
        machine's kernels (:mod:`openbook.rag.packed_weights`, causal models on CPU; by default
        bf16 and float32).
    """

    passage_cache_bytes: int | None = None
    draft_tokens: int = 0
    int8_head: bool = False
    packed_weights: Packing = Packing.AUTO

    def apply(self, generator: RagGenerator) -> RagGenerator:
        """``generator``, set up (in place) as this says."""
        if self.passage_cache_bytes is not None:
            generator.backend.set_passage_cache(self.passage_cache_bytes)
        if self.int8_head:  # from the plain head: before the weights are packed
            generator.backend.quantize_head()
        generator.pack_weights(self.packed_weights)
        # after the head is settled: the memory model asks whether the backend defers it
        generator.set_draft_tokens(self.draft_tokens)
        return generator
