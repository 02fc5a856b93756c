"""A RAG checkpoint's generator reads the question as transformers' ``RagRetriever`` gives it:
the question-encoder tokenizer's decoding of the question's input ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.rag import DecodingOptions, ModelLoadError, RagGenerator
from openbook_testkit.rag import (
    QUESTION,
    make_passages,
    make_tiny_rag_checkpoint,
    strip_trailing,
)

QUESTIONS = [
    QUESTION,
    "  Who WROTE   Hamlet ?",
    "Is Mount Everest in the Himalayas, or in Zanzibar?",  # "zanzibar" is not in the vocabulary
]


@pytest.fixture(scope="module")
def rag_ckpt(tmp_path_factory) -> Path:
    return make_tiny_rag_checkpoint(tmp_path_factory.mktemp("ragq") / "rag-token-tiny", seed=0)


@pytest.fixture(scope="module")
def gen(rag_ckpt) -> RagGenerator:
    return RagGenerator.load(rag_ckpt, device="cpu")


def _rag_retriever(rag_ckpt: Path, passages):
    """transformers' ``RagRetriever`` whose index lookup returns ``passages`` (its own query
    decoding and ``postprocess_docs`` run unchanged; no datasets/faiss index needed)."""
    from transformers import RagConfig, RagRetriever, RagTokenizer

    tok = RagTokenizer.from_pretrained(rag_ckpt)
    retriever = object.__new__(RagRetriever)
    retriever.config = RagConfig.from_pretrained(rag_ckpt)
    retriever.n_docs = len(passages)
    retriever.question_encoder_tokenizer = tok.question_encoder
    retriever.generator_tokenizer = tok.generator
    retriever.return_tokenized_docs = False
    docs = {"title": [p.title for p in passages], "text": [p.text for p in passages]}

    def retrieve(hidden, n_docs):
        dim = hidden.shape[-1]
        return np.zeros((1, n_docs, dim), np.float32), np.zeros((1, n_docs), np.int64), [docs]

    retriever.retrieve = retrieve
    return retriever, tok


@pytest.mark.parametrize("question", QUESTIONS)
def test_generator_input_is_rag_retrievers(rag_ckpt, gen, question):
    passages = make_passages(4, 2)
    retriever, tok = _rag_retriever(rag_ckpt, passages)
    q_ids = tok(question)["input_ids"]  # RagTokenizer encodes with the question encoder's
    ref = retriever([q_ids], np.zeros((1, 16), np.float32), return_tensors="pt")
    ids, mask = gen.backend._tokenize_inputs([(question, p) for p in passages])
    ref_ids, ref_mask = ref["context_input_ids"], ref["context_attention_mask"]
    for row in range(len(passages)):
        assert ids[row][mask[row].bool()].tolist() == ref_ids[row][ref_mask[row].bool()].tolist()
    decoded = tok.question_encoder.decode(q_ids, skip_special_tokens=True)
    assert gen.backend.question_text(question) == decoded
    assert decoded != question  # lower-cased / re-spaced: the test can tell the difference


def test_question_text_examples(gen):
    assert gen.backend.question_text(QUESTION) == "what is the capital of france?"
    assert gen.backend.question_text("  Who WROTE   Hamlet ?") == "who wrote hamlet?"


def test_generation_reads_decoded_question(gen, dirs, load):
    plain = load(dirs.bart(0))  # the checkpoint's generator, without a question tokenizer
    assert plain.backend.question_text(QUESTION) == QUESTION
    passages = make_passages(3, 1)
    opts = DecodingOptions(num_beams=2, max_new_tokens=6, num_return_sequences=2)
    a = gen.generate("  WHAT is the capital of   FRANCE?", passages, opts)
    b = plain.generate("what is the capital of france?", passages, opts)
    assert [h.token_ids for h in a.hypotheses] == [h.token_ids for h in b.hypotheses]


def test_matches_transformers_end_to_end_from_question(rag_ckpt, gen):
    """transformers' RagTokenForGeneration fed the retriever's context for the raw question."""
    from transformers import RagTokenForGeneration

    ref = RagTokenForGeneration.from_pretrained(rag_ckpt).eval()
    passages = make_passages(3, 4)
    retriever, tok = _rag_retriever(rag_ckpt, passages)
    question = QUESTIONS[1]
    ctx = retriever([tok(question)["input_ids"]], np.zeros((1, 16)), return_tensors="pt")
    scores = torch.tensor([[p.score for p in passages]])
    with torch.no_grad():
        out = ref.generate(
            context_input_ids=ctx["context_input_ids"],
            context_attention_mask=ctx["context_attention_mask"],
            doc_scores=scores,
            n_docs=3,
            num_beams=3,
            num_return_sequences=2,
            max_length=8,
        )
    expected = [strip_trailing(r.tolist()[1:], 1) for r in out]
    opts = DecodingOptions(num_beams=3, max_new_tokens=7, num_return_sequences=2)
    assert [h.token_ids for h in gen.generate(question, passages, opts).hypotheses] == expected


def test_missing_question_encoder_tokenizer(rag_ckpt, tmp_path):
    d = Path(shutil.copytree(rag_ckpt, tmp_path / "a"))
    shutil.rmtree(d / "question_encoder_tokenizer")
    with pytest.raises(
        ModelLoadError, match="missing tokenizer directory .*question_encoder_tokenizer"
    ):
        RagGenerator.load(d, device="cpu")
