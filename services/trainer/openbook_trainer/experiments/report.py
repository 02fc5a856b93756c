"""Write an experiment's table into a section of docs/results.md, leaving the rest as is."""

from __future__ import annotations

import re
from pathlib import Path


def write_section(path: Path, name: str, title: str, body: str, command: str) -> None:
    """Replace (or append) the section between ``<!-- name -->`` markers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Results\n"
    section = (
        f"<!-- {name} -->\n## {title}\n\nProduced by:\n\n```bash\n{command}\n```\n\n"
        f"{body}\n<!-- /{name} -->"
    )
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")
