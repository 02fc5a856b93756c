"""The default few-shot prompt of the offline generator (a base, not instruction-tuned, LM).

Written to ``openbook_prompt.json`` in the prepared model directory, in the format the generator
library (``openbook.rag``) reads::

    {"prefix": str, "passage_template": str, "stop": [str, ...], "answer_prefix": str}

The prompt for retrieved passage z is ``prefix + passage_template.format(title=, text=,
question=)``; the model continues it with the answer, whose text is ``answer_prefix + answer``
(the template ends with ``"Answer:"`` so the answer's first token carries the space), and
generation stops at the first stop string.

The four worked examples are written for this project (facts about Lake Baikal, the Eiffel Tower,
penicillin and Microsoft): none comes from the SQuAD or leaders data, so no evaluation question
leaks into the prompt. They cover "which", "how tall", "what" and "who is the <office>"
questions, the last with a predecessor in the passage as a distractor. The instruction and the
fourth example were chosen on SQuAD sample seed 1 (EM/F1 28.3/43.6 with three examples and "a
short span", 31.7/45.8 as now); the reported numbers use seed 0, not used for tuning.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPT_FILE = "openbook_prompt.json"

INSTRUCTION = (
    "Answer each question with the shortest span of words copied exactly from the passage."
)

PASSAGE_TEMPLATE = "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:"

FEW_SHOT_EXAMPLES: tuple[tuple[str, str, str, str], ...] = (
    (
        "Lake Baikal",
        "Lake Baikal is a rift lake in southern Siberia, Russia. It is the deepest lake in the "
        "world, reaching 1,642 metres, and holds about a fifth of the world's unfrozen fresh "
        "water. More than 300 rivers flow into the lake, but only one, the Angara, flows out.",
        "Which river flows out of Lake Baikal?",
        "the Angara",
    ),
    (
        "Eiffel Tower",
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is "
        "named after the engineer Gustave Eiffel, whose company built it for the 1889 World's "
        "Fair. The tower is 330 metres tall and was the tallest structure in the world until "
        "1930.",
        "How tall is the Eiffel Tower?",
        "330 metres",
    ),
    (
        "Penicillin",
        "Penicillin was discovered in 1928 by the Scottish scientist Alexander Fleming, who "
        "noticed that a mould had killed the bacteria growing in one of his culture dishes. Mass "
        "production began during the Second World War, when the drug was used to treat infected "
        "wounds among Allied soldiers.",
        "What was penicillin used to treat during the Second World War?",
        "infected wounds",
    ),
    (
        "Microsoft",
        "Microsoft is an American technology company founded by Bill Gates and Paul Allen in "
        "1975. Satya Nadella is its chief executive officer; he succeeded Steve Ballmer in "
        "2014.",
        "Who is the chief executive officer of Microsoft?",
        "Satya Nadella",
    ),
)


@dataclass(frozen=True)
class PromptTemplate:
    """A few-shot prompt in the ``openbook_prompt.json`` format."""

    prefix: str
    passage_template: str = PASSAGE_TEMPLATE
    stop: list[str] = field(default_factory=lambda: ["\n"])
    answer_prefix: str = " "

    def render(self, title: str, text: str, question: str) -> str:
        """The full prompt for one passage."""
        return self.prefix + self.passage_template.format(title=title, text=text, question=question)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> PromptTemplate:
        """Validate a parsed ``openbook_prompt.json``; raises ValueError when malformed."""
        prefix, template = raw.get("prefix"), raw.get("passage_template")
        stop, answer_prefix = raw.get("stop", ["\n"]), raw.get("answer_prefix", " ")
        if not isinstance(prefix, str) or not isinstance(template, str):
            raise ValueError("prefix and passage_template must be strings")
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not isinstance(answer_prefix, str):
            raise ValueError("answer_prefix must be a string")
        try:
            template.format(title="", text="", question="")
        except (KeyError, IndexError, ValueError) as exc:
            msg = f"passage_template: only {{title}}, {{text}}, {{question}} allowed ({exc!r})"
            raise ValueError(msg) from exc
        return cls(prefix, template, list(stop), answer_prefix)


def build_prefix(
    instruction: str = INSTRUCTION,
    examples: tuple[tuple[str, str, str, str], ...] = FEW_SHOT_EXAMPLES,
    passage_template: str = PASSAGE_TEMPLATE,
    answer_prefix: str = " ",
) -> str:
    """Instruction, then each worked example as a rendered passage followed by its answer."""
    parts = [instruction + "\n\n"]
    for title, text, question, answer in examples:
        shot = passage_template.format(title=title, text=text, question=question)
        parts.append(f"{shot}{answer_prefix}{answer}\n\n")
    return "".join(parts)


def default_prompt() -> PromptTemplate:
    """The default template shipped with the offline generator."""
    return PromptTemplate(prefix=build_prefix())


def write_prompt(path: Path, prompt: PromptTemplate | None = None) -> Path:
    """Write ``prompt`` (default: :func:`default_prompt`) as JSON; ``path`` may be a directory."""
    if path.is_dir():
        path = path / PROMPT_FILE
    path.write_text((prompt or default_prompt()).to_json(), encoding="utf-8")
    return path


def load_prompt(path: Path) -> PromptTemplate:
    """Read a prompt file (or ``<dir>/openbook_prompt.json``)."""
    if path.is_dir():
        path = path / PROMPT_FILE
    return PromptTemplate.from_dict(json.loads(path.read_text(encoding="utf-8")))
