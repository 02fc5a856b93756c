"""The default few-shot prompt of the offline generator (a base, not instruction-tuned, LM).

Written to ``openbook_prompt.json`` in the prepared model directory as the generator library
reads it (:class:`openbook.rag.prompting.PromptSpec`)::

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

from pathlib import Path

from openbook.rag.prompting import PASSAGE_TEMPLATE, PROMPT_FILE, PromptSpec

INSTRUCTION = (
    "Answer each question with the shortest span of words copied exactly from the passage."
)

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


def default_prompt() -> PromptSpec:
    """The default prompt shipped with the offline generator."""
    return PromptSpec(prefix=build_prefix())


def write_prompt(path: Path, prompt: PromptSpec | None = None) -> Path:
    """Write ``prompt`` (default: :func:`default_prompt`) as JSON; ``path`` may be a directory."""
    if path.is_dir():
        path = path / PROMPT_FILE
    path.write_text((prompt or default_prompt()).to_json(), encoding="utf-8")
    return path


def load_prompt(path: Path) -> PromptSpec:
    """Read a prompt file (or ``<dir>/openbook_prompt.json``) as the generator does."""
    return PromptSpec.load(path / PROMPT_FILE if path.is_dir() else path)
