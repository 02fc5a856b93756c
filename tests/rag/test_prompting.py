"""Generator inputs are formatted and tokenised exactly like transformers' RagRetriever."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import RagConfig
from transformers.models.rag.retrieval_rag import RagRetriever

from openbook.rag.prompting import seq2seq_input
from openbook.types import Passage

DOCS = [
    ('"Paris"', "Paris is the capital  of France."),
    ("Hamlet", '"Hamlet" is a play by Shakespeare.'),
    ('"Quoted', 'only one  quote"'),
    ("", "No title."),
]


@pytest.mark.parametrize("prefix", (None, "summarize: "))
def test_matches_rag_retriever_postprocess(dirs, load, prefix):
    gen = load(dirs.bart(0))
    question = "who  wrote hamlet?"
    fake = SimpleNamespace(
        config=RagConfig(max_combined_length=300), generator_tokenizer=gen.tokenizer
    )
    docs = [{"title": [t for t, _ in DOCS], "text": [x for _, x in DOCS]}]
    ids, mask = RagRetriever.postprocess_docs(
        fake, docs, [question], prefix, len(DOCS), return_tensors="pt"
    )
    strings = [seq2seq_input(t, x, question, prefix) for t, x in DOCS]
    assert (
        strings[0]
        == (prefix or "") + "Paris / Paris is the capital of France. // who wrote hamlet?"
    )
    gen.backend.prefix = prefix
    try:
        ours, our_mask = gen.backend._tokenize_inputs(
            [(question, Passage(str(i), t, x)) for i, (t, x) in enumerate(DOCS)]
        )
    finally:
        gen.backend.prefix = None
    # transformers pads to max_combined_length; the unpadded part must be identical
    width = ours.shape[1]
    assert (ids[:, :width] == ours).all() and (mask[:, :width] == our_mask).all()
    assert mask[:, width:].sum() == 0
