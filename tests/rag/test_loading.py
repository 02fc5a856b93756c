"""Loading BART, RAG-checkpoint and causal-LM directories; clear errors for broken ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from openbook.rag import DecodingOptions, ModelLoadError, RagGenerator
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_rag_checkpoint, strip_trailing


@pytest.fixture(scope="module")
def rag_ckpt(tmp_path_factory) -> Path:
    return make_tiny_rag_checkpoint(tmp_path_factory.mktemp("ragckpt") / "rag-token-tiny", seed=0)


def test_plain_bart(dirs, load):
    gen = load(dirs.bart(0))
    assert gen.model_type == "bart"
    assert gen.device == "cpu" and gen.dtype == "float32"
    assert gen.model_version.startswith(dirs.bart(0).name + "-")
    assert RagGenerator.load(dirs.bart(0), device="cpu").model_version == gen.model_version


def test_manifest_version_wins(dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(dirs.bart(0), d)
    (d / "openbook_manifest.json").write_text(json.dumps({"version": "bart-tiny@7"}))
    assert RagGenerator.load(d, device="cpu").model_version == "bart-tiny@7"


def test_prepared_model_version_follows_content_not_mtimes(dirs, tmp_path):
    from openbook.rag.loading import PREPARED_MANIFEST, model_version

    files = {"model.safetensors": {"size": 1, "sha256": "ab" * 32}}
    a, b = tmp_path / "gemma", tmp_path / "again" / "gemma"
    for d in (a, b):
        shutil.copytree(dirs.bart(0), d)
        (d / PREPARED_MANIFEST).write_text(json.dumps({"version": 1, "files": files}))
    (b / "config.json").touch()  # re-prepared later: new mtimes, same content
    assert model_version(a) == model_version(b)
    assert model_version(a).startswith("gemma-")
    files["model.safetensors"]["sha256"] = "cd" * 32
    (b / PREPARED_MANIFEST).write_text(json.dumps({"version": 1, "files": files}))
    assert model_version(a) != model_version(b)


def test_rag_checkpoint_uses_its_generator(rag_ckpt, dirs, load):
    assert (rag_ckpt / "generator_tokenizer").is_dir()
    gen = RagGenerator.load(rag_ckpt, device="cpu")
    assert gen.model_type == "bart"
    plain = load(dirs.bart(0))  # same seed: same generator weights and tokenizer
    for name, p in plain.model.state_dict().items():
        torch.testing.assert_close(gen.model.state_dict()[name], p, msg=name)
    passages = make_passages(3, 1)
    for mode in ("rag-token", "rag-sequence-thorough", "rag-sequence-fast"):
        opts = DecodingOptions(mode=mode, num_beams=2, max_new_tokens=6, num_return_sequences=2)
        a = gen.generate(QUESTION, passages, opts)
        # the checkpoint's generator reads the question as its question-encoder tokenizer
        # decodes it (lower-cased), as transformers' RagRetriever builds generator inputs
        b = plain.generate(QUESTION.lower(), passages, opts)
        assert [h.token_ids for h in a.hypotheses] == [h.token_ids for h in b.hypotheses]


def test_rag_checkpoint_matches_transformers_loading_it(rag_ckpt):
    from transformers import RagTokenForGeneration

    gen = RagGenerator.load(rag_ckpt, device="cpu")
    ref = RagTokenForGeneration.from_pretrained(rag_ckpt).eval()
    passages = make_passages(5, 2)
    ids, mask = gen.backend._tokenize_inputs([(QUESTION, p) for p in passages])
    scores = torch.tensor([[p.score for p in passages]])
    opts = DecodingOptions(num_beams=4, max_new_tokens=7, num_return_sequences=3)
    with torch.no_grad():
        out = ref.generate(
            context_input_ids=ids,
            context_attention_mask=mask,
            doc_scores=scores,
            n_docs=5,
            num_beams=4,
            num_return_sequences=3,
            max_length=8,
        )
    expected = [strip_trailing(r.tolist()[1:], 1) for r in out]
    assert [h.token_ids for h in gen.generate(QUESTION, passages, opts).hypotheses] == expected


def test_causal(dirs, load):
    gen = load(dirs.causal("gemma3"))
    assert gen.model_type == "causal"
    res = gen.generate(QUESTION, make_passages(2), DecodingOptions(max_new_tokens=4))
    assert len(res.hypotheses) == 1


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expect(path: Path, fragment: str) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        RagGenerator.load(path)
    assert isinstance(info.value, ValueError)


def test_missing_directory(tmp_path):
    _expect(tmp_path / "nope", "does not exist")


def test_missing_and_corrupt_config(dirs, tmp_path):
    d = _copy(dirs.bart(0), tmp_path / "a")
    (d / "config.json").unlink()
    _expect(d, "config.json")
    (d / "config.json").write_text("{not json")
    _expect(d, "corrupt file .*config.json")


def test_missing_and_corrupt_weights(dirs, tmp_path):
    d = _copy(dirs.bart(0), tmp_path / "a")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    _expect(d, "corrupt weights file .*model.safetensors")
    weights.unlink()
    _expect(d, "missing weights")


def test_missing_and_corrupt_tokenizer(dirs, tmp_path):
    d = _copy(dirs.bart(0), tmp_path / "a")
    (d / "tokenizer.json").write_text("[broken")
    _expect(d, "corrupt file .*tokenizer.json")
    (d / "tokenizer.json").unlink()
    _expect(d, "missing tokenizer files")


def test_rag_checkpoint_without_generator_tokenizer(rag_ckpt, tmp_path):
    d = _copy(rag_ckpt, tmp_path / "a")
    shutil.rmtree(d / "generator_tokenizer")
    _expect(d, "missing tokenizer files")


def test_rag_checkpoint_corrupt_weights(rag_ckpt, tmp_path):
    d = _copy(rag_ckpt, tmp_path / "a")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    _expect(d, "corrupt weights file .*model.safetensors")


def test_causal_prompt_file(dirs, tmp_path):
    d = _copy(dirs.causal("gemma3"), tmp_path / "a")
    (d / "openbook_prompt.json").write_text('{"passage_template": 3}')
    _expect(d, "corrupt prompt file .*openbook_prompt.json")
    (d / "openbook_prompt.json").write_text('{"passage_template": "{title} {nope}"}')
    _expect(d, "openbook_prompt.json")
    (d / "openbook_prompt.json").unlink()
    _expect(d, "missing file .*openbook_prompt.json")


@pytest.mark.parametrize("model_type", ["dpr", "clip", None])
def test_a_directory_that_is_no_generator_is_refused_naming_its_type(tmp_path, model_type):
    """Not BART, not RAG, not a causal LM (a DPR encoder, say): a clear error, not a request for
    a prompt file or transformers' list of AutoModel classes."""
    d = tmp_path / "encoder"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    (d / "openbook_prompt.json").write_text(json.dumps({"prefix": "Q:"}))
    with pytest.raises(ModelLoadError, match="is not a generator") as err:
        RagGenerator.load(d)
    assert "config.json" in str(err.value) and repr(model_type) in str(err.value)
