"""How a (question, passage) pair becomes generator input text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from openbook.rag.errors import ModelLoadError

TITLE_SEP = " / "
DOC_SEP = " // "
PROMPT_FILE = "openbook_prompt.json"


def seq2seq_input(
    title: str,
    text: str,
    question: str,
    prefix: str | None = None,
    title_sep: str = TITLE_SEP,
    doc_sep: str = DOC_SEP,
) -> str:
    """The generator input ``RagRetriever.postprocess_docs`` builds for one passage.

    Titles in the DPR Wikipedia dump are often wrapped in double quotes; RAG drops one leading and
    one trailing quote, then collapses double spaces in the joined string. Reproduced exactly so
    that checkpoints fine-tuned with transformers see the input they were trained on.
    """
    title = title.removeprefix('"').removesuffix('"')
    return ((prefix or "") + title + title_sep + text + doc_sep + question).replace("  ", " ")


@dataclass
class PromptSpec:
    """Contents of ``openbook_prompt.json`` in a causal-LM model directory."""

    prefix: str = ""
    passage_template: str = "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:"
    stop: list[str] = field(default_factory=lambda: ["\n"])
    answer_prefix: str = " "
    add_bos: bool = True

    def passage_prompt(self, title: str, text: str, question: str) -> str:
        """Per-passage part of the prompt; the shared ``prefix`` is cached separately."""
        return self.passage_template.format(title=title, text=text, question=question)

    @classmethod
    def load(cls, path: Path) -> PromptSpec:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ModelLoadError(f"missing prompt file {path}") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"corrupt prompt file {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"corrupt prompt file {path}: expected a JSON object")
        spec = cls()
        for name in ("prefix", "passage_template", "answer_prefix"):
            if name in raw:
                if not isinstance(raw[name], str):
                    raise ModelLoadError(f"corrupt prompt file {path}: {name!r} must be a string")
                setattr(spec, name, raw[name])
        if "stop" in raw:
            stop = raw["stop"]
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise ModelLoadError(
                    f"corrupt prompt file {path}: 'stop' must be a list of non-empty strings"
                )
            spec.stop = list(stop)
        if "add_bos" in raw:
            spec.add_bos = bool(raw["add_bos"])
        try:
            spec.passage_prompt("t", "x", "q")
        except (KeyError, IndexError, ValueError) as e:
            raise ModelLoadError(
                f"corrupt prompt file {path}: passage_template must only use "
                f"{{title}}, {{text}} and {{question}} ({e!r})"
            ) from e
        return spec
