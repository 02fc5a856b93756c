"""Generator back-ends: one module per model family, each family owning its typed decoding state.

* :mod:`~openbook.rag.backends.base`: the interface (:class:`GeneratorBackend`), the state every
  family extends (:class:`Encoded`, :class:`DecodeState`) and the helpers families share;
* :mod:`~openbook.rag.backends.seq2seq`: any transformers encoder-decoder, through its forward;
* :mod:`~openbook.rag.backends.bart`: BART, decoded by
  :mod:`~openbook.rag.backends.bart_decoding` at inference;
* :mod:`~openbook.rag.backends.causal`: decoder-only LMs, a prompt per passage after a shared
  prefix;
* :mod:`~openbook.rag.backends.registry`: which encoder-decoder family runs a model.

The decoding code (:mod:`openbook.rag.engine` and the searches it drives) only talks to a family
through :class:`GeneratorBackend`. Adding a family: ``openbook/rag/README.md``. The scoring
budget ``SCORE_LOGIT_ELEMENTS`` is read from :mod:`~openbook.rag.backends.base` only (the
families look it up there at call time), so it is not re-exported here.
"""

from openbook.rag.backends.bart import BartBackend, BartDecodeState, BartEncoded
from openbook.rag.backends.base import DecodeState, Encoded, GeneratorBackend, Items
from openbook.rag.backends.causal import (
    DEFAULT_PASSAGE_CACHE_BYTES,
    CausalBackend,
    CausalDecodeState,
    CausalEncoded,
)
from openbook.rag.backends.registry import SEQ2SEQ_FAMILIES, seq2seq_backend
from openbook.rag.backends.seq2seq import Seq2SeqBackend, Seq2SeqDecodeState, Seq2SeqEncoded

__all__ = [
    "DEFAULT_PASSAGE_CACHE_BYTES",
    "SEQ2SEQ_FAMILIES",
    "BartBackend",
    "BartDecodeState",
    "BartEncoded",
    "CausalBackend",
    "CausalDecodeState",
    "CausalEncoded",
    "DecodeState",
    "Encoded",
    "GeneratorBackend",
    "Items",
    "Seq2SeqBackend",
    "Seq2SeqDecodeState",
    "Seq2SeqEncoded",
    "seq2seq_backend",
]
