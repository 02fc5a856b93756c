"""prepare_default_generator: idempotence and the completeness marker, on a fake converter;
the real GGUF conversion is ``slow`` (about a minute on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from openbook.rag.prompting import PromptSpec
from openbook_trainer.demo import models
from openbook_trainer.demo import prompt as prompt_module
from openbook_trainer.demo.prompt import PROMPT_FILE, default_prompt, load_prompt, write_prompt


class FakeConverter:
    """Writes a tiny stand-in for the converted model; counts calls; can fail midway."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def __call__(self, out_dir: Path, *, dtype: str = "float32", log: Any = print) -> dict:
        self.calls += 1
        (out_dir / "config.json").write_text('{"model_type": "fake"}')
        (out_dir / "model.safetensors").write_bytes(b"\0" * 1024)
        (out_dir / "tokenizer.json").write_text("{}")
        if self.fail:
            raise RuntimeError("conversion interrupted")
        write_prompt(out_dir / PROMPT_FILE)
        return {"source": "pypi:fake==0", "created_at": "2020-01-01T00:00:00+00:00"}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeConverter:
    conv = FakeConverter()
    monkeypatch.setattr(models, "convert_gguf", conv)
    return conv


def test_prepare_writes_marker_last_and_is_idempotent(tmp_path: Path, fake: FakeConverter) -> None:
    out = tmp_path / "models" / "gemma-3-270m"
    assert models.prepare_default_generator(out, progress=False) == out
    assert fake.calls == 1
    info = json.loads((out / models.MANIFEST_FILE).read_text())
    assert info["source"] == "pypi:fake==0" and info["version"] == models.FORMAT_VERSION
    assert set(info["files"]) == {"config.json", "model.safetensors", "tokenizer.json", PROMPT_FILE}
    assert info["files"]["model.safetensors"]["size"] == 1024
    assert load_prompt(out) == default_prompt()
    assert models.is_prepared(out, verify_checksums=True)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644

    models.prepare_default_generator(out, progress=False)
    assert fake.calls == 1  # complete: nothing redone
    assert not list(out.parent.glob(".gemma-3-270m.partial-*"))


@pytest.mark.parametrize("damage", ["no_manifest", "truncated", "old_version", "bad_json"])
def test_incomplete_dir_is_rebuilt(tmp_path: Path, fake: FakeConverter, damage: str) -> None:
    out = tmp_path / "m"
    models.prepare_default_generator(out, progress=False)
    manifest = out / models.MANIFEST_FILE
    if damage == "no_manifest":
        manifest.unlink()
    elif damage == "truncated":
        (out / "model.safetensors").write_bytes(b"\0" * 10)
    elif damage == "old_version":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 0}))
    else:
        manifest.write_text("{not json")
    assert not models.is_prepared(out)
    models.prepare_default_generator(out, progress=False)
    assert fake.calls == 2 and models.is_prepared(out, verify_checksums=True)


def test_force_rebuilds(tmp_path: Path, fake: FakeConverter) -> None:
    out = tmp_path / "m"
    models.prepare_default_generator(out, progress=False)
    models.prepare_default_generator(out, force=True, progress=False)
    assert fake.calls == 2 and models.is_prepared(out)


def test_failed_build_leaves_nothing(tmp_path: Path, fake: FakeConverter) -> None:
    out = tmp_path / "m"
    fake.fail = True
    with pytest.raises(RuntimeError, match="interrupted"):
        models.prepare_default_generator(out, progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]
    fake.fail = False
    models.prepare_default_generator(out, progress=False)
    assert models.is_prepared(out)


def test_checksum_verification_catches_same_size_corruption(
    tmp_path: Path, fake: FakeConverter
) -> None:
    out = tmp_path / "m"
    models.prepare_default_generator(out, progress=False)
    (out / "model.safetensors").write_bytes(b"\1" * 1024)
    assert models.is_prepared(out)  # sizes only: the cheap check at every start
    assert not models.is_prepared(out, verify_checksums=True)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(models.MODULE) is None, reason=f"{models.PACKAGE} not installed"
)
def test_real_conversion(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models.prepare_default_generator(tmp_path / "gemma-3-270m", progress=False)
    info = models.model_info(out)
    assert info is not None and info["source"].startswith(f"pypi:{models.PACKAGE}==")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = load_prompt(out)
    text = prompt.render(
        "Lake Titicaca",
        "Lake Titicaca lies on the border of Bolivia and Peru. Its largest island is Isla del Sol.",
        "What is the largest island of Lake Titicaca?",
    )
    enc = tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**enc, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.split("\n")[0].strip() == "Isla del Sol"


def test_changed_default_prompt_reprepares(
    tmp_path: Path, fake: FakeConverter, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "m"
    models.prepare_default_generator(out, progress=False)
    info = models.model_info(out)
    assert info is not None and len(info["prompt_sha256"]) == 64
    changed = PromptSpec(prefix="Answer briefly.\n\n")
    monkeypatch.setattr(models, "default_prompt", lambda: changed)
    monkeypatch.setattr(prompt_module, "default_prompt", lambda: changed)
    assert not models.is_prepared(out)
    models.prepare_default_generator(out, progress=False)
    assert fake.calls == 2 and models.is_prepared(out)
    assert load_prompt(out) == changed
