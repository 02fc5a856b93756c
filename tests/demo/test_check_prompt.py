"""check_prompt decodes through openbook's generator: plain greedy decoding of the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openbook.rag.prompting import PromptSpec
from openbook.types import Passage
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_trainer.demo import check_prompt
from openbook_trainer.demo.check_prompt import GreedyAnswerer, QAItem

ITEMS = [
    QAItem(
        "Paris", "Paris is the capital of France.", "What is the capital of France?", ("Paris",)
    ),
    QAItem("Hamlet", "Hamlet is a play by Shakespeare.", "Who wrote Hamlet?", ("Shakespeare",)),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random causal LM; Gemma's sliding window is shorter than the prompts."""
    arch = request.param
    return make_tiny_causal_lm(tmp_path_factory.mktemp("lm") / arch, seed=3, arch=arch)


def _transformers_greedy(answerer: GreedyAnswerer, item: QAItem, max_new_tokens: int) -> str:
    """The answer transformers' own greedy ``generate`` gives for the same prompt tokens."""
    backend = answerer.generator.backend
    ids = backend.prefix_ids + backend.prompt_ids(
        item.question, Passage("g", item.title, item.text)
    )
    with torch.inference_mode():
        out = backend.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=backend.eos_token_id,
            pad_token_id=backend.pad_token_id,
        )
    text = backend.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    for stop in backend.spec.stop:
        text = text.split(stop, 1)[0]
    return text.strip()


def test_answers_are_greedy_decoding_of_the_prompt(tiny_lm: Path) -> None:
    answerer = GreedyAnswerer.load(tiny_lm, max_new_tokens=6)
    answers = [answerer.answer(item) for item in ITEMS]
    assert answers == [_transformers_greedy(answerer, item, 6) for item in ITEMS]
    assert all(answers)  # something was decoded: the comparison is not between two blanks


def test_a_given_prompt_replaces_the_model_directory_s(tiny_lm: Path) -> None:
    prompt = PromptSpec(prefix="Q and A.\n\n", passage_template="{title}: {text}\n{question}\n")
    answerer = GreedyAnswerer.load(tiny_lm, prompt, max_new_tokens=4)
    assert answerer.generator.backend.spec == prompt
    for item in ITEMS:
        assert answerer.answer(item) == _transformers_greedy(answerer, item, 4)


def test_main_reports_em_and_f1(tiny_lm: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    args = ["--model-dir", str(tiny_lm), "--data-dir", str(tiny_data_dir), "--squad", "3"]
    results = check_prompt.main([*args, "--no-leaders", "--max-new-tokens", "4", "--out", str(out)])
    (name,) = results["sets"]
    assert name == "squad (seed 0)" and results["sets"][name]["n"] == 3
    assert 0 <= results["sets"][name]["em"] <= results["sets"][name]["f1"] <= 100
    assert json.loads(out.read_text()) == results
