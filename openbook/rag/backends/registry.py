"""Which back-end class runs an encoder-decoder model.

:data:`SEQ2SEQ_FAMILIES` lists the encoder-decoder families with a path of their own, most
specific first; :func:`seq2seq_backend` (called by :mod:`openbook.rag.loading`) builds the first
whose ``supports(model)`` holds, else the generic
:class:`~openbook.rag.backends.seq2seq.Seq2SeqBackend`, which runs any of them. It is its own
module because it names the families, which import :mod:`~openbook.rag.backends.base`.
Decoder-only models have one family (:class:`~openbook.rag.backends.causal.CausalBackend`),
built by :mod:`openbook.rag.loading` when a checkpoint carries a prompt spec.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openbook.rag.backends.bart import BartBackend
from openbook.rag.backends.seq2seq import Seq2SeqBackend

# Encoder-decoder families, most specific first: seq2seq_backend() builds the first whose
# ``supports(model)`` holds, else the generic Seq2SeqBackend.
SEQ2SEQ_FAMILIES: list[type[Seq2SeqBackend]] = [BartBackend]


def seq2seq_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **options: Any
) -> Seq2SeqBackend:
    """The backend of the most specific registered family that runs ``model`` (``options``:
    :class:`Seq2SeqBackend`'s keyword arguments)."""
    family = next((f for f in SEQ2SEQ_FAMILIES if f.supports(model)), Seq2SeqBackend)
    return family(model, tokenizer, **options)
