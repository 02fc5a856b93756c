"""The question encoder of a RAG checkpoint directory, and DPR passage vectors as DPR/RAG make
them (all-zero segment ids)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.index import build_index, load_encoder, open_index
from openbook.index.encoders import clear_encoder_cache
from openbook.index.layout import VECTORS_FILE
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import make_tiny_dpr_encoders, write_facts
from openbook_testkit.rag import make_tiny_rag_checkpoint

QUESTIONS = ["What is the capital of France?", "who wrote  Hamlet", "Mount Everest, Himalayas?"]


@pytest.fixture(scope="module")
def rag_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_rag_checkpoint(tmp_path_factory.mktemp("rag") / "rag-token-tiny", seed=3)


def _transformers_question_vectors(rag_dir: Path, questions: list[str]) -> np.ndarray:
    """What ``RagTokenForGeneration`` retrieves with: its question encoder's first output over
    the ``RagTokenizer``'s input ids."""
    from transformers import RagTokenForGeneration, RagTokenizer

    tok = RagTokenizer.from_pretrained(rag_dir)
    model = RagTokenForGeneration.from_pretrained(rag_dir).eval()
    out = []
    with torch.no_grad():
        for q in questions:
            ids = tok(q, return_tensors="pt")["input_ids"]
            out.append(model.question_encoder(ids)[0][0].numpy())
    return np.stack(out)


def test_rag_dir_is_a_query_encoder(rag_dir: Path) -> None:
    from transformers import DPRQuestionEncoder

    enc = load_encoder(str(rag_dir))
    assert isinstance(enc.model, DPRQuestionEncoder)
    assert (enc.kind, enc.pooling, enc.normalize, enc.dim) == ("dpr-question", "pooler", False, 16)
    assert enc.name == str(rag_dir.resolve())
    assert load_encoder(str(rag_dir), role="query") is enc
    np.testing.assert_allclose(
        enc.encode(QUESTIONS, batch_size=2),
        _transformers_question_vectors(rag_dir, QUESTIONS),
        atol=1e-5,
    )


def test_rag_dir_has_no_document_encoder(rag_dir: Path) -> None:
    with pytest.raises(ValueError, match="question encoder only"):
        load_encoder(str(rag_dir), role="document", cached=False)


def test_rag_dir_saved_as_own_encoder_round_trips(rag_dir: Path, tmp_path: Path) -> None:
    enc = load_encoder(str(rag_dir), cached=False)
    enc.save(tmp_path / "q")
    again = load_encoder(str(tmp_path / "q"), cached=False)
    np.testing.assert_allclose(again.encode(QUESTIONS), enc.encode(QUESTIONS), atol=1e-6)


def _broken(rag_dir: Path, tmp_path: Path) -> Path:
    clear_encoder_cache()
    return Path(shutil.copytree(rag_dir, tmp_path / "rag"))


def test_missing_question_encoder_tokenizer(rag_dir: Path, tmp_path: Path) -> None:
    d = _broken(rag_dir, tmp_path)
    for f in (d / "question_encoder_tokenizer").iterdir():
        if f.name in ("tokenizer.json", "vocab.txt"):
            f.unlink()
    with pytest.raises(ValueError, match="missing tokenizer files in .*question_encoder_tokenizer"):
        load_encoder(str(d), cached=False)
    shutil.rmtree(d / "question_encoder_tokenizer")
    with pytest.raises(
        ValueError, match="missing tokenizer directory .*question_encoder_tokenizer"
    ):
        load_encoder(str(d), cached=False)


