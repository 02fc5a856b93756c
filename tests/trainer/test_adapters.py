"""Parameter-efficient generator training (openbook/rag/adapters.py): a LoRA adapter trained
alone or with the query encoder, for BART and causal LMs; checkpoints hold the adapter only;
loading merges it onto its base (exactly the trained model) and refuses another base; a killed
run resumes bit for bit; merging into full weights is one command; bad options fail before any
compute."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.adapters import AdapterMismatch, LoraSpec, attach_lora, merged
from openbook.rag.checkpoint import load_generator
from openbook.storage.checkpoint import CheckpointError, verify_checkpoint
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.training import assert_same_tensors, crash_at
from openbook_trainer.checkpoints import load_checkpoint
from openbook_trainer.config import ConfigError, TrainConfig
from openbook_trainer.loop import train
from openbook_trainer.merge import app as merge_app

LORA = dict(generator_adapter="lora", lora_rank=4, lora_alpha=8.0, lr_generator=1e-2)
OPTIONS = DecodingOptions(max_new_tokens=6)


def _files(ckpt: Path) -> set[str]:
    return {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}


def _answers(generator: RagGenerator) -> list[list[int]]:
    out = []
    for seed in range(3):
        result = generator.generate(QUESTION, make_passages(3, seed), OPTIONS)
        out.append(result.hypotheses[0].token_ids)
    return out


def _scores(generator: RagGenerator) -> list[float]:
    """log p(y|x) of each answer: the model's full distribution speaks through it."""
    return [
        generator.generate(QUESTION, make_passages(3, seed), OPTIONS).hypotheses[0].log_prob
        for seed in range(3)
    ]


