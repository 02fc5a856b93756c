"""A LoRA adapter of the query encoder (``--query-encoder-adapter lora``), trained jointly with
the generator's: checkpoints hold the adapter instead of the encoder; every loader (trainer
resume, retriever reload, ``load_encoder`` on the adapter directory, merge-adapter) gives exactly
the encoder training ended with; another base is refused; a killed run resumes bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from openbook.index import load_encoder
from openbook.index.checkpoint import load_query_encoder
from openbook.index.encoders import load_adapted_encoder
from openbook.rag.adapters import ADAPTER_FILE, AdapterMismatch, load_trainable
from openbook.storage.checkpoint import CheckpointError, query_encoder_dir, verify_checkpoint
from openbook_testkit.training import assert_same_tensors, crash_at
from openbook_trainer.config import ConfigError, TrainConfig
from openbook_trainer.loop import train
from openbook_trainer.merge import app as merge_app

BOTH = dict(
    generator_adapter="lora",
    query_encoder_adapter="lora",
    lora_rank=4,
    lora_alpha=8.0,
    lr_generator=1e-2,
    lr_query_encoder=1e-2,
)
QUESTIONS = ["who founded the first entity?", "where is the third one", "a question"]


def _files(ckpt: Path) -> set[str]:
    return {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}


def _vectors(encoder) -> np.ndarray:
    return encoder.encode(QUESTIONS)


def _base_encoder(task):
    return json.loads((task.index / "manifest.json").read_text())["query_encoder"]


def test_a_joint_lora_checkpoint_holds_both_adapters_and_loads_the_trained_encoder(make_cfg, task):
    result = train(make_cfg(steps=6, **BOTH))
    ckpt = result.checkpoint
    manifest = verify_checkpoint(ckpt)
    assert manifest.trained == ["query_encoder", "generator"]
    files = _files(ckpt)
    assert not any(f.startswith(("query_encoder/", "generator/")) for f in files)
    assert {
        "query_encoder_adapter/adapter_config.json",
        "query_encoder_adapter/openbook_adapter.json",
        "query_encoder_adapter/adapter_model.safetensors",
    } <= files
    weights = load_file(ckpt / "query_encoder_adapter" / "adapter_model.safetensors")
    assert weights and all("lora_" in name for name in weights)
    base_name = _base_encoder(task)
    base_bytes = sum(p.stat().st_size for p in Path(base_name).glob("*.safetensors"))
    adapter_bytes = (ckpt / "query_encoder_adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < base_bytes / 2
    meta = json.loads((ckpt / "query_encoder_adapter" / ADAPTER_FILE).read_text())
    assert meta["base_model"] == manifest.base_query_encoder

    # the trained encoder: the base with the adapter's LoRA layers attached, unmerged
    trained = load_encoder(base_name, cached=False)
    load_trainable(trained.model, ckpt / "query_encoder_adapter").eval()
    trained.model.eval()
    expected = _vectors(trained)
    base = _vectors(load_encoder(base_name, cached=False))
    assert np.abs(expected - base).max() > 1e-3  # the adapter learned something

    # every loader merges it into the same encoder
    loaded = load_query_encoder(ckpt)
    assert query_encoder_dir(ckpt) == ckpt / "query_encoder_adapter"
    assert not any("lora_" in n for n, _ in loaded.model.named_parameters())
    np.testing.assert_allclose(_vectors(loaded), expected, atol=1e-5)
    direct = load_encoder(str(ckpt / "query_encoder_adapter"), cached=False)
    np.testing.assert_allclose(_vectors(direct), expected, atol=1e-5)
    assert load_adapted_encoder(ckpt / "query_encoder_adapter", base_name) is load_encoder(
        str(ckpt / "query_encoder_adapter")
    )  # cached once per (adapter, base)


def test_the_query_encoder_adapter_alone_with_a_full_generator(make_cfg):
    result = train(make_cfg(steps=2, query_encoder_adapter="lora", lr_query_encoder=1e-2))
    files = _files(result.checkpoint)
    assert any(f.startswith("generator/") for f in files)
    assert any(f.startswith("query_encoder_adapter/") for f in files)


def test_a_query_encoder_adapter_is_refused_on_another_base(make_cfg, task, tmp_path):
    result = train(make_cfg(steps=1, **BOTH))
    adapter = result.checkpoint / "query_encoder_adapter"
    other = tmp_path / "other-encoder"
    shutil.copytree(_base_encoder(task), other)
    weights = load_file(other / "model.safetensors")
    from safetensors.torch import save_file

    first = next(iter(weights))
    weights[first] = weights[first] + 0.01  # same architecture, other weights
    save_file(weights, other / "model.safetensors")
    with pytest.raises(AdapterMismatch, match="trained on base model"):
        load_adapted_encoder(adapter, str(other), cached=False)
    moved = tmp_path / "adapter"
    shutil.copytree(adapter, moved)
    meta = json.loads((moved / ADAPTER_FILE).read_text())
    (moved / ADAPTER_FILE).write_text(json.dumps({**meta, "base_model": str(other)}))
    with pytest.raises(AdapterMismatch):
        load_encoder(str(moved), cached=False)
    with pytest.raises(ValueError, match="base encoder"):
        load_adapted_encoder(adapter, str(tmp_path / "nowhere"), cached=False)


def test_a_killed_run_resumes_to_the_same_query_encoder_adapter(make_cfg, tmp_path):
    common = dict(steps=4, save_every=2, batch_size=3, eval_every=0, dev=None, **BOTH)
    full = train(make_cfg(out=tmp_path / "full", **common))

    cfg = make_cfg(out=tmp_path / "resumed", **common)
    crash_at(cfg, 3)
    resumed = train(cfg)
    assert resumed.step == 4
    assert_same_tensors(
        full.checkpoint,
        resumed.checkpoint,
        [
            "generator_adapter/adapter_model.safetensors",
            "query_encoder_adapter/adapter_model.safetensors",
        ],
    )
    # the same out, now training the whole query encoder: refused, not silently mixed
    mixed = {**common, "steps": 6, "query_encoder_adapter": "none"}
    with pytest.raises(ConfigError, match="query encoder adapter"):
        train(make_cfg(out=tmp_path / "resumed", **mixed))


def test_merge_adapter_writes_a_plain_query_encoder(make_cfg, tmp_path):
    result = train(make_cfg(steps=2, **BOTH))
    gen_out, q_out = tmp_path / "generator", tmp_path / "query-encoder"
    run = CliRunner().invoke(
        merge_app,
        [str(result.checkpoint), "--out", str(gen_out), "--query-encoder-out", str(q_out)],
    )
    assert run.exit_code == 0, run.output
    merged = load_encoder(str(q_out), cached=False)
    assert not any("lora_" in n for n, _ in merged.model.named_parameters())
    np.testing.assert_allclose(
        _vectors(merged), _vectors(load_query_encoder(result.checkpoint)), atol=1e-6
    )
    assert (gen_out / "config.json").is_file()
    # nothing to write, or a checkpoint without that adapter: clear errors
    none = CliRunner().invoke(merge_app, [str(result.checkpoint)])
    assert none.exit_code == 2 and "--query-encoder-out" in none.output
    full_q = train(make_cfg(out=tmp_path / "full-q", steps=1, generator_adapter="lora"))
    refused = CliRunner().invoke(
        merge_app, [str(full_q.checkpoint), "--query-encoder-out", str(tmp_path / "q2")]
    )
    assert refused.exit_code == 2 and "no query encoder adapter" in refused.output


def test_a_checkpoint_with_a_corrupt_query_encoder_adapter_is_refused(make_cfg):
    result = train(make_cfg(steps=1, **BOTH))
    weights = result.checkpoint / "query_encoder_adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_query_encoder(result.checkpoint)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(query_encoder_adapter="lora", train_query_encoder=False), "query-encoder-adapter"),
        (dict(query_encoder_adapter="dora"), "query-encoder-adapter"),
    ],
)
def test_bad_query_encoder_adapter_options_fail_before_any_compute(make_cfg, options, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        TrainConfig.load(None, **{**make_cfg().model_dump(), **options})
