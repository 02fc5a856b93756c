"""The retraining experiment (openbook_trainer/experiments/retrain.py) on tiny models: it trains
a generator adapter on every training article's question and none of a development article's,
through the hybrid prior with the given query encoder adapter frozen, resumes instead of
starting over, and exports the candidate in data/adapters' layout for the trust experiment."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openbook.storage.checkpoint import (
    generator_adapter_dir,
    query_encoder_adapter_dir,
    read_manifest,
    verify_checkpoint,
)
from openbook_trainer.experiments import retrain, trust
from openbook_trainer.experiments.finetune import split_by_article
from openbook_trainer.experiments.synthetic import SyntheticTask
from openbook_trainer.loop import train


@pytest.fixture()
def setup(
    task: SyntheticTask, make_cfg, hybrid_index: Path, tmp_path: Path
) -> retrain.RetrainConfig:
    # A query encoder adapter as the shipped one is made: by joint training.
    joint = train(
        make_cfg(
            index=hybrid_index,
            out=tmp_path / "joint",
            steps=1,
            dev=None,
            generator_adapter="lora",
            query_encoder_adapter="lora",
            lora_rank=4,
        )
    )
    assert joint.checkpoint is not None
    q_adapter = query_encoder_adapter_dir(joint.checkpoint)
    assert q_adapter is not None
    # Questions with articles: the synthetic task's, one article per pair of entities.
    rows = [json.loads(line) for line in task.train.read_text().splitlines() if line]
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({**r, "title": f"article {n // 2}"}) + "\n" for n, r in enumerate(rows))
    )
    return retrain.RetrainConfig(
        questions=questions,
        index_root=hybrid_index.parent,
        generator=task.generator,
        query_encoder_adapter=q_adapter,
        out=tmp_path / "retrain",
        index=hybrid_index.name,
        dev_articles=1,
        k=3,
        steps=2,
        batch_size=2,
        warmup_steps=1,
        lora_rank=4,
        save_every=1,
    )


def test_retrain_trains_on_the_training_articles_and_exports(
    setup: retrain.RetrainConfig, tmp_path: Path
) -> None:
    config = setup
    result = retrain.run_retrain(config)
    assert result.step == 2 and result.checkpoint is not None
    manifest = verify_checkpoint(result.checkpoint)
    assert manifest.trained == ["generator"]  # the query encoder stays the fusion's
    assert manifest.config["retrieval"] == "hybrid"
    assert generator_adapter_dir(result.checkpoint) is not None
    assert query_encoder_adapter_dir(result.checkpoint) is None

    # Every training article's question, none of a development article's.
    train_titles, dev_titles = split_by_article(config.questions, 1, 0)
    trained = [
        json.loads(line)["id"] for line in (config.out / "train.jsonl").read_text().splitlines()
    ]
    by_title = {
        json.loads(line)["id"]: json.loads(line)["title"]
        for line in config.questions.read_text().splitlines()
    }
    assert {by_title[i] for i in trained} == set(train_titles)
    assert sum(t in dev_titles for t in by_title.values()) > 0
    assert len(trained) == sum(t in train_titles for t in by_title.values())

    # The same command again resumes: no step is trained twice.
    log = config.out / "checkpoints" / "train_log.jsonl"
    before = log.read_text()
    again = retrain.run_retrain(config)
    assert again.step == 2 and log.read_text().count('"loss"') == before.count('"loss"')

    dest = tmp_path / "candidate"
    assert retrain.export_candidate(config, dest) == result.checkpoint
    adapter = dest / retrain.GENERATOR_ADAPTER / "adapter_model.safetensors"
    assert (
        adapter.read_bytes()
        == (result.checkpoint / "generator_adapter" / "adapter_model.safetensors").read_bytes()
    )
    q_weights = config.query_encoder_adapter / "adapter_model.safetensors"
    assert (dest / retrain.QUERY_ENCODER_ADAPTER / "adapter_model.safetensors").read_bytes() == (
        q_weights.read_bytes()
    )
    assert json.loads((dest / "checkpoint.json").read_text())["step"] == 2
    assert read_manifest(result.checkpoint).step == 2

    # The trust experiment judges it as system 5, paired with the shipped default.
    systems = trust.default_systems(tmp_path / "shipped", dest)
    assert len(systems) == 5 and systems[-1].compare_with == trust.SHIPPED
    assert systems[-1].generator_adapter == str(dest / retrain.GENERATOR_ADAPTER)
    # A retrained adapter under the same folder name is another version: no answer reused.
    version = trust.adapter_version(systems[-1].generator_adapter)
    assert version.startswith(f"{retrain.GENERATOR_ADAPTER}@")
    other = tmp_path / "other" / retrain.GENERATOR_ADAPTER
    shutil.copytree(dest / retrain.GENERATOR_ADAPTER, other)
    assert trust.adapter_version(str(other)) == version
    with (other / "adapter_model.safetensors").open("ab") as f:
        f.write(b" ")
    assert trust.adapter_version(str(other)) != version


def test_export_without_a_checkpoint_says_so(setup: retrain.RetrainConfig, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no checkpoint under .*: train first"):
        retrain.export_candidate(setup, tmp_path / "nothing")
