"""The fine-tuning experiment's data (openbook_trainer/experiments/finetune.py): split by
article, so no development article's question is ever trained on; deterministic; and bad
training data fails before any compute."""

from __future__ import annotations

import json

import pytest

from openbook_testkit.stack import REPO_ROOT
from openbook_trainer.data import DataError
from openbook_trainer.experiments.finetune import FinetuneConfig, make_split, split_by_article
from openbook_trainer.loop import train

QUESTIONS = REPO_ROOT / "data" / "squad" / "questions.jsonl"


def test_the_split_is_by_article_and_deterministic(tmp_path):
    config = FinetuneConfig(
        questions=QUESTIONS,
        index_root=tmp_path,
        generator=tmp_path,
        out=tmp_path,
        dev_articles=10,
        train_examples=500,
        dev_examples=50,
    )
    split = make_split(config)
    assert len(split.dev_articles) == 10 and len(split.train_articles) == 30
    assert not set(split.dev_articles) & set(split.train_articles)
    assert {q["title"] for q in split.dev} <= set(split.dev_articles)
    assert {q["title"] for q in split.train} <= set(split.train_articles)
    assert (len(split.train), len(split.dev)) == (500, 50)
    again = make_split(config)
    assert [q["id"] for q in again.train] == [q["id"] for q in split.train]
    assert split_by_article(QUESTIONS, 10, seed=1) != split_by_article(QUESTIONS, 10, seed=0)
    with pytest.raises(ValueError, match="dev_articles"):
        split_by_article(QUESTIONS, 40, seed=0)


def test_training_data_without_answers_fails_before_any_compute(make_cfg, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]})
        + "\n"
        + json.dumps({"question": "Who painted the Mona Lisa?"})
        + "\n"
    )
    steps: list[int] = []
    with pytest.raises(DataError, match=r"bad.jsonl:2: needs .* under one of .*answers"):
        train(make_cfg(train=bad, generator_adapter="lora"), on_step=lambda s, _: steps.append(s))
    assert steps == []