@pytest.mark.parametrize("kind", ["bart", "llama"])
def test_a_lora_checkpoint_holds_the_adapter_and_serves_the_trained_model(
    make_cfg, task, tmp_path, kind
):
    base = task.generator if kind == "bart" else make_tiny_causal_lm(tmp_path / "lm")
    losses: list[float] = []
    cfg = make_cfg(generator=base, steps=12, batch_size=8, **LORA)
    result = train(cfg, on_step=lambda step, loss: losses.append(loss))
    assert sum(losses[-3:]) < sum(losses[:3]), losses  # the adapter learns
    ckpt = result.checkpoint
    manifest = verify_checkpoint(ckpt)
    assert manifest.trained == ["query_encoder", "generator"]
    files = _files(ckpt)
    assert not any(f.startswith("generator/") for f in files)
    assert {
        "generator_adapter/adapter_config.json",
        "generator_adapter/openbook_adapter.json",
    } <= files
    adapter = load_file(ckpt / "generator_adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    base_bytes = sum(p.stat().st_size for p in Path(base).glob("*.safetensors"))
    adapter_bytes = (ckpt / "generator_adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < base_bytes / 2  # tiny models; on Gemma 3 270M: docs/results.md

    # served: base + adapter merged = the model the trainer ended with (LoRA layers unmerged)
    loaded = load_checkpoint(ckpt)
    assert loaded.generator.model_version == ckpt.name
    assert not any("lora_" in n for n, _ in loaded.generator.model.named_parameters())
    trained = RagGenerator.load(base, dtype="float32")
    from openbook.rag.adapters import load_trainable

    load_trainable(trained.model, ckpt / "generator_adapter").eval()
    trained.refresh()
    assert _answers(loaded.generator) == _answers(trained)
    assert _scores(loaded.generator) == pytest.approx(_scores(trained), abs=1e-4)
    untrained = _scores(RagGenerator.load(base))
    assert max(abs(a - b) for a, b in zip(_scores(trained), untrained, strict=True)) > 1e-3


def test_adapter_alone_with_the_retriever_frozen(make_cfg):
    result = train(make_cfg(steps=2, train_query_encoder=False, **LORA))
    assert verify_checkpoint(result.checkpoint).trained == ["generator"]
    assert not (result.checkpoint / "query_encoder").exists()


def test_an_adapter_is_refused_on_another_base(make_cfg, task, tmp_path):
    result = train(make_cfg(steps=1, **LORA))
    other = tmp_path / "other-bart"
    shutil.copytree(task.generator, other)
    model = RagGenerator.load(other, dtype="float32").model
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # same architecture, other weights
    model.save_pretrained(other, safe_serialization=True)
    with pytest.raises(CheckpointError, match="trained on base model") as caught:
        load_generator(result.checkpoint, base=other)
    assert isinstance(caught.value.__cause__ or caught.value, Exception)
    with pytest.raises(AdapterMismatch):
        RagGenerator.load(other).apply_adapter(result.checkpoint / "generator_adapter", other)
    # resuming that run on another base is refused before any step
    with pytest.raises(AdapterMismatch):
        train(make_cfg(steps=2, generator=other, **LORA))


def test_a_killed_lora_run_resumes_to_the_same_adapter(make_cfg, tmp_path):
    common = dict(steps=4, save_every=2, batch_size=3, eval_every=0, dev=None, **LORA)
    full = train(make_cfg(out=tmp_path / "full", **common))

    cfg = make_cfg(out=tmp_path / "resumed", **common)
    crash_at(cfg, 3)
    resumed = train(cfg)
    assert resumed.step == 4
    assert_same_tensors(
        full.checkpoint,
        resumed.checkpoint,
        ["generator_adapter/adapter_model.safetensors", "query_encoder/model.safetensors"],
    )
    # the same out, now without an adapter: refused, not silently mixed
    with pytest.raises(ConfigError, match="adapter"):
        train(make_cfg(out=tmp_path / "resumed", steps=6, eval_every=0, dev=None))


def test_merge_adapter_writes_a_plain_generator(make_cfg, tmp_path):
    result = train(make_cfg(steps=2, **LORA))
    out = tmp_path / "merged"
    run = CliRunner().invoke(merge_app, [str(result.checkpoint), "--out", str(out)])
    assert run.exit_code == 0, run.output
    merged = RagGenerator.load(out)
    assert merged.model_version == f"{result.checkpoint.name}-merged"
    assert not any("lora_" in n for n, _ in merged.model.named_parameters())
    assert _answers(merged) == _answers(load_checkpoint(result.checkpoint).generator)
    again = CliRunner().invoke(merge_app, [str(result.checkpoint), "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(generator_adapter="lora", lora_rank=0), "lora-rank"),
        (dict(generator_adapter="lora", lora_rank=1000), "lora-rank"),
        (dict(generator_adapter="lora", lora_alpha=0), "lora-alpha"),
        (dict(generator_adapter="lora", lora_dropout=1.0), "lora-dropout"),
        (dict(generator_adapter="lora", lora_targets=[]), "lora-targets"),
        (dict(generator_adapter="lora", train_generator=False), "generator-adapter"),
        (dict(generator_adapter="qlora"), "generator-adapter"),
    ],
)
def test_bad_adapter_options_fail_before_any_compute(make_cfg, options, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        TrainConfig.load(None, **{**make_cfg().model_dump(), **options})


def test_lora_spec_bounds():
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValueError, match="alpha"):
        LoraSpec(alpha=-1)


def test_attach_keeps_the_model_object_and_freezes_the_base(tmp_path):
    generator = RagGenerator.load(make_tiny_causal_lm(tmp_path / "lm"), dtype="float32")
    model = generator.model
    before = _answers(generator)
    peft_model = attach_lora(model, LoraSpec(rank=2))
    assert generator.model is model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert "lm_head" not in " ".join(trainable)
    generator.refresh()
    assert _answers(generator) == before  # B = 0 at the start: the same model
    assert peft_model.base_model.model is model


def test_wrapping_and_merging_an_adapter_say_nothing_about_peft_internals(tmp_path):
    # peft reads transformers' deprecated is_gradient_checkpointing: a FutureWarning every
    # service start printed, about code no user can change
    lm = make_tiny_causal_lm(tmp_path / "lm")
    generator = RagGenerator.load(lm, dtype="float32")
    fresh = RagGenerator.load(lm, dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = attach_lora(generator.model, LoraSpec(rank=2))
        peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
        merged(fresh.model, tmp_path / "adapter")
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
