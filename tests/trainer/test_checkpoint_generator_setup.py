"""A trainer checkpoint of a generator rebuilds the backend it was saved from: a RAG checkpoint's
input format (prefix, title_sep, doc_sep, max_combined_length, n_docs) and question decoding, a
causal LM's prompt, all taken from the running backend (the source directory may be gone)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from openbook.rag import DecodingOptions, ModelLoadError, RagGenerator
from openbook.storage.checkpoint import CheckpointError, generator_dir, verify_checkpoint
from openbook_testkit.rag import (
    PROMPT,
    QUESTION,
    make_passages,
    make_tiny_causal_lm,
    make_tiny_rag_checkpoint,
)
from openbook_trainer.checkpoints import load_checkpoint, write_checkpoint

QUESTIONS = [
    QUESTION,
    "  Who WROTE   Hamlet ?",
    "Is Mount Everest in the Himalayas, or in Zanzibar?",
]
# Non-default RAG input settings, so that losing any of them changes the generator's input.
RAG_SETTINGS = {
    "prefix": "answer: ",
    "title_sep": " | ",
    "doc_sep": " :: ",
    "max_combined_length": 40,
    "n_docs": 4,
}


def _write(root: Path, gen: RagGenerator, source: Path | None) -> Path:
    return write_checkpoint(
        root,
        7,
        query_encoder=None,
        generator=gen,
        base_generator="tiny-rag",
        base_query_encoder=None,
        index={"name": "none", "checksum": "0"},
        data_sha256="0" * 64,
        generator_source=source,
    )


def _outputs(gen: RagGenerator) -> list:
    out = []
    for i, q in enumerate(QUESTIONS):
        passages = make_passages(3, i)
        for mode in ("rag-token", "rag-sequence-thorough"):
            opts = DecodingOptions(mode=mode, num_beams=2, max_new_tokens=6, num_return_sequences=2)
            res = gen.generate(q, passages, opts)
            out.append([(h.token_ids, round(h.log_prob, 5)) for h in res.hypotheses])
    return out


def _settings(gen: RagGenerator) -> dict:
    b = gen.backend
    return {
        "prefix": b.prefix,
        "title_sep": b.title_sep,
        "doc_sep": b.doc_sep,
        "max_combined_length": b.max_combined_length,
        "n_docs": gen.default_k,
    }


@pytest.fixture
def rag_gen(tmp_path) -> RagGenerator:
    src = make_tiny_rag_checkpoint(tmp_path / "rag-src", seed=1)
    config = json.loads((src / "config.json").read_text())
    config.update(RAG_SETTINGS)
    (src / "config.json").write_text(json.dumps(config))
    gen = RagGenerator.load(src, device="cpu")
    with torch.no_grad():  # "fine-tuned": the checkpoint must carry the running weights
        for p in list(gen.model.parameters())[:3]:
            p.add_(0.01)
    # trained elsewhere: the source directory is gone when the checkpoint is written
    shutil.rmtree(src)
    return gen


def test_rag_generator_checkpoint_is_served_as_trained(rag_gen, tmp_path):
    gen = rag_gen
    assert _settings(gen) == RAG_SETTINGS
    assert gen.backend.question_tokenizer is not None
    ckpt = _write(tmp_path / "ckpts", gen, tmp_path / "rag-src")

    files = verify_checkpoint(ckpt).files
    assert "generator/openbook_seq2seq.json" in files
    q_tok = {f for f in files if f.startswith("generator/question_encoder_tokenizer/")}
    assert "generator/question_encoder_tokenizer/tokenizer_config.json" in q_tok, files
    assert len(q_tok) >= 2  # + the vocabulary

    loaded = load_checkpoint(ckpt, device="cpu").generator
    assert loaded.model_type == "bart"
    assert _settings(loaded) == RAG_SETTINGS
    for q in QUESTIONS:
        assert loaded.backend.question_text(q) == gen.backend.question_text(q)
    assert loaded.backend.question_text(QUESTIONS[1]) == "who wrote hamlet?"
    rows = [(q, p) for q in QUESTIONS for p in make_passages(2)]
    assert loaded.backend.input_strings(rows) == gen.backend.input_strings(rows)
    assert loaded.generation == gen.generation
    assert _outputs(loaded) == _outputs(gen)

    # ... and a checkpoint of the reloaded generator is the same again
    again = load_checkpoint(_write(tmp_path / "again", loaded, None), device="cpu").generator
    assert _settings(again) == RAG_SETTINGS
    assert _outputs(again) == _outputs(gen)


def test_generator_settings_are_checksummed_and_validated(rag_gen, tmp_path):
    ckpt = _write(tmp_path / "ckpts", rag_gen, None)
    settings = generator_dir(ckpt) / "openbook_seq2seq.json"
    original = settings.read_text()
    settings.write_text(original.replace('" | "', '" || "'))
    with pytest.raises(CheckpointError, match="openbook_seq2seq.json"):
        load_checkpoint(ckpt, device="cpu")

    # the generator directory on its own: the loader honours and validates the file
    d = shutil.copytree(generator_dir(ckpt), tmp_path / "gen")
    assert _settings(RagGenerator.load(d, device="cpu"))["title_sep"] == " || "
    for bad in ('{"max_combined_length": 0}', '{"title_sep": 3}', '{"question_tokenizer": "../x"}'):
        (d / "openbook_seq2seq.json").write_text(bad)
        with pytest.raises(ModelLoadError, match="corrupt file .*openbook_seq2seq.json"):
            RagGenerator.load(d, device="cpu")
    (d / "openbook_seq2seq.json").write_text(original)
    shutil.rmtree(d / "question_encoder_tokenizer")
    with pytest.raises(ModelLoadError, match="missing tokenizer directory"):
        RagGenerator.load(d, device="cpu")


def test_causal_generator_checkpoint_keeps_its_prompt(tmp_path):
    prompt = dict(PROMPT, passage_template="T: {title}\nP: {text}\nQ: {question}\nA:", stop=["\n"])
    src = make_tiny_causal_lm(tmp_path / "causal-src", seed=1, arch="llama", prompt=prompt)
    gen = RagGenerator.load(src, device="cpu")
    shutil.rmtree(src)  # the prompt comes from the running backend, not the source directory
    ckpt = _write(tmp_path / "ckpts", gen, src)
    assert "generator/openbook_prompt.json" in verify_checkpoint(ckpt).files

    loaded = load_checkpoint(ckpt, device="cpu").generator
    assert loaded.model_type == "causal"
    assert loaded.backend.spec == gen.backend.spec
    opts = DecodingOptions(num_beams=2, max_new_tokens=4, num_return_sequences=2)
    for i, q in enumerate(QUESTIONS[:2]):
        a = gen.generate(q, make_passages(2, i), opts).hypotheses
        b = loaded.generate(q, make_passages(2, i), opts).hypotheses
        assert [h.token_ids for h in a] == [h.token_ids for h in b]
