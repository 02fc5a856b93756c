from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.checkpoint import (
    LATEST,
    CheckpointError,
    generator_dir,
    latest_checkpoint,
    load_checkpoint,
    query_encoder_dir,
    verify_checkpoint,
    write_checkpoint,
)
from openbook.index import load_encoder
from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage

QUESTIONS = ["what is the code of e1 ?", "what is the code of e5 ?"]
PASSAGES = [
    Passage("p1", "e1", "the code of e1 is c1 .", score=1.0),
    Passage("p2", "e2", "the code of e2 is c2 .", score=0.5),
]


@pytest.fixture
def models(task):
    gen = RagGenerator.load(task.generator)
    enc = load_encoder(str(task.query_encoder), cached=False)
    # perturb so that a round trip through the *saved* weights is what we compare
    with torch.no_grad():
        for p in list(gen.model.parameters())[:3] + list(enc.model.parameters())[:3]:
            p.add_(0.01)
    return gen, enc


def _write(root: Path, step: int, gen, enc, **kw) -> Path:
    return write_checkpoint(
        root,
        step,
        query_encoder=enc,
        generator=gen,
        base_generator="tiny-bart",
        base_query_encoder="tiny-dpr",
        index={"name": "synthetic", "checksum": "abc"},
        data_sha256="0" * 64,
        metrics={"dev_em": 12.5},
        **kw,
    )


def _outputs(gen: RagGenerator) -> list[tuple[str, float]]:
    opts = [
        DecodingOptions(mode=m, num_beams=2, max_new_tokens=5)
        for m in ("rag-token", "rag-sequence-thorough")
    ]
    out = []
    for q in QUESTIONS:
        for o in opts:
            h = gen.generate(q, PASSAGES, o).hypotheses[0]
            out.append((h.text, h.log_prob))
    return out


def test_round_trip_gives_identical_outputs(models, tmp_path):
    gen, enc = models
    ckpt = _write(tmp_path, 3, gen, enc)
    assert ckpt.name == "step-000003"
    assert latest_checkpoint(tmp_path) == ckpt
    manifest = verify_checkpoint(ckpt)
    assert manifest.step == 3 and manifest.metrics == {"dev_em": 12.5}
    assert manifest.index == {"name": "synthetic", "checksum": "abc"}
    assert "generator/model.safetensors" in manifest.files
    assert "query_encoder/model.safetensors" in manifest.files

    loaded = load_checkpoint(tmp_path)  # a root resolves to its latest checkpoint
    assert loaded.version == "step-000003"
    assert loaded.generator.model_version == "step-000003"
    assert _outputs(loaded.generator) == _outputs(gen)
    np.testing.assert_array_equal(loaded.query_encoder.encode(QUESTIONS), enc.encode(QUESTIONS))
    assert query_encoder_dir(ckpt) is not None and generator_dir(ckpt).is_dir()


def test_flipped_bytes_are_refused(models, tmp_path):
    gen, enc = models
    ckpt = _write(tmp_path, 1, gen, enc)
    weights = ckpt / "generator" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"generator/model\.safetensors is corrupt"):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"generator/model\.safetensors"):
        load_checkpoint(ckpt)


def test_missing_and_unlisted_files_are_refused(models, tmp_path):
    gen, enc = models
    ckpt = _write(tmp_path, 1, gen, enc)
    (ckpt / "query_encoder" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"query_encoder/config\.json missing"):
        verify_checkpoint(ckpt)

    ckpt = _write(tmp_path, 2, gen, enc)
    (ckpt / "generator" / "pytorch_model.bin").write_bytes(b"sneaky")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is not listed"):
        verify_checkpoint(ckpt)

    ckpt = _write(tmp_path, 3, gen, enc)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json unreadable"):
        verify_checkpoint(ckpt)


def test_crash_mid_write_leaves_previous_checkpoint_latest(models, tmp_path):
    gen, enc = models
    first = _write(tmp_path, 2, gen, enc)

    def crash(tmp: Path) -> None:
        assert (tmp / "manifest.json").is_file()  # complete, but not yet renamed
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, 4, gen, enc, _before_rename=crash)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-000002"]
    assert latest_checkpoint(tmp_path) == first
    verify_checkpoint(first)

    # a directory left by a hard kill (no manifest yet) is never taken for a checkpoint
    (tmp_path / "step-000006" / "generator").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="manifest.json missing"):
        verify_checkpoint(tmp_path / "step-000006")


def test_latest_pointer_and_pruning(models, tmp_path):
    gen, enc = models
    for step in (1, 2, 3):
        _write(tmp_path, step, gen, None if step == 2 else enc, keep_last=2)
    assert (tmp_path / LATEST).read_text().strip() == "step-000003"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    assert query_encoder_dir(tmp_path / "step-000002") is None
    (tmp_path / LATEST).write_text("step-000009\n")
    with pytest.raises(CheckpointError, match="names step-000009, which is missing"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "nowhere") is None
    manifest = json.loads((tmp_path / "step-000003" / "manifest.json").read_text())
    assert manifest["version"] == "step-000003" and manifest["created_at"]
