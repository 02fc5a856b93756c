"""The images of ``services/Dockerfile``, read as text: one target per service on shared stages.

An image's instructions are those of its target's stage, of the stages it is built ``FROM``
(the first one's first) and of the stages it copies from (``COPY --from``): what goes into it.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "services" / "Dockerfile"
FROM = re.compile(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", re.IGNORECASE)
COPY_FROM = re.compile(r"^COPY\s+--from=(\S+)\s", re.IGNORECASE)


def stages(text: str | None = None) -> dict[str, tuple[str, list[str]]]:
    """Each stage by name: its base (an image or an earlier stage) and its instructions after
    ``FROM``, comments and blank lines left out, continued lines joined."""
    text = DOCKERFILE.read_text() if text is None else text
    found: dict[str, tuple[str, list[str]]] = {}
    instructions: list[str] = []
    for line in re.sub(r"\\\n\s*", "", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if match := FROM.match(line):
            base, name = match.groups()
            assert name, f"{DOCKERFILE}: every stage is named: {line!r}"
            instructions = []
            found[name] = (base, instructions)
        else:
            assert found, f"{DOCKERFILE}: {line!r} before the first FROM"
            instructions.append(line)
    return found


def image(target: str, text: str | None = None) -> list[str]:
    """The instructions that build ``target``'s image, in order, the stages it copies from
    included (before the instruction that copies from them)."""
    every = stages(text)
    base, own = every[target]
    lines = image(base, text) if base in every else []
    for line in own:
        if match := COPY_FROM.match(line):
            lines += image(match.group(1), text)
        lines.append(line)
    return lines
