from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openbook.storage.artifacts import machine_tag
from openbook.storage.checkpoint import latest_checkpoint, verify_checkpoint
from openbook_testkit.training import crash_at
from openbook_trainer.config import ConfigError
from openbook_trainer.loop import train


@pytest.mark.parametrize("mode", ["rag-token", "rag-sequence"])
def test_loss_decreases(make_cfg, mode):
    losses: list[float] = []
    cfg = make_cfg(mode=mode, steps=30, batch_size=8, lr_generator=3e-3, lr_query_encoder=3e-3)
    result = train(cfg, on_step=lambda step, loss: losses.append(loss))
    assert result.step == 30 and len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, losses
    assert {"dev_loss", "dev_em", "dev_f1", "dev_recall@1", "dev_recall@3"} <= set(result.metrics)
    manifest = verify_checkpoint(result.checkpoint)
    assert manifest.step == 30 and manifest.trained == ["query_encoder", "generator"]
    assert manifest.metrics["dev_loss"] == pytest.approx(result.metrics["dev_loss"])


def _weights(ckpt):
    return {
        **{f"g.{k}": v for k, v in load_file(ckpt / "generator" / "model.safetensors").items()},
        **{f"q.{k}": v for k, v in load_file(ckpt / "query_encoder" / "model.safetensors").items()},
    }


def test_resume_matches_uninterrupted_run(make_cfg, tmp_path):
    # dropout on, grad accumulation and warm-up on: the resumed run must restore RNG, data
    # position, optimizer moments and scheduler to end bit-identical.
    common = dict(
        steps=4, save_every=2, grad_accum=2, batch_size=3, warmup_steps=2, eval_every=0, dev=None
    )
    full = train(make_cfg(out=tmp_path / "full", **common))
    assert full.step == 4

    cfg = make_cfg(out=tmp_path / "resumed", **common)
    crash_at(cfg, 3)
    assert latest_checkpoint(cfg.out).name == "step-000002"
    resumed = train(cfg)
    assert resumed.step == 4 and resumed.checkpoint.name == "step-000004"

    a, b = _weights(full.checkpoint), _weights(resumed.checkpoint)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa = torch.load(full.checkpoint / "trainer_state.pt", weights_only=True)
    sb = torch.load(resumed.checkpoint / "trainer_state.pt", weights_only=True)
    assert sa["cursor"] == sb["cursor"] == 8
    assert sa["scheduler"] == sb["scheduler"]
    assert sb["optimizer"]["state"][0]["step"] == 4

    # a finished run resumes to "nothing to do"
    again = train(cfg)
    assert again.step == 4


def test_partials_of_killed_runs_are_cleared_on_start_and_on_resume(make_cfg):
    cfg = make_cfg(steps=1, eval_every=0, dev=None)

    def left_by_killed_writer(step: int) -> Path:
        """A partial from this machine whose writer is gone (nothing holds its lock)."""
        partial = cfg.out / f".step-{step:06d}.tmp-{machine_tag()}-999999-0123abcd"
        (partial / "generator").mkdir(parents=True)
        (partial / "generator" / "config.json").write_text("{}")
        then = time.time() - 3600
        for p in (partial / "generator" / "config.json", partial / "generator", partial):
            os.utime(p, (then, then))
        return partial

    first = left_by_killed_writer(1)
    assert train(cfg).step == 1
    assert not first.exists()
    second = left_by_killed_writer(2)
    assert train(make_cfg(steps=2, eval_every=0, dev=None)).step == 2  # resumes from step 1
    assert not second.exists()
    assert [p.name for p in cfg.out.iterdir() if p.name.startswith(".")] == []


def test_frozen_retriever_ablation_keeps_query_encoder(make_cfg, task):
    result = train(make_cfg(train_query_encoder=False, steps=2))
    manifest = verify_checkpoint(result.checkpoint)
    assert manifest.trained == ["generator"]
    assert not (result.checkpoint / "query_encoder").exists()  # the index's own encoder serves


def test_resume_refuses_other_data(make_cfg, tmp_path, task):
    train(make_cfg(steps=1))
    other = tmp_path / "other.jsonl"
    other.write_text(task.train.read_text() + '{"question": "x ?", "answers": ["c1"]}\n')
    with pytest.raises(ConfigError, match="different data"):
        train(make_cfg(train=other, steps=2))
    assert train(make_cfg(train=other, steps=1, resume=False)).step == 1


def test_bad_setup_is_reported(make_cfg, task):
    with pytest.raises(ConfigError, match="exceeds the 8 passages"):
        train(make_cfg(k=9))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        if torch.cuda.is_available():
            raise ConfigError("needs a CUDA device (skipped on GPU machines)")
        train(make_cfg(precision="fp16"))


def test_cpu_autocast_follows_the_processor(monkeypatch):
    from openbook_trainer import loop

    cpu = torch.device("cpu")
    monkeypatch.setattr(loop, "cpu_has_native_bf16", lambda: True)
    assert loop._pick_amp_dtype("auto", cpu) == torch.bfloat16
    assert loop._pick_amp_dtype("bf16", cpu) == torch.bfloat16
    assert loop._pick_amp_dtype("fp32", cpu) is None
    monkeypatch.setattr(loop, "cpu_has_native_bf16", lambda: False)
    assert loop._pick_amp_dtype("auto", cpu) is None
    with pytest.raises(ConfigError, match="native bf16"):
        loop._pick_amp_dtype("bf16", cpu)


def test_causal_lm_generator(make_cfg, tmp_path):
    from openbook_testkit.rag import make_tiny_causal_lm
    from openbook_trainer.checkpoints import load_checkpoint

    lm = make_tiny_causal_lm(tmp_path / "lm")
    result = train(make_cfg(generator=lm, steps=2, mode="rag-sequence", eval_max_examples=2))
    assert (result.checkpoint / "generator" / "openbook_prompt.json").is_file()
    loaded = load_checkpoint(result.checkpoint)
    assert loaded.generator.model_type == "causal"
    assert loaded.generator.model_version == result.checkpoint.name
