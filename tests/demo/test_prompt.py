"""The default prompt round-trips through openbook_prompt.json in the documented format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openbook.rag.prompting import PromptSpec
from openbook_trainer.demo.data import REPO_DATA_DIR, SQUAD_QUESTIONS, read_jsonl
from openbook_trainer.demo.prompt import (
    FEW_SHOT_EXAMPLES,
    PROMPT_FILE,
    default_prompt,
    load_prompt,
    write_prompt,
)


def test_round_trip(tmp_path: Path) -> None:
    path = write_prompt(tmp_path)
    assert path == tmp_path / PROMPT_FILE
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert set(raw) == {"prefix", "passage_template", "stop", "answer_prefix"}
    assert raw["passage_template"] == (
        "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:"
    )
    assert raw["stop"] == ["\n"] and raw["answer_prefix"] == " "
    assert load_prompt(tmp_path) == default_prompt()


def test_render_is_prefix_plus_template() -> None:
    prompt = default_prompt()
    rendered = prompt.render("T", "Some text.", "Who?")
    assert rendered == prompt.prefix + "Title: T\nPassage: Some text.\nQuestion: Who?\nAnswer:"
    for title, _, question, answer in FEW_SHOT_EXAMPLES:
        assert f"Title: {title}\n" in prompt.prefix
        assert f"Question: {question}\nAnswer: {answer}\n\n" in prompt.prefix
    assert prompt.prefix.endswith("\n\n")


def test_examples_are_not_evaluation_questions() -> None:
    questions = {q["question"] for q in read_jsonl(REPO_DATA_DIR / SQUAD_QUESTIONS)}
    titles = {q["title"] for q in read_jsonl(REPO_DATA_DIR / SQUAD_QUESTIONS)}
    for title, _, question, _ in FEW_SHOT_EXAMPLES:
        assert question not in questions and title not in titles


def test_rejects_malformed() -> None:
    # The generator's own parser: what it refuses, the demo refuses (fields it lacks: defaults).
    with pytest.raises(ValueError):
        PromptSpec.from_dict({"prefix": "", "passage_template": "{passage}"})
    with pytest.raises(ValueError):
        PromptSpec.from_dict({"prefix": 3, "passage_template": "{text}"})
    with pytest.raises(ValueError):
        PromptSpec.from_dict({"prefix": "", "passage_template": "{text}", "stop": [""]})
    assert PromptSpec.from_dict({"prefix": ""}) == PromptSpec()


def test_generator_library_reads_it(tmp_path: Path) -> None:
    prompting = pytest.importorskip("openbook.rag.prompting")
    path = write_prompt(tmp_path)
    spec = prompting.PromptSpec.load(path)
    prompt = default_prompt()
    assert spec.prefix == prompt.prefix and spec.stop == prompt.stop
    assert spec.answer_prefix == prompt.answer_prefix
    assert spec.prefix + spec.passage_prompt("T", "x", "q?") == prompt.render("T", "x", "q?")