def test_missing_question_encoder_weights(rag_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = _broken(rag_dir, tmp_path)
    weights = d / "model.safetensors"
    generator_only = {k: v for k, v in load_file(weights).items() if k.startswith("rag.generator.")}
    save_file(generator_only, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing question encoder weights .*model.safetensors"):
        load_encoder(str(d), cached=False)
    weights.unlink()
    with pytest.raises(ValueError, match="missing weights in RAG directory .*model.safetensors"):
        load_encoder(str(d), cached=False)


def test_rag_dir_from_pytorch_bin(rag_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    d = _broken(rag_dir, tmp_path)
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    np.testing.assert_allclose(
        load_encoder(str(d), cached=False).encode(QUESTIONS),
        load_encoder(str(rag_dir)).encode(QUESTIONS),
        atol=1e-6,
    )


def test_index_manifest_names_rag_dir_as_query_encoder(rag_dir: Path, tmp_path: Path) -> None:
    ctx, _ = make_tiny_dpr_encoders(tmp_path / "dpr", hidden_size=16)
    facts = write_facts(tmp_path / "facts.jsonl")
    out = tmp_path / "idx"
    manifest = build_index(
        [facts],
        out,
        IndexSpec(name="ragq", encoder=str(ctx), query_encoder=str(rag_dir)),
        BuildOptions(progress=False),
    )
    assert manifest.query_encoder == str(rag_dir.resolve())
    idx = open_index(out)
    try:
        enc = idx.query_encoder
        assert enc.kind == "dpr-question" and enc.name == str(rag_dir.resolve())
        hits = idx.search(SearchRequest(QUESTIONS[:1], k=3, retrieval="dense"))[0]
        vec = enc.encode(QUESTIONS[:1])[0]
        docs = np.load(out / VECTORS_FILE)
        best = np.sort(docs @ vec)[::-1][:3]
        scale = idx.manifest.score_scale
        np.testing.assert_allclose([h.score / scale for h in hits], best, rtol=1e-4, atol=1e-4)
    finally:
        idx.close()


# ------------------------------------------------------------------ DPR passage vectors


def _recipe_vectors(ctx_dir: Path, titles: list[str], texts: list[str]) -> np.ndarray:
    """transformers' examples/rag/use_own_knowledge_dataset.py ``embed``: the context tokenizer
    over (title, text) pairs, then the encoder on the input ids alone (segment ids all zero)."""
    from transformers import DPRContextEncoder, DPRContextEncoderTokenizerFast

    tok = DPRContextEncoderTokenizerFast.from_pretrained(ctx_dir)
    model = DPRContextEncoder.from_pretrained(ctx_dir).eval()
    batch = tok(titles, texts, truncation=True, padding="longest", return_tensors="pt")
    with torch.no_grad():
        return model(batch["input_ids"], return_dict=True).pooler_output.numpy()


def test_dpr_passage_vectors_match_the_rag_recipe(dpr_dirs: tuple[Path, Path]) -> None:
    ctx, _ = dpr_dirs
    titles = ["Paris", "Hamlet", "", "Mount Everest"]
    texts = [
        "paris is the capital of france",
        "shakespeare wrote hamlet",
        "the quick brown fox",
        "the highest mountain on earth is in the himalayas and it is very high",
    ]
    enc = load_encoder(str(ctx), role="document")
    ours = enc.encode(texts, batch_size=3, titles=titles)
    ref = _recipe_vectors(ctx, titles, texts)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    # the test can tell: segment ids 1 on the text give other vectors
    pairs = enc.tokenizer(titles, texts, padding=True, return_tensors="pt")
    assert int(pairs["token_type_ids"].sum()) > 0
    with torch.no_grad():
        with_segments = enc.model(**pairs).pooler_output.numpy()
    assert not np.allclose(with_segments, ref, atol=1e-3)


def test_dpr_index_stores_recipe_vectors(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    ctx, q = dpr_dirs
    rows = [
        {"id": "a", "title": "Paris", "text": "paris is the capital of france"},
        {"id": "b", "title": "Hamlet", "text": "shakespeare wrote hamlet"},
    ]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "idx"
    build_index(
        [src],
        out,
        IndexSpec(name="dpr", encoder=str(ctx), query_encoder=str(q)),
        BuildOptions(progress=False),
    )
    idx = open_index(out)
    try:
        hits = idx.search(SearchRequest(["capital of france"], k=2, retrieval="dense"))[0]
        qv = load_encoder(str(q)).encode(["capital of france"])[0]
        ref = _recipe_vectors(ctx, [r["title"] for r in rows], [r["text"] for r in rows])
        expected = {r["id"]: float(v @ qv) for r, v in zip(rows, ref, strict=True)}
        scale = idx.manifest.score_scale
        for h in hits:
            assert h.score / scale == pytest.approx(expected[h.id], abs=1e-4)
    finally:
        idx.close()
