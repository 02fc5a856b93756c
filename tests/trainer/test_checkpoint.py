from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.index import load_encoder
from openbook.rag import DecodingOptions, RagGenerator
from openbook.storage.artifacts import PARTIAL_MAX_AGE_S, clean_stale_partials, machine_tag
from openbook.storage.checkpoint import (
    LATEST,
    CheckpointError,
    CheckpointPathError,
    checkpoint_in_root,
    generator_dir,
    latest_checkpoint,
    query_encoder_dir,
    verify_checkpoint,
)
from openbook.types import Passage
from openbook_trainer.checkpoints import load_checkpoint, write_checkpoint

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


# ----------------------------------------------------------------------------- partial writes

# A writer killed mid-checkpoint: its generator's save() never returns.
_STUCK_WRITER = """
import sys, time
from pathlib import Path
from openbook_trainer.checkpoints import write_checkpoint

class Stuck:
    def save(self, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        Path(sys.argv[2]).write_text("saving")
        time.sleep(600)

write_checkpoint(
    Path(sys.argv[1]), int(sys.argv[3]), query_encoder=None, generator=Stuck(),
    base_generator="stuck", base_query_encoder=None, index={}, data_sha256="0" * 64,
)
"""


def _start_writer(root: Path, step: int, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A writer process stuck inside write_checkpoint, and its partial directory."""
    ready = tmp_path / f"saving-{step}"
    args = [sys.executable, "-c", _STUCK_WRITER, str(root), str(ready), str(step)]
    proc = subprocess.Popen(args)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, "the writer exited early"
        assert time.monotonic() < deadline, "the writer never started saving"
        time.sleep(0.05)
    (partial,) = root.glob(f".step-{step:06d}.tmp-*")
    return proc, partial


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` and everything under it look untouched for ``seconds``."""
    then = time.time() - seconds
    for p in [*path.rglob("*"), path]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_a_killed_writers_partial_is_removed_and_a_live_writers_kept(tmp_path):
    root = tmp_path / "ckpt"
    killed, dead_partial = _start_writer(root, 3, tmp_path)
    live, live_partial = _start_writer(root, 4, tmp_path)  # a second trainer on the same root
    try:
        assert clean_stale_partials(root, grace_s=0) == []  # both writers alive
        killed.kill()
        killed.wait()
        assert clean_stale_partials(root) == []  # within the grace period: kept for now
        assert clean_stale_partials(root, grace_s=0) == [dead_partial]
        assert live_partial.is_dir()
        assert latest_checkpoint(root) is None
    finally:
        for proc in (killed, live):
            proc.kill()
            proc.wait()
    assert clean_stale_partials(root, grace_s=0) == [live_partial]
    assert list(root.iterdir()) == []


def test_a_writer_in_this_process_keeps_its_partial(models, tmp_path):
    gen, enc = models
    seen: list[list[Path]] = []
    _write(
        tmp_path,
        1,
        gen,
        enc,
        _before_rename=lambda _: seen.append(clean_stale_partials(tmp_path, grace_s=0)),
    )
    assert seen == [[]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-000001"]


def test_partials_the_lock_cannot_judge_wait_for_their_age(tmp_path):
    this_machine = tmp_path / f".step-000001.tmp-{machine_tag()}-999999-0123abcd"
    unjudged = [
        tmp_path / ".step-000002.tmp-someothermachine-7-0123abcd",  # a shared volume
        tmp_path / ".step-000003.tmp-4242-0123abcd",  # names of earlier versions
        tmp_path / ".step-000004.tmp-old-0123abcd",
    ]
    for d in (this_machine, *unjudged):
        (d / "generator").mkdir(parents=True)
        (d / "generator" / "config.json").write_text("{}")
    pointer = tmp_path / f".{LATEST}.tmp-{machine_tag()}-999999-0123abcd"
    pointer.write_text("step-000001\n")
    others = [tmp_path / ".keep", tmp_path / "step-000009", tmp_path / "notes.tmp-1"]
    for d in others:
        d.mkdir()

    assert clean_stale_partials(tmp_path) == []  # everything was just written
    for p in tmp_path.iterdir():
        _age(p, 3600)
    # This machine's, with no process holding its lock: abandoned once past the grace period.
    assert clean_stale_partials(tmp_path) == [pointer, this_machine]
    assert clean_stale_partials(tmp_path) == []
    for p in tmp_path.iterdir():
        _age(p, PARTIAL_MAX_AGE_S + 60)
    assert clean_stale_partials(tmp_path) == sorted(unjudged)
    assert sorted(tmp_path.iterdir()) == sorted(others)
    assert clean_stale_partials(tmp_path / "nowhere") == []


# ----------------------------------------------------------------------------- confinement


def _fake_checkpoint(path: Path) -> Path:
    """Enough for checkpoint_in_root, which only finds checkpoints (loaders verify them)."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def test_checkpoint_in_root_resolves_names_and_paths_inside_the_root(tmp_path):
    root = tmp_path / "ckpt"
    good = _fake_checkpoint(root / "step-000001")
    (root / LATEST).write_text("step-000001\n")
    _fake_checkpoint(root / "nq" / "step-000002")
    (root / "nq" / LATEST).write_text("step-000002\n")
    (root / "alias").symlink_to(good)  # a link that stays inside is fine
    real = good.resolve()
    for requested in ("", None, LATEST, "step-000001", str(good), "nq/../step-000001", "alias"):
        assert checkpoint_in_root(root, requested) == real, requested
    assert checkpoint_in_root(root, "nq") == (root / "nq" / "step-000002").resolve()
    with pytest.raises(CheckpointError, match="'step-000003' not found in the checkpoint root"):
        checkpoint_in_root(root, "step-000003")
    with pytest.raises(CheckpointError, match="holds no checkpoint yet"):
        checkpoint_in_root(tmp_path / "empty", "")
    with pytest.raises(CheckpointPathError, match="no checkpoint root configured"):
        checkpoint_in_root(None, "step-000001")


def test_checkpoint_in_root_refuses_the_outside_and_partials_alike(tmp_path):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root / "step-000001")
    outside = _fake_checkpoint(tmp_path / "outside" / "step-000005")
    (root / "step-000007").symlink_to(outside)
    (root / "sub").mkdir()
    (root / "sub" / "step-000005").symlink_to(outside)  # where a sub-root's latest leads
    (root / "sub" / LATEST).write_text("step-000005\n")
    messages = set()
    for requested in (
        str(outside),
        str(tmp_path / "nowhere"),
        "../outside/step-000005",
        f"{root}/../outside/step-000005",
        "step-000007",
        "sub",
        "/",
    ):
        with pytest.raises(CheckpointPathError) as err:
            checkpoint_in_root(root, requested)
        messages.add(str(err.value))
    assert len(messages) == 1 and "outside" not in messages.pop()
    # A name no path holds is refused for what it holds, before anything is resolved.
    with pytest.raises(CheckpointPathError, match=r"NUL characters \(U\+0000 at index 11\)"):
        checkpoint_in_root(root, "step-000001\x00")

    _fake_checkpoint(root / ".step-000002.tmp-abc-1-0123abcd")  # complete, never renamed
    with pytest.raises(CheckpointPathError, match="partial"):
        checkpoint_in_root(root, ".step-000002.tmp-abc-1-0123abcd")
    (root / LATEST).write_text(".step-000002.tmp-abc-1-0123abcd\n")
    with pytest.raises(CheckpointError, match="does not name a checkpoint"):
        checkpoint_in_root(root, "")
