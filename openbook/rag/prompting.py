"""How a (question, passage) pair becomes generator input text."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from openbook.rag.errors import ModelLoadError

TITLE_SEP = " / "
DOC_SEP = " // "
PROMPT_FILE = "openbook_prompt.json"
PASSAGE_TEMPLATE = "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:"
# Written next to a seq2seq generator saved from a running backend (openbook.storage.checkpoint):
# how the backend builds its input (a RAG checkpoint keeps these in its RAG config, which a plain
# BART save drops) and the directory of the question-encoder tokenizer whose decoding the generator
# reads.
SEQ2SEQ_FILE = "openbook_seq2seq.json"
_SEQ2SEQ_STR = ("title_sep", "doc_sep")


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


def read_json(path: Path, what: str = "file") -> dict:
    """A JSON object from ``path``; :class:`ModelLoadError` ``missing <what> <path>`` or
    ``corrupt <what> <path>: ...`` when it is absent, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"missing {what} {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"corrupt {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"corrupt {what} {path}: expected a JSON object")
    return data


@dataclass
class PromptSpec:
    """Contents of ``openbook_prompt.json`` in a causal-LM model directory.

    The prompt for passage z is ``prefix + passage_template.format(title=, text=, question=)``
    (the shared ``prefix`` is cached once; with ``add_bos`` after the tokenizer's BOS token);
    the model continues it with ``answer_prefix + answer`` and stops at the first ``stop``
    string. Every field is optional in the file; ``stop`` may be one string.
    """

    prefix: str = ""
    passage_template: str = PASSAGE_TEMPLATE
    stop: list[str] = field(default_factory=lambda: ["\n"])
    answer_prefix: str = " "
    add_bos: bool = True

    def passage_prompt(self, title: str, text: str, question: str) -> str:
        """Per-passage part of the prompt; the shared ``prefix`` is cached separately."""
        return self.passage_template.format(title=title, text=text, question=question)

    def render(self, title: str, text: str, question: str) -> str:
        """The whole prompt text for one passage: ``prefix`` + :meth:`passage_prompt`."""
        return self.prefix + self.passage_prompt(title, text, question)

    def to_json(self) -> str:
        """The ``openbook_prompt.json`` text (``add_bos`` only when it is not the default)."""
        data = dataclasses.asdict(self)
        if self.add_bos:
            del data["add_bos"]
        return json.dumps(data, ensure_ascii=False, indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: object, where: str = "prompt") -> PromptSpec:
        """Validate a parsed ``openbook_prompt.json``; raises :class:`ModelLoadError` (a
        ``ValueError``) ``corrupt <where>: ...`` naming the offending field."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"corrupt {where}: expected a JSON object")
        spec = cls()
        for name in ("prefix", "passage_template", "answer_prefix"):
            if name in raw:
                if not isinstance(raw[name], str):
                    raise ModelLoadError(f"corrupt {where}: {name!r} must be a string")
                setattr(spec, name, raw[name])
        if "stop" in raw:
            stop = raw["stop"]
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise ModelLoadError(f"corrupt {where}: 'stop' must be a list of non-empty strings")
            spec.stop = list(stop)
        if "add_bos" in raw:
            spec.add_bos = bool(raw["add_bos"])
        try:
            spec.passage_prompt("t", "x", "q")
        except (KeyError, IndexError, ValueError) as e:
            raise ModelLoadError(
                f"corrupt {where}: passage_template must only use "
                f"{{title}}, {{text}} and {{question}} ({e!r})"
            ) from e
        return spec

    @classmethod
    def load(cls, path: Path) -> PromptSpec:
        """Read and validate a prompt file (:meth:`from_dict`)."""
        return cls.from_dict(read_json(path, "prompt file"), f"prompt file {path}")


def load_seq2seq_settings(path: Path) -> dict:
    """Validated contents of an ``openbook_seq2seq.json``: any of ``prefix`` (str or None),
    ``title_sep``, ``doc_sep`` (str), ``max_combined_length``, ``n_docs`` (positive int) and
    ``question_tokenizer`` (a sub-directory name or None)."""
    raw = read_json(path)
    out: dict = {}
    if "prefix" in raw:
        if raw["prefix"] is not None and not isinstance(raw["prefix"], str):
            raise ModelLoadError(f"corrupt file {path}: 'prefix' must be a string or null")
        out["prefix"] = raw["prefix"]
    for name in _SEQ2SEQ_STR:
        if name in raw:
            if not isinstance(raw[name], str):
                raise ModelLoadError(f"corrupt file {path}: {name!r} must be a string")
            out[name] = raw[name]
    for name in ("max_combined_length", "n_docs"):
        if raw.get(name) is not None:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelLoadError(f"corrupt file {path}: {name!r} must be a positive integer")
            out[name] = v
    q = raw.get("question_tokenizer")
    if q is not None:
        if not isinstance(q, str) or q in ("", ".", "..") or Path(q).name != q:
            raise ModelLoadError(
                f"corrupt file {path}: 'question_tokenizer' must name a sub-directory"
            )
        out["question_tokenizer"] = q
    return out
